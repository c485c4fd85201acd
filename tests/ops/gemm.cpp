// GEMM: fp64 references with the gamma_K bound, integer inputs bitwise, shape sweeps over
// {0,1,7,33,127,129,1000}, every transpose x dtype x epilogue, 1 vs 2 threads bitwise, typed errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/gemm.hpp>

#include "reference/gemm_ref.hpp"
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_gemm {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {

host_device& dev2() {
  static host_device d(2);
  return d;
}
host_device& dev1() {
  static host_device d(1);
  return d;
}

template <class TA, class TB, class TC>
struct gemm_case {
  std::size_t M, N, K;
  bool ta, tb;
  std::vector<TA> A;
  std::vector<TB> B;
  std::vector<TC> C;
  std::size_t lda, ldb, ldc;
  gemm_case(std::size_t m, std::size_t n, std::size_t k, bool a_t, bool b_t, std::size_t pad = 0) : M(m), N(n), K(k), ta(a_t), tb(b_t) {
    lda = (ta ? M : K) + pad;
    ldb = (tb ? K : N) + pad;
    ldc = N + pad;
    lda = lda ? lda : 1;
    ldb = ldb ? ldb : 1;
    ldc = ldc ? ldc : 1;
    A.resize((ta ? K : M) * lda);
    B.resize((tb ? N : K) * ldb);
    C.resize(M * ldc);
  }
  template <class Chain = epilogue::chain<>>
  void run(host_device& d, float alpha, float beta, const Chain& ep = {}, const gemm_scales& s = {}) {
    gemm(d, ta ? transpose::yes : transpose::none, tb ? transpose::yes : transpose::none, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta,
         C.data(), ldc, ep, s);
  }
};

// Checks C against the reference with DESIGN's bound; returns the number of violations.
template <class TC>
std::size_t check_bound(const std::vector<TC>& C, std::size_t ldc, const ref::gemm_result& r, std::size_t M, std::size_t N, std::size_t K) {
  return ref::gemm_violations(C, ldc, r, M, N, K);
}

template <class TC>
std::size_t check_exact(const std::vector<TC>& C, std::size_t ldc, const ref::gemm_result& r, std::size_t M, std::size_t N) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j)
      if (ref::to_d(C[i * ldc + j]) != r.c[i * N + j]) ++bad;
  return bad;
}

const std::size_t sweep[] = {0, 1, 7, 33, 127, 129};

}  // namespace

TEST_CASE("f32 gemm: shape sweep x transposes within gamma_K", "[ops][gemm]") {
  std::mt19937 g(1);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::size_t M : sweep)
        for (std::size_t N : sweep)
          for (std::size_t K : sweep) {
            gemm_case<float, float, float> c(M, N, K, ta, tb, (M + N + K) % 3);
            ref::fill_real(c.A, g);
            ref::fill_real(c.B, g);
            ref::fill_real(c.C, g);
            auto r = ref::gemm(ta, tb, M, N, K, 1.5, c.A.data(), c.lda, c.B.data(), c.ldb, -0.5, c.C.data(), c.ldc);
            c.run(dev2(), 1.5f, -0.5f);
            INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
            REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
          }
}

TEMPLATE_TEST_CASE("integer-valued inputs match the fp64 reference bitwise", "[ops][gemm]", float, bf16, fp16, e4m3, e5m2) {
  std::mt19937 g(2);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::size_t M : {1, 7, 33, 129})
        for (std::size_t N : {1, 33, 127})
          for (std::size_t K : {1, 7, 129, 300}) {
            gemm_case<TestType, TestType, float> c(M, N, K, ta, tb);
            ref::fill_int(c.A, g);
            ref::fill_int(c.B, g);
            ref::fill_int(c.C, g);
            auto r = ref::gemm(ta, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 2.0, c.C.data(), c.ldc);
            c.run(dev2(), 1.0f, 2.0f);
            INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
            REQUIRE(check_exact(c.C, c.ldc, r, M, N) == 0);
          }
}

TEMPLATE_TEST_CASE("narrow inputs: real values within gamma_K, f32 and bf16 outputs", "[ops][gemm]", bf16, fp16, e4m3, e5m2) {
  std::mt19937 g(3);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::size_t M : {1, 7, 33, 129})
        for (std::size_t N : {1, 7, 127})
          for (std::size_t K : {0, 1, 33, 129, 1000}) {
            gemm_case<TestType, TestType, float> c(M, N, K, ta, tb);
            ref::fill_real(c.A, g, 0.5f, 2.0f);  // normal range of every type (vdpbf16ps flushes subnormals)
            ref::fill_real(c.B, g, -2.0f, -0.5f);
            auto r = ref::gemm(ta, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
            c.run(dev2(), 1.0f, 0.0f);
            INFO("f32 out M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
            REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
            gemm_case<TestType, TestType, bf16> d(M, N, K, ta, tb);
            d.A = c.A;
            d.B = c.B;
            d.run(dev2(), 1.0f, 0.0f);
            INFO("bf16 out");
            REQUIRE(check_bound(d.C, d.ldc, r, M, N, K) == 0);
          }
}

TEST_CASE("mixed e4m3 x e5m2 with per-tensor scales", "[ops][gemm][fp8]") {
  std::mt19937 g(4);
  const std::size_t M = 33, N = 70, K = 257;
  std::vector<e4m3> A(M * K);
  std::vector<e5m2> B(K * N);
  std::vector<float> C(M * N);
  ref::fill_real(A, g, 0.5f, 2.0f);
  ref::fill_real(B, g, 0.5f, 2.0f);
  gemm_scales s;
  s.a = 0.25f;
  s.b = 3.0f;
  auto r = ref::gemm(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, C.data(), N, 0.25, 3.0);
  gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N, epilogue::chain<>{}, s);
  REQUIRE(check_bound(C, N, r, M, N, K) == 0);
}

TEST_CASE("FP8 DeepSeek-V3 block scales (1x128 A, 128x128 B)", "[ops][gemm][fp8]") {
  std::mt19937 g(5);
  for (std::size_t K : {1, 128, 300, 513})
    for (bool tb : {false, true}) {
      const std::size_t M = 37, N = 260;
      const std::size_t kb = (K + 127) / 128, nbk = (N + 127) / 128;
      std::vector<e4m3> A(M * K), B(K * N);
      std::vector<float> C(M * N), sa(M * kb), sb(kb * nbk);
      ref::fill_real(A, g, -2, 2);
      ref::fill_real(B, g, -2, 2);
      std::uniform_real_distribution<float> ds(0.01f, 4.0f);
      for (auto& x : sa) x = ds(g);
      for (auto& x : sb) x = ds(g);
      gemm_scales s;
      s.a_block = sa.data();
      s.b_block = sb.data();
      const std::size_t ldb = tb ? K : N;
      auto r = ref::gemm(false, tb, M, N, K, 1.0, A.data(), K, B.data(), ldb, 0.0, C.data(), N, 1, 1, sa.data(), sb.data());
      gemm(dev2(), transpose::none, tb ? transpose::yes : transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), ldb, 0.0f, C.data(), N,
           epilogue::chain<>{}, s);
      INFO("K=" << K << " tb=" << tb);
      // per-block scaling adds one rounding per K block
      REQUIRE(check_bound(C, N, r, M, N, K + 2 * kb) == 0);
    }
}

TEST_CASE("big shapes (1000) for f32 and bf16", "[ops][gemm]") {
  std::mt19937 g(6);
  {
    gemm_case<float, float, float> c(1000, 129, 1000, false, true);
    ref::fill_real(c.A, g);
    ref::fill_real(c.B, g);
    auto r = ref::gemm(false, true, c.M, c.N, c.K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
    c.run(dev2(), 1.0f, 0.0f);
    REQUIRE(check_bound(c.C, c.ldc, r, c.M, c.N, c.K) == 0);
  }
  {
    gemm_case<bf16, bf16, bf16> c(127, 1000, 1000, true, false);
    ref::fill_real(c.A, g, 0.5f, 1.0f);
    ref::fill_real(c.B, g, -1.0f, 1.0f);
    auto r = ref::gemm(true, false, c.M, c.N, c.K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
    c.run(dev2(), 1.0f, 0.0f);
    REQUIRE(check_bound(c.C, c.ldc, r, c.M, c.N, c.K) == 0);
  }
}

TEMPLATE_TEST_CASE("results do not depend on the thread count (1 vs 2 threads bitwise)", "[ops][gemm]", float, bf16, e4m3) {
  std::mt19937 g(7);
  for (bool ta : {false, true}) {
    gemm_case<TestType, TestType, float> c(1100, 600, 700, ta, false);
    ref::fill_real(c.A, g);
    ref::fill_real(c.B, g);
    ref::fill_real(c.C, g);
    auto c1 = c;
    c.run(dev2(), 0.7f, 0.3f, epilogue::gelu);
    c1.run(dev1(), 0.7f, 0.3f, epilogue::gelu);
    REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
  }
}

// K deeper than one chunk (f32 1024, bf16 2048) and than one packed piece (4096): partial sums of
// the chunks are added into C in K order, and that order must not depend on the thread count.
TEMPLATE_TEST_CASE("deep K across chunks and packed pieces: gamma_K, integers bitwise, 1 vs 2 threads bitwise", "[ops][gemm]", float, bf16) {
  std::mt19937 g(11);
  for (std::size_t K : {2053, 5127}) {
    INFO("K=" << K);
    gemm_case<TestType, TestType, float> c(130, 300, K, false, false);
    ref::fill_real(c.A, g);
    ref::fill_real(c.B, g);
    ref::fill_real(c.C, g);
    auto c1 = c;
    auto r = ref::gemm(false, false, c.M, c.N, c.K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.5, c.C.data(), c.ldc);
    c.run(dev2(), 1.0f, 0.5f);
    c1.run(dev1(), 1.0f, 0.5f);
    REQUIRE(check_bound(c.C, c.ldc, r, c.M, c.N, c.K) == 0);
    REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
    gemm_case<TestType, TestType, float> n(130, 300, K, false, false);
    ref::fill_int(n.A, g);
    ref::fill_int(n.B, g);
    ref::fill_int(n.C, g);
    auto rn = ref::gemm(false, false, n.M, n.N, n.K, 1.0, n.A.data(), n.lda, n.B.data(), n.ldb, 2.0, n.C.data(), n.ldc);
    n.run(dev2(), 1.0f, 2.0f);
    REQUIRE(check_exact(n.C, n.ldc, rn, n.M, n.N) == 0);
  }
}

TEST_CASE("epilogues: every op against a scalar reference, f32/bf16/e4m3 outputs", "[ops][gemm][epilogue]") {
  std::mt19937 g(8);
  const std::size_t M = 45, N = 70, K = 64;
  std::vector<bf16> A(M * K), B(K * N);
  ref::fill_int(A, g, 2);
  ref::fill_int(B, g, 2);
  std::vector<float> bias(N), rbias(M), res(M * N);
  ref::fill_real(bias, g);
  ref::fill_real(rbias, g);
  ref::fill_real(res, g);
  auto r = ref::gemm(false, false, M, N, K, 1.0, A.data(), K, B.data(), N, 0.0, static_cast<const float*>(nullptr), N);
  // integer inputs: the product is exact, so the epilogue is checked alone
  auto expect = [&](auto f) {
    std::vector<float> e(M * N);
    for (std::size_t i = 0; i < M; ++i)
      for (std::size_t j = 0; j < N; ++j) e[i * N + j] = f(static_cast<float>(r.c[i * N + j]), i, j);
    return e;
  };
  auto run_f32 = [&](const auto& ep) {
    std::vector<float> C(M * N);
    gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N, ep);
    return C;
  };
  auto close = [](const std::vector<float>& a, const std::vector<float>& b, float tol) {
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!(std::fabs(a[i] - b[i]) <= tol * (1 + std::fabs(b[i])))) return false;
    return true;
  };
  using namespace tessel::arch::math;
  SECTION("bias | relu") {
    REQUIRE(close(run_f32(epilogue::bias(bias) | epilogue::relu), expect([&](float v, auto, auto j) { return relu(v + bias[j]); }), 0));
  }
  SECTION("bias_row | gelu_tanh") {
    REQUIRE(close(run_f32(epilogue::bias_row(rbias) | epilogue::gelu_tanh), expect([&](float v, auto i, auto) { return gelu_tanh(v + rbias[i]); }),
                  1e-6f));
  }
  SECTION("gelu_erf | scale") {
    REQUIRE(close(run_f32(epilogue::gelu_erf | epilogue::scale(0.5f)), expect([&](float v, auto, auto) { return gelu_erf(v) * 0.5f; }), 1e-6f));
  }
  SECTION("silu | residual") {
    tensor<const float, 2> R(res.data(), M, N);
    REQUIRE(close(run_f32(epilogue::silu | epilogue::residual(R)), expect([&](float v, auto i, auto j) { return silu(v) + res[i * N + j]; }), 1e-6f));
  }
  SECTION("bias | gelu | cast<bf16>") {
    std::vector<bf16> C(M * N);
    gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N,
         epilogue::bias(bias) | epilogue::gelu | epilogue::cast<bf16>);
    auto e = expect([&](float v, auto, auto j) { return gelu_tanh(v + bias[j]); });
    for (std::size_t i = 0; i < C.size(); ++i) REQUIRE(std::fabs(float(C[i]) - e[i]) <= std::ldexp(1.0f, -8) * std::fabs(e[i]) + 1e-6f);
  }
  SECTION("scale | cast<e4m3> saturates and reports amax") {
    std::vector<e4m3> C(M * N);
    std::atomic<float> amax{0.0f};
    gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N,
         epilogue::scale(40.0f) | epilogue::cast_amax<e4m3>(amax));
    float want_amax = 0;
    for (std::size_t i = 0; i < M * N; ++i) {
      const float v = static_cast<float>(r.c[i]) * 40.0f;
      want_amax = std::max(want_amax, std::fabs(v));
      const float sat = std::clamp(v, -448.0f, 448.0f);
      REQUIRE(float(C[i]) == float(e4m3(sat)));
    }
    REQUIRE(amax.load() == want_amax);
    REQUIRE(want_amax > 448.0f);  // the case exercises saturation
  }
  SECTION("alpha/beta with bf16 C read back") {
    std::vector<bf16> C(M * N, bf16(2.0f));
    gemm(dev2(), transpose::none, transpose::none, M, N, K, 0.5f, A.data(), K, B.data(), N, -1.0f, C.data(), N);
    for (std::size_t i = 0; i < C.size(); ++i) REQUIRE(float(C[i]) == float(bf16(static_cast<float>(0.5 * r.c[i] - 2.0))));
  }
}

TEST_CASE("beta = 0 never reads C (NaN in C is overwritten)", "[ops][gemm]") {
  std::vector<float> A(4 * 5, 1.0f), B(5 * 3, 1.0f), C(4 * 3, std::numeric_limits<float>::quiet_NaN());
  gemm(dev2(), transpose::none, transpose::none, 4, 3, 5, 1.0f, A.data(), 5, B.data(), 3, 0.0f, C.data(), 3);
  for (float x : C) REQUIRE(x == 5.0f);
}

// An f32 result of at least 8 MiB with beta = 0 is written with streaming stores: same bits as
// the cached store of a small GEMM over the same rows (row-aligned and unaligned C rows, with and
// without an epilogue), within gamma_K of fp64, and C is never read (NaN is overwritten).
TEMPLATE_TEST_CASE("large f32 results (streaming stores): gamma_K, same bits as the cached store", "[ops][gemm]", float, bf16) {
  std::mt19937 g(13);
  const std::size_t M = 1030, N = 2050, K = 37, rows = 72;
  for (std::size_t pad : {std::size_t{0}, std::size_t{3}}) {
    INFO("ldc = N + " << pad);
    gemm_case<TestType, TestType, float> c(M, N, K, false, false, pad);
    REQUIRE(M * N * sizeof(float) >= (std::size_t{8} << 20));
    ref::fill_real(c.A, g);
    ref::fill_real(c.B, g);
    std::fill(c.C.begin(), c.C.end(), std::numeric_limits<float>::quiet_NaN());
    auto r = ref::gemm(false, false, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
    c.run(dev2(), 1.0f, 0.0f);
    REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
    std::vector<float> bias(N);
    ref::fill_real(bias, g);
    const auto ep = epilogue::bias(std::span<const float>(bias)) | epilogue::relu;
    c.run(dev2(), 0.5f, 0.0f, ep);
    for (std::size_t m0 : {std::size_t{0}, M - rows}) {  // first and last row slab as small GEMMs
      std::vector<float> s(rows * c.ldc);
      gemm(dev1(), transpose::none, transpose::none, rows, N, K, 0.5f, c.A.data() + m0 * c.lda, c.lda, c.B.data(), c.ldb, 0.0f, s.data(), c.ldc, ep);
      INFO("rows " << m0);
      for (std::size_t i = 0; i < rows; ++i) REQUIRE(std::memcmp(s.data() + i * c.ldc, c.C.data() + (m0 + i) * c.ldc, N * sizeof(float)) == 0);
    }
  }
}

// With nothing left to apply (alpha 1, beta 0, no epilogue) and 64-byte aligned C rows, the atoms
// stream each full-width tile of the last K chunk straight into C; the narrower last column panel
// goes through the slab store. Same bits as the cached store of small GEMMs over the same rows,
// with one and several K chunks, and with C rows not 64-byte aligned (the slab store instead).
TEMPLATE_TEST_CASE("large f32 results streamed by the atoms: same bits as the cached store", "[ops][gemm]", float, bf16) {
  std::mt19937 g(17);
  const std::size_t M = 1030, N = 2064, rows = 72;  // N: 8 full 256-column blocks and one of 16 columns
  const std::size_t chunk = std::is_same_v<TestType, float> ? 1024 : 2048;
  for (std::size_t K : {std::size_t{37}, chunk + 77}) {
    std::vector<TestType> A(M * K), B(K * N);
    ref::fill_real(A, g);
    ref::fill_real(B, g);
    std::vector<float> buf(M * N + 32);
    for (std::size_t shift : {std::size_t{0}, std::size_t{4}}) {  // 4 floats: rows 16 bytes off a line
      float* C = buf.data() + (16 - reinterpret_cast<std::uintptr_t>(buf.data()) / 4 % 16) % 16 + shift;
      REQUIRE(M * N * sizeof(float) >= (std::size_t{8} << 20));
      std::fill(buf.begin(), buf.end(), std::numeric_limits<float>::quiet_NaN());
      gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C, N);
      for (std::size_t m0 : {std::size_t{0}, std::size_t{504}, M - rows}) {
        std::vector<float> s(rows * N);
        gemm(dev1(), transpose::none, transpose::none, rows, N, K, 1.0f, A.data() + m0 * K, K, B.data(), N, 0.0f, s.data(), N);
        INFO("K " << K << " shift " << shift << " rows from " << m0);
        for (std::size_t i = 0; i < rows; ++i) REQUIRE(std::memcmp(s.data() + i * N, C + (m0 + i) * N, N * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("batched and strided-batched", "[ops][gemm][batched]") {
  std::mt19937 g(9);
  const std::size_t M = 19, N = 40, K = 33, batch = 3;
  std::vector<bf16> A(batch * M * K), B(batch * K * N);
  std::vector<float> C(batch * M * N), C2(batch * M * N);
  ref::fill_int(A, g);
  ref::fill_int(B, g);
  gemm_strided_batched(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), K, M * K, B.data(), N, K * N, 0.0f, C.data(), N, M * N,
                       batch);
  std::vector<const bf16*> ap, bp;
  std::vector<float*> cp;
  for (std::size_t b = 0; b < batch; ++b) {
    ap.push_back(A.data() + b * M * K);
    bp.push_back(B.data() + b * K * N);
    cp.push_back(C2.data() + b * M * N);
  }
  gemm_batched(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, ap.data(), K, bp.data(), N, 0.0f, cp.data(), N, batch);
  for (std::size_t b = 0; b < batch; ++b) {
    auto r = ref::gemm(false, false, M, N, K, 1.0, A.data() + b * M * K, K, B.data() + b * K * N, N, 0.0, C.data(), N);
    for (std::size_t i = 0; i < M * N; ++i) {
      REQUIRE(C[b * M * N + i] == r.c[i]);
      REQUIRE(C2[b * M * N + i] == r.c[i]);
    }
  }
}

TEST_CASE("tensor-form gemm with transposed views", "[ops][gemm]") {
  std::vector<float> A(7 * 5), B(9 * 7), C(5 * 9);
  std::mt19937 g(10);
  ref::fill_int(A, g);
  ref::fill_int(B, g);
  // A stored (7,5) -> op(A) = A^T (5,7); B stored (9,7) -> B^T (7,9)
  gemm(dev2(), tensor<const float, 2>(A.data(), 7, 5).transposed(), tensor<const float, 2>(B.data(), 9, 7).transposed(),
       tensor<float, 2>(C.data(), 5, 9));
  auto r = ref::gemm(true, true, 5, 9, 7, 1.0, A.data(), 5, B.data(), 7, 0.0, C.data(), 9);
  for (std::size_t i = 0; i < C.size(); ++i) REQUIRE(C[i] == r.c[i]);
  REQUIRE_THROWS_AS(gemm(dev2(), tensor<const float, 2>(A.data(), 7, 5), tensor<const float, 2>(B.data(), 9, 7), tensor<float, 2>(C.data(), 5, 9)),
                    gemm_error);
}

TEST_CASE("bad arguments give typed errors naming the shapes", "[ops][gemm][errors]") {
  std::vector<float> A(100), B(100), C(100);
  auto& d = dev2();
  auto msg = [&](auto f) {
    try {
      f();
    } catch (const gemm_error& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  const auto N_ = transpose::none;
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, A.data(), 4, B.data(), 5, 0.0f, C.data(), 5); }),
             Catch::Contains("leading dimension of A") && Catch::Contains("(M,N,K)=(5,5,5)"));
  CHECK_THAT(msg([&] { gemm(d, transpose::yes, N_, 6, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, C.data(), 5); }),
             Catch::Contains("leading dimension of A"));
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, A.data(), 5, B.data(), 3, 0.0f, C.data(), 5); }), Catch::Contains("leading dimension of B"));
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, C.data(), 4); }), Catch::Contains("leading dimension of C"));
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, static_cast<const float*>(nullptr), 5, B.data(), 5, 0.0f, C.data(), 5); }),
             Catch::Contains("null A"));
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, static_cast<float*>(nullptr), 5); }),
             Catch::Contains("null C"));
  // zero sizes accept null
  REQUIRE_NOTHROW(gemm(d, N_, N_, 0, 5, 0, 1.0f, static_cast<const float*>(nullptr), 1, B.data(), 5, 0.0f, static_cast<float*>(nullptr), 5));
  // overflowing sizes
  const std::size_t huge = std::size_t{1} << 62;
  REQUIRE_THROWS_MATCHES(gemm(d, N_, N_, huge, 8, 8, 1.0f, A.data(), 8, B.data(), 8, 0.0f, C.data(), 8), tessel::overflow_error,
                         is_error(errc::overflow, "size", "overflows"));
  gemm_scales s;
  std::vector<float> sa(10);
  s.a_block = sa.data();
  CHECK_THAT(msg([&] { gemm(d, N_, N_, 5, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, C.data(), 5, epilogue::chain<>{}, s); }),
             Catch::Contains("block scales"));
  // an empty product reads no scales: M = 0 with A's (empty) block scales null is fine (found by tessel-verify's zero-size sweep)
  s.a_block = nullptr;
  s.b_block = sa.data();
  CHECK(msg([&] { gemm(d, N_, N_, 0, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, C.data(), 5, epilogue::chain<>{}, s); }) == "no throw");
}

TEST_CASE("gemm program declares its cost (costed_program)", "[ops][gemm]") {
  using P = tessel::detail::gemm_program<bf16, bf16, float, epilogue::chain<epilogue::alpha_beta>, false>;
  STATIC_REQUIRE(costed_program<P>);
}

TEST_CASE("the profiler sees each GEMM launch with its shape", "[ops][gemm][profiler]") {
  host_device d(2);
  std::vector<float> A(300 * 200, 1.0f), B(200 * 100, 1.0f), C(300 * 100);
  {
    profiler::session s;
    gemm(d, transpose::none, transpose::none, 300, 100, 200, 1.0f, A.data(), 200, B.data(), 100, 0.0f, C.data(), 100);
  }
  bool seen = false;
  for (const auto& r : profiler::launches())
    if (r.shape != profiler::launch_record::no_shape) {
      CHECK(profiler::name_of(r.shape) == "(M,N,K)=(300,100,200)");
      CHECK(r.costed);
      seen = true;
    }
  CHECK(seen);
  CHECK(C[0] == 200.0f);
}

TEST_CASE("skinny bf16 rows path (M <= 3): batches, padding, partial strips, epilogue", "[ops][gemm][skinny]") {
  std::mt19937 g(11);
  for (std::size_t M : {1, 2, 3})
    for (std::size_t N : {1, 127, 300}) {
      const std::size_t K = 77, batch = 2, lda = K + 3, ldb = N + 5, ldc = N + 1;
      std::vector<bf16> A(batch * M * lda), B(batch * K * ldb);
      std::vector<float> C(batch * M * ldc, 1.0f), bias(N);
      ref::fill_int(A, g);
      ref::fill_int(B, g);
      ref::fill_int(bias, g);
      gemm_strided_batched(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), lda, M * lda, B.data(), ldb, K * ldb, 0.5f, C.data(),
                           ldc, M * ldc, batch, epilogue::bias(bias) | epilogue::relu);
      for (std::size_t z = 0; z < batch; ++z) {
        auto r = ref::gemm(false, false, M, N, K, 1.0, A.data() + z * M * lda, lda, B.data() + z * K * ldb, ldb, 0.0, C.data(), ldc);
        for (std::size_t i = 0; i < M; ++i)
          for (std::size_t j = 0; j < N; ++j) {
            INFO("M=" << M << " N=" << N << " z=" << z);
            REQUIRE(C[z * M * ldc + i * ldc + j] == std::max(0.0, r.c[i * N + j] + 0.5 + bias[j]));
          }
      }
    }
}

TEST_CASE("skinny bf16 path: M in {1,2,15,16,17,33}, odd N/K, transposes, chunks, 1 vs 2 threads bitwise", "[ops][gemm][skinny]") {
  std::mt19937 g(12);
  for (std::size_t M : {1, 2, 15, 16, 17, 33})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [N, K] : {std::pair<std::size_t, std::size_t>{1, 7}, {33, 1}, {300, 77}, {257, 600}, {4133, 5}}) {
          gemm_case<bf16, bf16, float> c(M, N, K, ta, tb, (M + N) % 3);
          ref::fill_real(c.A, g, 0.5f, 2.0f);
          ref::fill_real(c.B, g, -2.0f, 2.0f);
          ref::fill_real(c.C, g);
          auto r = ref::gemm(ta, tb, M, N, K, 0.75, c.A.data(), c.lda, c.B.data(), c.ldb, -0.5, c.C.data(), c.ldc);
          auto c1 = c;
          c.run(dev2(), 0.75f, -0.5f);
          c1.run(dev1(), 0.75f, -0.5f);
          INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
          REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
          REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
        }
}

TEST_CASE("skinny bf16 path: integer inputs bitwise, bf16 output with bias+GELU, batches", "[ops][gemm][skinny]") {
  std::mt19937 g(13);
  for (std::size_t M : {1, 3, 16, 33})
    for (std::size_t K : {0, 1, 300}) {
      const std::size_t N = 161, batch = 2, lda = K + 1, ldb = N + 2, ldc = N + 3;
      std::vector<bf16> A(batch * M * lda), B(batch * std::max<std::size_t>(K, 1) * ldb);
      std::vector<float> C(batch * M * ldc, 1.0f);
      ref::fill_int(A, g);
      ref::fill_int(B, g);
      gemm_strided_batched(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), lda, M * lda, B.data(), ldb, K * ldb, 2.0f, C.data(),
                           ldc, M * ldc, batch);
      for (std::size_t z = 0; z < batch; ++z) {
        std::vector<float> Cz(M * ldc, 1.0f);
        auto r = ref::gemm(false, false, M, N, K, 1.0, A.data() + z * M * lda, lda, B.data() + z * K * ldb, ldb, 2.0, Cz.data(), ldc);
        INFO("M=" << M << " K=" << K << " z=" << z);
        for (std::size_t i = 0; i < M; ++i)
          for (std::size_t j = 0; j < N; ++j) REQUIRE(C[z * M * ldc + i * ldc + j] == r.c[i * N + j]);
      }
      // bf16 output through bias + GELU: the same values as the f32 path's epilogue applied after
      std::vector<float> bias(N);
      ref::fill_real(bias, g);
      std::vector<bf16> D(M * ldc);
      std::vector<float> E(M * ldc);
      gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, D.data(), ldc,
           epilogue::bias(bias) | epilogue::gelu | epilogue::cast<bf16>);
      gemm(dev1(), transpose::none, transpose::none, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, E.data(), ldc,
           epilogue::bias(bias) | epilogue::gelu);
      for (std::size_t i = 0; i < M; ++i)
        for (std::size_t j = 0; j < N; ++j) REQUIRE(D[i * ldc + j].bits() == bf16(E[i * ldc + j]).bits());
    }
}

// Split K: C with few tiles and deep K is computed as partials over fixed K splits (a function of
// the shape only) added in split order. Every transpose, edge and prime sizes, an epilogue and a
// bf16 output; 1 and 2 threads must give the same bits.
TEMPLATE_TEST_CASE("split K: every transpose, gamma_K, integers bitwise, 1 vs 2 threads bitwise", "[ops][gemm][split_k]", float, bf16) {
  std::mt19937 g(23);
  const std::size_t deep = std::is_same_v<TestType, float> ? 2053 : 4099;  // primes: a short last split
  struct dims {
    std::size_t M, N, K;
  };
  for (const dims d : {dims{37, 1, deep}, dims{33, 129, deep}, dims{127, 200, 3 * deep}, dims{64, 64, 2 * deep}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        INFO("M=" << d.M << " N=" << d.N << " K=" << d.K << " ta=" << ta << " tb=" << tb);
        REQUIRE(detail::gemm_k_split<TestType, TestType>(d.M, d.N, d.K) > 0);  // the path under test is taken
        gemm_case<TestType, TestType, float> c(d.M, d.N, d.K, ta, tb, 3);
        ref::fill_real(c.A, g);
        ref::fill_real(c.B, g);
        ref::fill_real(c.C, g);
        auto c1 = c;
        auto r = ref::gemm(ta, tb, c.M, c.N, c.K, 1.5, c.A.data(), c.lda, c.B.data(), c.ldb, -0.5, c.C.data(), c.ldc);
        c.run(dev2(), 1.5f, -0.5f);
        c1.run(dev1(), 1.5f, -0.5f);
        REQUIRE(check_bound(c.C, c.ldc, r, c.M, c.N, c.K) == 0);
        REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);

        gemm_case<TestType, TestType, float> n(d.M, d.N, d.K, ta, tb);
        ref::fill_int(n.A, g, 2);
        ref::fill_int(n.B, g, 2);
        ref::fill_int(n.C, g);
        auto rn = ref::gemm(ta, tb, n.M, n.N, n.K, 1.0, n.A.data(), n.lda, n.B.data(), n.ldb, 2.0, n.C.data(), n.ldc);
        n.run(dev2(), 1.0f, 2.0f);
        REQUIRE(check_exact(n.C, n.ldc, rn, n.M, n.N) == 0);
      }
}

TEST_CASE("split K: epilogue and bf16 output after the reduction, 1 vs 2 threads bitwise", "[ops][gemm][split_k]") {
  std::mt19937 g(24);
  gemm_case<bf16, bf16, bf16> c(70, 130, 9000, false, true);
  REQUIRE(detail::gemm_k_split<bf16, bf16>(c.M, c.N, c.K) > 0);
  ref::fill_real(c.A, g);
  ref::fill_real(c.B, g);
  std::vector<float> bias(c.N);
  ref::fill_real(bias, g);
  auto c1 = c;
  const auto ep = epilogue::bias(std::span<const float>(bias)) | epilogue::relu | epilogue::cast<bf16>;
  c.run(dev2(), 0.5f, 0.0f, ep);
  c1.run(dev1(), 0.5f, 0.0f, ep);
  REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(bf16)) == 0);
  auto r = ref::gemm(false, true, c.M, c.N, c.K, 0.5, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
  const double gk = ref::gamma(c.K + 2, std::ldexp(1.0, -24)), ub = ref::unit_roundoff<bf16>();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < c.M; ++i)
    for (std::size_t j = 0; j < c.N; ++j) {
      const double want = std::max(0.0, r.c[i * c.N + j] + bias[j]);
      const double tol = gk * (r.mag[i * c.N + j] + std::fabs(bias[j])) + ub * std::fabs(want) + 1e-30;
      bad += !(std::fabs(ref::to_d(c.C[i * c.ldc + j]) - want) <= tol);
    }
  REQUIRE(bad == 0);
}

TEST_CASE("split K is a function of the shape: never for shallow K or many tiles, splits are whole K chunks", "[ops][gemm][split_k]") {
  using cfg = detail::gemm_config<float, float>;
  CHECK(detail::gemm_k_split<float, float>(128, 128, 1000) == 0);    // one split's worth
  CHECK(detail::gemm_k_split<float, float>(1024, 1024, 8192) == 0);  // enough tiles already
  CHECK(detail::gemm_k_split<float, float>(128, 128, 0) == 0);
  for (std::size_t K : {2048, 4096, 5000, 65536}) {
    const std::size_t s = detail::gemm_k_split<float, float>(128, 128, K);
    INFO("K=" << K);
    REQUIRE(s > 0);
    CHECK(s % cfg::KC == 0);
    CHECK(ceil_div(K, s) >= 2);
    CHECK(ceil_div(K, s) <= 8);
  }
}

// A transposed f32 A runs MR-row panel atoms; with M leaving a partial panel in the last slab,
// the atoms stream only whole panels into C and the rest goes through the slab store: nothing is
// written past C's M rows (streaming stores are invisible to ASan, hence the sentinel rows), and
// the bits equal those of the cached store (C rows off a 64-byte line).
TEST_CASE("large f32 results streamed by panel atoms (transposed A): no rows written past C", "[ops][gemm]") {
  std::mt19937 g(29);
  const std::size_t N = 1024, K = 16, extra = 8;
  for (std::size_t M : {std::size_t{2050}, std::size_t{4099}}) {
    INFO("M=" << M);
    std::vector<float> A(K * M), B(K * N);
    ref::fill_real(A, g);
    ref::fill_real(B, g);
    std::vector<float> buf((M + extra) * N + 32), cached((M + extra) * N + 32);
    float* C = buf.data() + (16 - reinterpret_cast<std::uintptr_t>(buf.data()) / 4 % 16) % 16;
    float* D = cached.data() + (16 - reinterpret_cast<std::uintptr_t>(cached.data()) / 4 % 16) % 16 + 4;
    REQUIRE(M * N * sizeof(float) >= (std::size_t{8} << 20));
    std::fill(buf.begin(), buf.end(), -7.0f);
    gemm(dev2(), transpose::yes, transpose::none, M, N, K, 1.0f, A.data(), M, B.data(), N, 0.0f, C, N);
    gemm(dev1(), transpose::yes, transpose::none, M, N, K, 1.0f, A.data(), M, B.data(), N, 0.0f, D, N);
    REQUIRE(std::count(C + M * N, C + (M + extra) * N, -7.0f) == std::ptrdiff_t(extra * N));
    REQUIRE(std::memcmp(C, D, M * N * sizeof(float)) == 0);
  }
}

// Packed tiles are written only as deep and as wide as the atoms read (load with a used extent):
// whatever an earlier, larger product left in a worker's scratch must never reach a result. The
// scratch is first filled with NaN through a big product of NaN operands, then shallow, narrow and
// one-row-past-a-chunk products (every transpose, both paths: plain and skinny) must be exact.
TEMPLATE_TEST_CASE("packed tiles: stale scratch from an earlier product never reaches a result", "[ops][gemm]", float, bf16) {
  std::mt19937 g(41);
  const std::size_t chunk = tessel::detail::gemm_config<TestType, TestType>::KC;
  for (auto* d : {&dev1(), &dev2()}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{200, 520, chunk + 100}, {5, 1100, 200}}) {
          gemm_case<TestType, TestType, float> big(M, N, K, ta, tb);
          for (auto& x : big.A) x = TestType(std::numeric_limits<float>::quiet_NaN());
          for (auto& x : big.B) x = TestType(std::numeric_limits<float>::quiet_NaN());
          big.run(*d, 1.0f, 0.0f);
        }
        for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{200, 300, 1},
                               {200, 300, 3},
                               {150, 37, 9},
                               {130, 300, chunk + 1},
                               {5, 1100, 9},
                               {5, 1100, 73},
                               {100, 520, 2}}) {
          gemm_case<TestType, TestType, float> c(M, N, K, ta, tb);
          ref::fill_int(c.A, g);
          ref::fill_int(c.B, g);
          ref::fill_int(c.C, g);
          auto r = ref::gemm(ta, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, -1.0, c.C.data(), c.ldc);
          c.run(*d, 1.0f, -1.0f);
          INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb << " threads " << d->capabilities().workers);
          REQUIRE(check_exact(c.C, c.ldc, r, M, N) == 0);
        }
      }
  }
}

namespace {
// Sets the direct path's thresholds for one scope (0: every product packed; 1e300: every product
// the direct path takes).
struct direct_threshold {
  tessel::detail::gemm_tuning saved = tessel::detail::gemm_tune();
  explicit direct_threshold(double t) { tessel::detail::gemm_tune().direct_max_macs = tessel::detail::gemm_tune().direct_max_macs_pair = t; }
  ~direct_threshold() { tessel::detail::gemm_tune() = saved; }
};
}  // namespace

// Tiny products run the direct path (no packing, calling thread): every transpose and input type,
// odd sizes and sizes of 1, padded leading dimensions, against the reference.
TEMPLATE_TEST_CASE("direct path (tiny products): every transpose, gamma_K, integers bitwise, 1 vs 2 threads bitwise", "[ops][gemm][direct]", float,
                   bf16, fp16, e4m3) {
  std::mt19937 g(61);
  direct_threshold all(1e300);  // bf16/FP8 products this size take the direct path only below 2^15
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (std::size_t M : {1, 2, 5, 13, 31})
        for (std::size_t N : {1, 3, 17, 64, 65})
          for (std::size_t K : {1, 2, 9, 31, 32, 33, 100}) {
            INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
            gemm_case<TestType, TestType, float> c(M, N, K, ta, tb, (M + K) % 3);
            ref::fill_real(c.A, g, 0.5f, 2.0f);
            ref::fill_real(c.B, g, -2.0f, -0.5f);
            ref::fill_real(c.C, g);
            auto c1 = c;
            auto r = ref::gemm(ta, tb, M, N, K, 1.5, c.A.data(), c.lda, c.B.data(), c.ldb, 0.5, c.C.data(), c.ldc);
            c.run(dev2(), 1.5f, 0.5f);
            c1.run(dev1(), 1.5f, 0.5f);
            REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
            REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
            gemm_case<TestType, TestType, float> n(M, N, K, ta, tb, 1);
            ref::fill_int(n.A, g);
            ref::fill_int(n.B, g);
            ref::fill_int(n.C, g);
            auto rn = ref::gemm(ta, tb, M, N, K, 1.0, n.A.data(), n.lda, n.B.data(), n.ldb, -2.0, n.C.data(), n.ldc);
            n.run(dev2(), 1.0f, -2.0f);
            REQUIRE(check_exact(n.C, n.ldc, rn, M, N) == 0);
          }
}

// An f32 product read by rows (B not transposed, or any B with a transposed A) is one fused
// multiply-add per k in k order from zero, as the packed atoms compute a one-chunk product: the
// direct path must give the packed path's bits there (so moving the threshold changes no result).
TEST_CASE("direct path: f32 products read by rows have the packed path's bits", "[ops][gemm][direct]") {
  std::mt19937 g(62);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{1, 1, 1},
                             {3, 70, 9},
                             {7, 5, 31},
                             {33, 40, 20},
                             {8, 64, 60},
                             {40, 11, 30},
                             {19, 6, 40}}) {
        if (!ta && K >= tessel::detail::gemm_tune().direct_dot_min_k && (K >= 8 * M || N < 16)) continue;  // read by dot products: another order
        gemm_case<float, float, float> c(M, N, K, ta, tb, 2);
        ref::fill_real(c.A, g);
        ref::fill_real(c.B, g);
        ref::fill_real(c.C, g);
        auto p = c;
        c.run(dev2(), 0.75f, 0.25f, epilogue::relu);
        {
          direct_threshold packed(0);
          p.run(dev2(), 0.75f, 0.25f, epilogue::relu);
        }
        INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
        REQUIRE(std::memcmp(c.C.data(), p.C.data(), c.C.size() * sizeof(float)) == 0);
      }
}

// A bf16 product with C at least 16 wide runs vdpbf16ps over K-pairs of B's rows (A's pairs
// broadcast; a transposed A or B copied into rows first), unless it is read by dots: one chain from
// zero per element, the packed pair atom's order for a one-chunk K, so the direct path gives the
// packed path's bits.
TEST_CASE("direct path: bf16 products over B's rows have the packed path's bits", "[ops][gemm][direct]") {
  std::mt19937 g(64);
  const auto& t = tessel::detail::gemm_tune();
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] :
           {std::tuple<std::size_t, std::size_t, std::size_t>{1, 16, 1}, {7, 70, 9}, {13, 64, 16}, {33, 130, 31}, {20, 17, 60}, {200, 100, 16}}) {
        if (tb && K >= t.direct_dot_min_k && (!ta || M <= t.direct_dot_copy_max_m)) continue;  // read by dot products: another order
        gemm_case<bf16, bf16, float> c(M, N, K, ta, tb, 2);
        ref::fill_real(c.A, g);
        ref::fill_real(c.B, g);
        ref::fill_real(c.C, g);
        auto p = c;
        {
          direct_threshold all(1e300);
          c.run(dev2(), 0.75f, 0.25f, epilogue::relu);
        }
        {
          direct_threshold packed(0);
          tessel::detail::gemm_tune().direct_max_k = 0;
          tessel::detail::gemm_tune().direct_pair_rows_max_kn = 0;
          p.run(dev2(), 0.75f, 0.25f, epilogue::relu);
        }
        INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
        REQUIRE(std::memcmp(c.C.data(), p.C.data(), c.C.size() * sizeof(float)) == 0);
      }
}

TEST_CASE("direct path: epilogues, bf16 output, per-tensor scales, strided and pointer batches", "[ops][gemm][direct]") {
  std::mt19937 g(63);
  const std::size_t M = 6, N = 20, K = 40, batch = 5;
  std::vector<bf16> A(batch * M * K), B(batch * N * K);
  std::vector<float> bias(N);
  ref::fill_int(A, g, 2);
  ref::fill_int(B, g, 2);
  ref::fill_int(bias, g, 4);
  // C = relu(2·(A·Bᵀ) + bias) as bf16, batch by batch, against the reference
  std::vector<bf16> C(batch * M * N), C2(batch * M * N);
  gemm_strided_batched(dev2(), transpose::none, transpose::yes, M, N, K, 2.0f, A.data(), K, M * K, B.data(), K, N * K, 0.0f, C.data(), N, M * N,
                       batch, epilogue::bias(bias) | epilogue::relu | epilogue::cast<bf16>);
  std::vector<const bf16*> ap, bp;
  std::vector<bf16*> cp;
  for (std::size_t b = 0; b < batch; ++b) {
    ap.push_back(A.data() + b * M * K);
    bp.push_back(B.data() + b * N * K);
    cp.push_back(C2.data() + b * M * N);
  }
  gemm_batched(dev1(), transpose::none, transpose::yes, M, N, K, 2.0f, ap.data(), K, bp.data(), K, 0.0f, cp.data(), N, batch,
               epilogue::bias(bias) | epilogue::relu | epilogue::cast<bf16>);
  for (std::size_t b = 0; b < batch; ++b) {
    auto r = ref::gemm(false, true, M, N, K, 2.0, A.data() + b * M * K, K, B.data() + b * N * K, K, 0.0, C.data(), N);
    for (std::size_t i = 0; i < M; ++i)
      for (std::size_t j = 0; j < N; ++j) {
        const float want = float(bf16(float(std::max(0.0, r.c[i * N + j] + bias[j]))));
        REQUIRE(float(C[b * M * N + i * N + j]) == want);
        REQUIRE(float(C2[b * M * N + i * N + j]) == want);
      }
  }
  // per-tensor scales multiply alpha
  std::vector<e4m3> A8(M * K), B8(K * N);
  ref::fill_int(A8, g, 2);
  ref::fill_int(B8, g, 2);
  std::vector<float> C8(M * N);
  gemm_scales s;
  s.a = 0.5f;
  s.b = 4.0f;
  gemm(dev2(), transpose::none, transpose::none, M, N, K, 1.0f, A8.data(), K, B8.data(), N, 0.0f, C8.data(), N, epilogue::chain<>{}, s);
  auto r8 = ref::gemm(false, false, M, N, K, 2.0, A8.data(), K, B8.data(), N, 0.0, C8.data(), N);
  for (std::size_t i = 0; i < M * N; ++i) REQUIRE(C8[i] == r8.c[i]);
}

TEST_CASE("direct path: taken by the product's size only", "[ops][gemm][direct]") {
  // the same tiny shape gives the same bits whatever the device's worker count, and a 1-row
  // product of many columns at the threshold and one past it both match the reference
  std::mt19937 g(64);
  const auto limit = static_cast<std::size_t>(tessel::detail::gemm_tune().direct_max_macs);
  for (std::size_t K : {std::size_t{1}, limit / 512}) {
    for (std::size_t N : {limit / K, limit / K + 1}) {
      gemm_case<float, float, float> c(1, N, K, false, false);
      ref::fill_int(c.A, g);
      ref::fill_int(c.B, g);
      auto r = ref::gemm(false, false, 1, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
      c.run(dev2(), 1.0f, 0.0f);
      INFO("N=" << N << " K=" << K);
      REQUIRE(check_exact(c.C, c.ldc, r, 1, N) == 0);
    }
  }
}

// A transposed A (f32, bf16, FP8) is packed once for all column blocks when C has more of them than
// the device has workers (2 column blocks: 1 worker packs once, 2 pack per block; 3: both pack
// once): the result must be what each block packing its own rows gives (a narrower C, one column
// block, takes that path), bitwise, and within gamma_K, integers exact, 1 vs 2 threads bitwise.
TEMPLATE_TEST_CASE("transposed A packed once for all column blocks: same bits as per-block packing", "[ops][gemm]", float, bf16, e4m3) {
  std::mt19937 g(71);
  using cfg = tessel::detail::gemm_config<TestType, TestType>;
  for (bool tb : {false, true})
    for (auto [M, K] : {std::pair<std::size_t, std::size_t>{150, cfg::KC + 37}, {73, 301}, {1, 64}})
      for (const std::size_t N : {cfg::NB + 44, 2 * cfg::NB + 44}) {
        INFO("M=" << M << " K=" << K << " N=" << N << " tb=" << tb);
        gemm_case<TestType, TestType, float> c(M, N, K, true, tb);
        ref::fill_real(c.A, g, 0.5f, 2.0f);
        ref::fill_real(c.B, g, -2.0f, -0.5f);
        auto c1 = c;
        c.run(dev2(), 1.0f, 0.0f);
        if (const int applied = tessel::detail::gemm_plan_applied.pack_a; applied != -1)  // (-1: not the packed path)
          CHECK(applied == int(N > 2 * cfg::NB));
        c1.run(dev1(), 1.0f, 0.0f);
        if (const int applied = tessel::detail::gemm_plan_applied.pack_a; applied != -1) CHECK(applied == 1);  // one worker: every N > NB
        REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
        auto r = ref::gemm(true, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
        REQUIRE(check_bound(c.C, c.ldc, r, M, N, K) == 0);
        // the first column block alone (N = NB): per-block packing
        std::vector<float> one(M * cfg::NB);
        gemm(dev2(), transpose::yes, tb ? transpose::yes : transpose::none, M, cfg::NB, K, 1.0f, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0f,
             one.data(), cfg::NB);
        for (std::size_t i = 0; i < M; ++i) REQUIRE(std::memcmp(one.data() + i * cfg::NB, c.C.data() + i * c.ldc, cfg::NB * sizeof(float)) == 0);
        gemm_case<TestType, TestType, float> n(M, N, K, true, tb);
        ref::fill_int(n.A, g, 2);
        ref::fill_int(n.B, g, 2);
        auto rn = ref::gemm(true, tb, M, N, K, 1.0, n.A.data(), n.lda, n.B.data(), n.ldb, 0.0, n.C.data(), n.ldc);
        n.run(dev2(), 1.0f, 0.0f);
        REQUIRE(check_exact(n.C, n.ldc, rn, M, N) == 0);
      }
}

// The direct path's two checks, shared by its test cases.
// Small integers with alpha 1, beta 1 and a bias along C's rows (or columns): every summation order
// is exact, so the result must equal the fp64 reference bitwise, on 1 and on 2 threads.
template <class T>
void check_direct_integers(std::mt19937& g, std::size_t M, std::size_t N, std::size_t K, bool ta, bool tb, bool bias_on_rows, int pad) {
  gemm_case<T, T, float> c(M, N, K, ta, tb, pad);
  ref::fill_int(c.A, g, 2);
  ref::fill_int(c.B, g, 2);
  ref::fill_int(c.C, g, 2);
  std::vector<float> bias(bias_on_rows ? M : N);
  ref::fill_int(bias, g, 4);
  auto c1 = c;
  auto r = ref::gemm(ta, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 1.0, c.C.data(), c.ldc);
  if (bias_on_rows) {
    c.run(dev2(), 1.0f, 1.0f, epilogue::bias_row(bias));
    c1.run(dev1(), 1.0f, 1.0f, epilogue::bias_row(bias));
  } else {
    c.run(dev2(), 1.0f, 1.0f, epilogue::bias_col(bias));
    c1.run(dev1(), 1.0f, 1.0f, epilogue::bias_col(bias));
  }
  REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j) bad += c.C[i * c.ldc + j] != float(r.c[i * N + j] + bias[bias_on_rows ? i : j]);
  REQUIRE(bad == 0);
}
// Real values, plain (alpha 1, beta 0, no epilogue: the atoms write C): 1 vs 2 threads bitwise and
// within gamma_K of the fp64 reference. Returns the case for further checks on its operands.
template <class T>
gemm_case<T, T, float> check_direct_reals(std::mt19937& g, std::size_t M, std::size_t N, std::size_t K, bool ta, bool tb,
                                          ref::gemm_result* reference = nullptr) {
  gemm_case<T, T, float> p(M, N, K, ta, tb);
  ref::fill_real(p.A, g);
  ref::fill_real(p.B, g);
  auto p1 = p;
  auto rp = ref::gemm(ta, tb, M, N, K, 1.0, p.A.data(), p.lda, p.B.data(), p.ldb, 0.0, p.C.data(), p.ldc);
  p.run(dev2(), 1.0f, 0.0f);
  p1.run(dev1(), 1.0f, 0.0f);
  REQUIRE(std::memcmp(p.C.data(), p1.C.data(), p.C.size() * sizeof(float)) == 0);
  REQUIRE(check_bound(p.C, p.ldc, rp, M, N, K) == 0);
  if (reference) *reference = std::move(rp);
  return p;
}

// A shallow product (K <= 16) of any size takes the direct path, its rows shared out over blocks:
// row-indexed epilogues see their own rows, every transpose, integers bitwise, 1 vs 2 threads bitwise.
TEMPLATE_TEST_CASE("direct path: shallow products of any size, rows shared out over blocks", "[ops][gemm][direct]", float, bf16) {
  std::mt19937 g(81);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{300, 3001, 1}, {1000, 777, 5}, {37, 4100, 16}}) {
        INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
        check_direct_integers<TestType>(g, M, N, K, ta, tb, true, 1);
        // plain (alpha 1, beta 0, no epilogue): the atoms write C
        gemm_case<TestType, TestType, float> p(M, N, K, ta, tb);
        ref::fill_int(p.A, g, 2);
        ref::fill_int(p.B, g, 2);
        auto rp = ref::gemm(ta, tb, M, N, K, 1.0, p.A.data(), p.lda, p.B.data(), p.ldb, 0.0, p.C.data(), p.ldc);
        p.run(dev2(), 1.0f, 0.0f);
        REQUIRE(check_exact(p.C, p.ldc, rp, M, N) == 0);
      }
}

// A bf16 product with a row-major B of at most 2^16 elements and at least 64 columns takes the
// pair-rows direct path at any size and depth (rows shared out over blocks): integers bitwise
// with a column-indexed epilogue, real values within gamma_K, 1 vs 2 threads bitwise, and the
// packed path's bits (one chain per element over a K that fits one packed chunk).
TEST_CASE("direct path: bf16 with a small row-major B at any depth, the packed path's bits", "[ops][gemm][direct]") {
  std::mt19937 g(65);
  for (bool ta : {false, true})
    for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{3136, 64, 64}, {301, 64, 1023}, {500, 129, 300}, {77, 256, 255}}) {
      INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta);
      check_direct_integers<bf16>(g, M, N, K, ta, false, false, 1);
      const auto c = check_direct_reals<bf16>(g, M, N, K, ta, false);
      auto p = c;
      {
        tessel::detail::gemm_tuning saved = tessel::detail::gemm_tune();
        tessel::detail::gemm_tune().direct_pair_rows_max_kn = 0;
        p.run(dev2(), 1.0f, 0.0f);
        tessel::detail::gemm_tune() = saved;
      }
      REQUIRE(std::memcmp(c.C.data(), p.C.data(), c.C.size() * sizeof(float)) == 0);
    }
}

// A skinny bf16 product with a transposed B (M <= 16, any size) runs vdpbf16ps dots on the
// operands in place, C's columns shared out over blocks: column-indexed epilogues see their own
// columns, integers are bitwise, real values within gamma_K, 1 vs 2 threads bitwise; and the f32
// direct path reads a row-major B by rows (M = 1, NN: a GEMV).
TEST_CASE("direct path: skinny bf16 dots over a transposed B, columns shared out over blocks", "[ops][gemm][direct]") {
  std::mt19937 g(83);
  for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{1, 1000, 512},
                         {2, 2816, 100},
                         {3, 17, 33},
                         {5, 513, 1408},
                         {8, 300, 4096},
                         {16, 700, 255},
                         {1, 1, 8192}})
    for (bool ta : {false, true}) {  // (a transposed A of at most 16 rows is copied into rows)
      INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta);
      check_direct_integers<bf16>(g, M, N, K, ta, true, false, 3);
      // real values, plain (the atoms write C), bf16 output too
      ref::gemm_result rp;
      const auto p = check_direct_reals<bf16>(g, M, N, K, ta, true, &rp);
      gemm_case<bf16, bf16, bf16> h(M, N, K, ta, true);
      h.A = p.A;
      h.B = p.B;
      h.run(dev2(), 1.0f, 0.0f);
      REQUIRE(check_bound(h.C, h.ldc, rp, M, N, K) == 0);
    }
  // f32 GEMV-like products: the row-major B read by rows (up to 16 rows of A; 5-8 in one pass of
  // the 8-row atom), a transposed B by dots, where they lie; a transposed A of at most 16 rows is
  // copied into rows for the dots
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{1, 1536, 512},
                             {2, 64, 700},
                             {1, 15, 100},
                             {2, 2100, 2048},
                             {16, 700, 300},
                             {9, 33, 4096},
                             {2, 325, 2052},
                             {8, 1000, 300},
                             {13, 300, 700},
                             {6, 96, 4000}}) {
        INFO("f32 M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
        gemm_case<float, float, float> c(M, N, K, ta, tb, 1);
        ref::fill_int(c.A, g, 2);
        ref::fill_int(c.B, g, 2);
        auto c1 = c;
        auto r = ref::gemm(ta, tb, M, N, K, 1.0, c.A.data(), c.lda, c.B.data(), c.ldb, 0.0, c.C.data(), c.ldc);
        c.run(dev2(), 1.0f, 0.0f);
        c1.run(dev1(), 1.0f, 0.0f);
        REQUIRE(std::memcmp(c.C.data(), c1.C.data(), c.C.size() * sizeof(float)) == 0);
        REQUIRE(check_exact(c.C, c.ldc, r, M, N) == 0);
      }
}

// A narrow C (N <= 4; f32 with a row-major A: N <= 8) of any size takes the direct path, its rows shared out over blocks; a
// column-major A is read as Aᵀ's rows (Cᵀ = Bᵀ·Aᵀ, in groups of the atom's rows up to N = 12). Every transpose, f32 and bf16, integers
// bitwise with a row-indexed epilogue, real values within gamma_K, 1 vs 2 threads bitwise.
TEMPLATE_TEST_CASE("direct path: narrow C from a matrix times a few vectors, every transpose", "[ops][gemm][direct]", float, bf16) {
  std::mt19937 g(85);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [M, N, K] : {std::tuple<std::size_t, std::size_t, std::size_t>{3000, 1, 700},
                             {1002, 4, 2496},
                             {63, 1, 2109},
                             {517, 3, 33},
                             {20, 2, 5000},
                             {1000, 7, 300},
                             {210, 5, 220},
                             {300, 12, 200},
                             {77, 10, 64},
                             {1000, 9, 16},
                             {2048, 8, 1024}}) {
        INFO("M=" << M << " N=" << N << " K=" << K << " ta=" << ta << " tb=" << tb);
        check_direct_integers<TestType>(g, M, N, K, ta, tb, true, 2);
        check_direct_reals<TestType>(g, M, N, K, ta, tb);
      }
}

namespace {
// Random values of T in [-1, 1).
template <class T>
std::vector<T> random_values(std::mt19937& g, std::size_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(u(g));
  return v;
}
}  // namespace

// gemm_fused: a decode step's products gathered into one launch (bf16 x·Wᵀ of one token for q, k
// and v, the last with a bias; a row-major B of 2 rows; an f32 GEMV of 4 rows), beside products it
// does not gather (a tiny direct one, a packed one) that run as issued: each result has the bits
// of the same gemm alone, and the launches are 1 gathered + 2.
TEST_CASE("gemm_fused gathers the streaming products into one launch with the bits of each alone", "[ops][gemm][fused]") {
  std::mt19937 g(101);
  host_device d(2);
  const std::size_t D = 512, KV = 256;
  const auto x = random_values<bf16>(g, D), wq = random_values<bf16>(g, D * D), wk = random_values<bf16>(g, KV * D),
             wv = random_values<bf16>(g, KV * D), x2 = random_values<bf16>(g, 2 * D), wr = random_values<bf16>(g, D * 700);
  const auto bias = random_values<float>(g, KV), xf = random_values<float>(g, 4 * 300), wf = random_values<float>(g, 900 * 300),
             ta = random_values<float>(g, 40 * 40), tb = random_values<float>(g, 40 * 40);
  const auto pa = random_values<bf16>(g, 200 * 256), pb = random_values<bf16>(g, 256 * 300);
  struct outputs {
    std::vector<bf16> q = std::vector<bf16>(512), k = std::vector<bf16>(256);
    std::vector<float> v = std::vector<float>(256), r = std::vector<float>(2 * 700), f = std::vector<float>(4 * 900), t = std::vector<float>(40 * 40),
                       p = std::vector<float>(200 * 300);
  };
  auto issue = [&](outputs& o) {
    const auto X = tensor<const bf16, 2>(x.data(), 1, D);
    gemm(d, X, tensor<const bf16, 2>(wq.data(), D, D).transposed(), tensor<bf16, 2>(o.q.data(), 1, D));
    gemm(d, tensor<const float, 2>(ta.data(), 40, 40), tensor<const float, 2>(tb.data(), 40, 40), tensor<float, 2>(o.t.data(), 40, 40));
    gemm(d, X, tensor<const bf16, 2>(wk.data(), KV, D).transposed(), tensor<bf16, 2>(o.k.data(), 1, KV));
    gemm(d, X, tensor<const bf16, 2>(wv.data(), KV, D).transposed(), tensor<float, 2>(o.v.data(), 1, KV), 1.0f, 0.0f,
         epilogue::bias(std::span<const float>(bias)));
    gemm(d, tensor<const bf16, 2>(pa.data(), 200, 256), tensor<const bf16, 2>(pb.data(), 256, 300), tensor<float, 2>(o.p.data(), 200, 300));
    gemm(d, tensor<const bf16, 2>(x2.data(), 2, D), tensor<const bf16, 2>(wr.data(), D, 700), tensor<float, 2>(o.r.data(), 2, 700));
    gemm(d, tensor<const float, 2>(xf.data(), 4, 300), tensor<const float, 2>(wf.data(), 900, 300).transposed(),
         tensor<float, 2>(o.f.data(), 4, 900));
  };
  outputs alone, fused;
  issue(alone);
  std::vector<profiler::launch_record> launches;
  {
    profiler::session s;
    gemm_fused(d, [&] { issue(fused); });
    launches = profiler::launches();
  }
  auto same = [](const auto& a, const auto& b) { return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0; };
  CHECK(same(alone.q, fused.q));
  CHECK(same(alone.k, fused.k));
  CHECK(same(alone.v, fused.v));
  CHECK(same(alone.r, fused.r));
  CHECK(same(alone.f, fused.f));
  CHECK(same(alone.t, fused.t));
  CHECK(same(alone.p, fused.p));
  // the f32 GEMV streams B on every build; the bf16 ones where the AVX-512 BF16 dot and rows atoms
  // read B in place (elsewhere they are packed products, launched as issued)
  constexpr bool bf16_streams = arch::has_direct_dot_bf16_atom && arch::has_rows_dot_atom;
  const std::size_t items = bf16_streams ? 5 : 1;
  const double flops = 2.0 * (4 * 900 * 300 + (bf16_streams ? D * D + 2 * KV * D + 2 * D * 700 : 0));
  std::size_t gathered = 0;
  for (const auto& r : launches) {
    const std::string name = profiler::name_of(r.name);
    INFO(name);
    if (name.find("gathered") != std::string::npos) {
      ++gathered;
      CHECK(profiler::name_of(r.shape).rfind("gathered x " + std::to_string(items) + ";", 0) == 0);
      CHECK(r.costed);
      CHECK(r.cost.flops == Approx(flops));
    }
  }
  CHECK(gathered == 1);
  CHECK(launches.size() == 7 - items + 1);  // 7 products
}

TEST_CASE("gemm_fused: a throwing issue runs nothing it gathered, calls nest, other devices launch as issued", "[ops][gemm][fused]") {
  std::mt19937 g(103);
  host_device d(2), other(2);
  // an f32 GEMV above the tiny direct path's size streams B on every build
  const std::size_t D = 1500, K = 1024;
  const auto x = random_values<float>(g, K), w = random_values<float>(g, D * K);
  const auto X = tensor<const float, 2>(x.data(), 1, K);
  const auto W = tensor<const float, 2>(w.data(), D, K).transposed();
  std::vector<float> want(D), c(D, -7.0f);
  gemm(d, X, W, tensor<float, 2>(want.data(), 1, D));
  CHECK_THROWS_AS(gemm_fused(d,
                             [&] {
                               gemm(d, X, W, tensor<float, 2>(c.data(), 1, D));
                               throw std::runtime_error("stop");
                             }),
                  std::runtime_error);
  CHECK(std::all_of(c.begin(), c.end(), [](float v) { return v == -7.0f; }));
  // the gather is over: a plain gemm runs at once again
  gemm(d, X, W, tensor<float, 2>(c.data(), 1, D));
  CHECK(std::memcmp(c.data(), want.data(), D * sizeof(float)) == 0);
  // nested: the inner call's product has run when it returns; the outer's when the outer returns;
  // another device's product runs as issued
  std::vector<float> inner(D, -7.0f), outer(D, -7.0f), elsewhere(D, -7.0f);
  gemm_fused(d, [&] {
    gemm(d, X, W, tensor<float, 2>(outer.data(), 1, D));
    gemm_fused(d, [&] { gemm(d, X, W, tensor<float, 2>(inner.data(), 1, D)); });
    CHECK(std::memcmp(inner.data(), want.data(), D * sizeof(float)) == 0);
    gemm(other, X, W, tensor<float, 2>(elsewhere.data(), 1, D));
    CHECK(std::memcmp(elsewhere.data(), want.data(), D * sizeof(float)) == 0);
    CHECK(outer[0] == -7.0f);
  });
  CHECK(std::memcmp(outer.data(), want.data(), D * sizeof(float)) == 0);
}

}  // namespace tessel_test_ops_gemm
