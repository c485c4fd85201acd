// Compressed all-reduce: the result is exactly decode(encode(rank-order FP32 sum of the decoded
// contributions)); its error against the exact sum stays within the bound derived in
// compression.hpp; bytes on the wire match the format; with error feedback the running sum of
// INT4 all-reduces tracks the exact running sum (the residuals stay bounded, the gap does not grow).
#include <catch2/catch.hpp>

#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <tessel/collectives.hpp>
#include <tessel/collectives/compression.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_collectives_compression {

using namespace tessel;

namespace {
std::vector<float> rank_data(int r, std::size_t count, std::uint64_t seed) {
  std::mt19937 g(static_cast<std::uint32_t>(seed * 131 + static_cast<std::uint64_t>(r)));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t chunk = i / 256;
    // every magnitude a gradient bucket holds, down to FP32 subnormals (tiny chunks once made
    // BF16's scale underflow to 0 and the result NaN)
    constexpr float mags[] = {1e-3f, 100.0f, 0.0f, 1.0f, 1e-9f, 1e-41f, 1e-20f};
    const float mag = mags[chunk % 7];
    v[i] = nd(g) * mag;
  }
  return v;
}
}  // namespace

TEST_CASE("compressed all_reduce: exact decode/encode semantics and the derived error bound", "[collectives][compression]") {
  for (wire_format f : {wire_format::bf16, wire_format::e4m3, wire_format::e5m2, wire_format::int4})
    for (int n : {2, 3, 5}) {
      const std::size_t count = 5000;
      const compression_options opt{f, 256};
      std::vector<std::vector<float>> in(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) in[r] = rank_data(r, count, 7);
      // the expected result, per owner block, computed here from the same definition
      std::vector<float> want(count), yhat(count), bound(count);
      std::vector<double> exact(count, 0.0);
      const auto off = detail::even_blocks(count, n);
      for (int b = 0; b < n; ++b) {
        const std::size_t lo = off[b], m = off[b + 1] - lo;
        std::vector<float> acc(m), dec(m), err(m, 0.0f), absx(m, 0.0f);
        for (int r = 0; r < n; ++r) {
          std::vector<std::byte> enc(wire_bytes(f, m, opt.chunk));
          compression_impl::encode(f, opt.chunk, in[r].data() + lo, m, enc.data(), nullptr);
          compression_impl::decode(f, opt.chunk, enc.data(), m, dec.data());
          for (std::size_t i = 0; i < m; ++i) {
            acc[i] = r == 0 ? dec[i] : acc[i] + dec[i];
            const float x = in[r][lo + i];
            exact[lo + i] += x;
            absx[i] += std::fabs(x);
            const float s = chunk_scale(f, in[r].data() + lo + i / opt.chunk * opt.chunk, std::min(opt.chunk, m - i / opt.chunk * opt.chunk));
            const auto p = wire_params_of(f);
            err[i] += f == wire_format::int4 ? static_cast<float>(s / 2 + 0x1p-22 * std::fabs(x))
                                             : static_cast<float>(std::max(p.u * std::fabs(x), p.eta * s));
          }
        }
        std::vector<std::byte> enc(wire_bytes(f, m, opt.chunk));
        compression_impl::encode(f, opt.chunk, acc.data(), m, enc.data(), nullptr);
        compression_impl::decode(f, opt.chunk, enc.data(), m, want.data() + lo);
        const auto p = wire_params_of(f);
        const double gamma = (n - 1) * 0x1p-24 / (1 - (n - 1) * 0x1p-24);
        for (std::size_t i = 0; i < m; ++i) {
          const float sy = chunk_scale(f, acc.data() + i / opt.chunk * opt.chunk, std::min(opt.chunk, m - i / opt.chunk * opt.chunk));
          const double dy = f == wire_format::int4 ? sy / 2.0 + 0x1p-22 * std::fabs(acc[i]) : std::max(p.u * std::fabs(acc[i]), p.eta * sy);
          bound[lo + i] = static_cast<float>(err[i] + gamma * absx[i] * (1 + p.u) + dy);
        }
      }
      std::mutex mu;
      std::vector<std::string> problems;
      threads_world::run(n, [&](threads_transport t) {
        communicator c(std::move(t));
        std::vector<float> out(count);
        const auto st = all_reduce_compressed(c, in[c.rank()], out, reduce_op::sum, opt);
        std::size_t wrong = 0, over = 0, nonfinite = 0;
        for (std::size_t i = 0; i < count; ++i) {
          nonfinite += !std::isfinite(out[i]);
          wrong += std::memcmp(&out[i], &want[i], 4) != 0;
          over += std::fabs(static_cast<double>(out[i]) - exact[i]) > bound[i] * (1 + 1e-6) + 1e-30;
        }
        const double expect_bpe = 2.0 * (n - 1) / n * (static_cast<double>(wire_params_of(f).bits) / 8 + 4.0 / 256);
        std::lock_guard lk(mu);
        if (nonfinite) problems.push_back(std::to_string(nonfinite) + " elements are not finite");
        if (wrong) problems.push_back(std::to_string(wrong) + " elements differ from decode(encode(sum))");
        if (over) problems.push_back(std::to_string(over) + " elements exceed the derived bound");
        if (std::fabs(st.wire_bytes_per_element - expect_bpe) > 0.02 * expect_bpe)
          problems.push_back("wire bytes/element " + std::to_string(st.wire_bytes_per_element) + " vs " + std::to_string(expect_bpe));
      });
      for (auto& s : problems) FAIL_CHECK(std::string(wire_format_name(f)) << " n=" << n << ": " << s);
    }
}

TEST_CASE("compressed all_reduce: with error feedback the INT4 running sum tracks the exact running sum", "[collectives][compression]") {
  const int n = 4, rounds = 60;
  const std::size_t count = 2048;
  std::mutex mu;
  double gap_ef_mid = 0, gap_ef_end = 0, gap_plain_end = 0, resid_max = 0, resid_bound = 0;
  threads_world::run(n, [&](threads_transport t) {
    communicator c(std::move(t));
    std::mt19937 g(99u + static_cast<std::uint32_t>(c.rank()));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    error_feedback ef;
    std::vector<double> run_ef(count, 0), run_plain(count, 0), run_exact(count, 0);
    std::vector<float> grad(count), out(count), out2(count), all(count);
    double my_gap_mid = 0, rmax = 0, rb = 0;
    for (int t = 0; t < rounds; ++t) {
      // a small bias on top of noise: plain INT4 rounds much of the bias away every round
      for (std::size_t i = 0; i < count; ++i) grad[i] = 0.03f + nd(g);
      all_reduce_compressed(c, grad, out, reduce_op::sum, {wire_format::int4, 256}, &ef);
      all_reduce_compressed(c, grad, out2, reduce_op::sum, {wire_format::int4, 256});
      c.all_reduce(grad.data(), all.data(), count, dtype::f32, reduce_op::sum);
      for (std::size_t i = 0; i < count; ++i) {
        run_ef[i] += out[i];
        run_plain[i] += out2[i];
        run_exact[i] += all[i];
      }
      rmax = std::max(rmax, static_cast<double>(ef.max_abs()));
      // a residual is at most half a step: amax(chunk)/7/2 with |data| < ~6 here (+ the carried residual)
      rb = std::max(rb, 0.5 * 7.0 / 7.0);
      if (t == rounds / 2 - 1)
        for (std::size_t i = 0; i < count; ++i) my_gap_mid = std::max(my_gap_mid, std::fabs(run_ef[i] - run_exact[i]));
    }
    double ge = 0, gp = 0;
    for (std::size_t i = 0; i < count; ++i) {
      ge = std::max(ge, std::fabs(run_ef[i] - run_exact[i]));
      gp = std::max(gp, std::fabs(run_plain[i] - run_exact[i]));
    }
    std::lock_guard lk(mu);
    gap_ef_mid = std::max(gap_ef_mid, my_gap_mid);
    gap_ef_end = std::max(gap_ef_end, ge);
    gap_plain_end = std::max(gap_plain_end, gp);
    resid_max = std::max(resid_max, rmax);
    resid_bound = std::max(resid_bound, rb);
  });
  INFO("gap with EF: mid " << gap_ef_mid << ", end " << gap_ef_end << "; without EF " << gap_plain_end << "; max residual " << resid_max);
  // S_T - R_T = -(sum_r e_r,T + f_T): bounded by (n + 1) residuals, independent of T
  CHECK(gap_ef_end <= (n + 1) * resid_max * 1.01 + 1e-3);
  CHECK(gap_ef_end < 2 * gap_ef_mid + (n + 1) * resid_max);  // does not grow with the number of rounds
  CHECK(gap_plain_end > 2 * gap_ef_end);                     // and beats compression without feedback
  CHECK(resid_max < 3.0);                                    // half an INT4 step of |data| <~ 6, doubled margin
}

TEST_CASE("compressed all_reduce: bad arguments", "[collectives][compression][errors]") {
  std::mutex mu;  // Catch assertions are not thread-safe: serialize them
  threads_world::run(2, [&](threads_transport t) {
    communicator c(std::move(t));
    std::vector<float> a(8), b(9);
    auto check = [&](auto f, errc code) {
      bool ok = false;
      try {
        f();
      } catch (const comm_error& e) { ok = e.code() == code && std::string(e.what()).rfind("tessel::comm: all_reduce_compressed: ", 0) == 0; }
      std::lock_guard lk(mu);
      CHECK(ok);
    };
    check([&] { all_reduce_compressed(c, a, b, reduce_op::sum); }, errc::invalid_argument);
    check([&] { all_reduce_compressed(c, a, a, reduce_op::max); }, errc::invalid_argument);
    check([&] { all_reduce_compressed(c, a, a, reduce_op::sum, {wire_format::int4, 0}); }, errc::invalid_argument);
    error_feedback ef;
    all_reduce_compressed(c, a, a, reduce_op::sum, {wire_format::int4, 4}, &ef);
    std::vector<float> big(16);
    check([&] { all_reduce_compressed(c, big, big, reduce_op::sum, {wire_format::int4, 4}, &ef); }, errc::invalid_argument);
  });
}

}  // namespace tessel_test_collectives_compression
