// 30: collectives over the threads transport. Four threads act as four ranks; each all-reduces a
// gradient with the default algorithm and with every named one, and checks that all give the same
// bits (tessel reduces every element in rank order 0..n-1, whatever the algorithm), then runs an
// asynchronous all-gather while "computing".
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include <tessel/collectives.hpp>

int main() {
  using namespace tessel;
  std::mutex print;
  threads_world::run(4, [&](threads_transport t) {
    communicator comm(std::move(t));
    const int r = comm.rank();
    std::vector<float> grad(1 << 16);
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = 0.001f * static_cast<float>((i * 7 + static_cast<std::size_t>(r) * 13) % 101);

    std::vector<float> sum(grad.size());
    comm.all_reduce(std::span<const float>(grad), std::span<float>(sum), reduce_op::sum);  // default: chosen by size
    bool same = true;
    for (algorithm a : {algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree}) {
      std::vector<float> other(grad.size());
      comm.all_reduce(grad.data(), other.data(), grad.size(), dtype::f32, reduce_op::sum, {a});
      same &= std::memcmp(other.data(), sum.data(), sum.size() * sizeof(float)) == 0;
    }
    // bf16 is reduced in FP32 and rounded once
    std::vector<bf16> g16(grad.size()), avg16(grad.size());
    for (std::size_t i = 0; i < grad.size(); ++i) g16[i] = bf16(grad[i]);
    comm.all_reduce(g16.data(), avg16.data(), g16.size(), dtype::bf16, reduce_op::avg);

    // overlap: start an all-gather, do other work, then wait
    std::vector<int> ids(4);
    request h = comm.all_gather_async(&r, ids.data(), 1, dtype::i32);
    double busy = 0;
    for (int i = 0; i < 100000; ++i) busy += 1e-6 * i;
    h.wait();

    std::lock_guard lk(print);
    std::printf("rank %d: sum[1] = %g, all algorithms bitwise equal: %s, bf16 avg[1] = %g, ranks seen %d%d%d%d (%g)\n", r,
                static_cast<double>(sum[1]), same ? "yes" : "NO", static_cast<double>(static_cast<float>(avg16[1])), ids[0], ids[1], ids[2], ids[3],
                busy > 0 ? 1.0 : 0.0);
  });
}
