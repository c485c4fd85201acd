// 31: compressed all-reduce. Gradients travel as E4M3 (one scale per 256 values) or INT4 with
// error feedback; the example prints bytes on the wire per element and how far the running sum of
// compressed all-reduces drifts from the exact one, with and without feedback.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <tessel/collectives.hpp>

int main() {
  using namespace tessel;
  threads_world::run(4, [&](threads_transport t) {
    communicator comm(std::move(t));
    std::mt19937 rng(1u + static_cast<unsigned>(comm.rank()));
    std::normal_distribution<float> noise(0.0f, 1.0f);
    const std::size_t n = 4096;
    std::vector<float> g(n), exact(n), e4(n), q4(n), q4ef(n);
    std::vector<double> run_exact(n), run_q4(n), run_q4ef(n);
    error_feedback ef;
    compression_stats st8, st4;
    for (int step = 0; step < 50; ++step) {
      for (auto& v : g) v = 0.02f + noise(rng);
      comm.all_reduce(g.data(), exact.data(), n, dtype::f32, reduce_op::sum);
      st8 = all_reduce_compressed(comm, g, e4, reduce_op::sum, {wire_format::e4m3, 256});
      st4 = all_reduce_compressed(comm, g, q4, reduce_op::sum, {wire_format::int4, 256});
      all_reduce_compressed(comm, g, q4ef, reduce_op::sum, {wire_format::int4, 256}, &ef);
      for (std::size_t i = 0; i < n; ++i) {
        run_exact[i] += exact[i];
        run_q4[i] += q4[i];
        run_q4ef[i] += q4ef[i];
      }
    }
    double d_plain = 0, d_ef = 0;
    for (std::size_t i = 0; i < n; ++i) {
      d_plain = std::max(d_plain, std::fabs(run_q4[i] - run_exact[i]));
      d_ef = std::max(d_ef, std::fabs(run_q4ef[i] - run_exact[i]));
    }
    if (comm.rank() == 0)
      std::printf(
          "bytes on the wire per element (both phases, per rank): f32 %.2f, e4m3 %.2f, int4 %.2f\n"
          "running-sum drift after 50 steps: int4 %.3f, int4 + error feedback %.3f\n",
          8.0 * 3 / 4, st8.wire_bytes_per_element, st4.wire_bytes_per_element, d_plain, d_ef);
  });
}
