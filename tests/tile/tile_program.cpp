// The tile primitives as a user composes them: load (conversion, scale, zero-fill) into staged and
// fragment tiles, mma with the picked atom, map/reduce, store through epilogue chains, pipelined.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/tile.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>
#include "error_match.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_tile_program {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {
scratch_arena& arena() {
  static scratch_arena a;
  return a;
}
block_ctx make_ctx() { return block_ctx(grid{1}, 0, 0, 1, arena()); }
}  // namespace

TEST_CASE("load converts, scales and zero-fills edge tiles in every layout", "[tile][load]") {
  std::vector<e4m3> src(5 * 3);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = e4m3(float(i) - 7.0f);
  tensor<const e4m3, 2> t(src.data(), 5, 3);
  auto ctx = make_ctx();
  auto tile = t.tile<4, 4>(1, 0);  // rows 4..4 (1 valid), cols 0..2 valid
  staged<float, 4, 4> r{ctx};
  load(tile, r, 2.0f);
  staged<float, 4, 4, layout::panel<2, 1>> p{ctx};
  load(tile, p, 2.0f);
  staged<bf16, 4, 4, layout::vnni2<2>> v{ctx};
  load(tile, v);
  fragment<float, 4, 4> f;
  load(tile, f);
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 4; ++j) {
      const float want = (i < 1 && j < 3) ? float(src[(4 + i) * 3 + j]) : 0.0f;
      REQUIRE(r(i, j) == 2 * want);
      REQUIRE(p(i, j) == 2 * want);
      REQUIRE(float(v(i, j)) == want);
      REQUIRE(f(i, j) == want);
    }
  // transposed (column-major) source into a panel
  std::vector<float> cm(6 * 4);
  for (std::size_t i = 0; i < cm.size(); ++i) cm[i] = float(i);
  tensor<const float, 2> tc(cm.data(), 4, 6, 4, order::col_major);
  staged<float, 8, 8, layout::panel<4, 1>> q{ctx};
  load(tc.tile<8, 8>(0, 0), q);
  for (std::size_t i = 0; i < 8; ++i)
    for (std::size_t j = 0; j < 8; ++j) REQUIRE(q(i, j) == ((i < 4 && j < 6) ? tc(i, j) : 0.0f));
}

// The DESIGN.md example program: C = gelu(A·B + bias), bf16 in, f32 accumulate, bf16 out.
template <class Cfg>
struct gemm_bias_gelu {
  tensor<const bf16, 2> A, B;
  tensor<bf16, 2> C;
  std::span<const float> bias;
  void operator()(block_ctx& ctx) const {
    using tr = mma_traits<bf16>;
    auto [bm, bn] = ctx.block_index();
    staged<float, Cfg::BM, Cfg::BN> acc{ctx};                       // (BM,BN)
    staged<tr::stage_type, Cfg::BM, Cfg::BK, tr::a_layout> a{ctx};  // (BM,BK)
    staged<tr::stage_type, Cfg::BK, Cfg::BN, tr::b_layout> b{ctx};  // (BK,BN)
    for (auto k : pipelined(ceil_div(A.cols(), Cfg::BK))) {
      if (k.has_next()) prefetch(A.tile<Cfg::BM, Cfg::BK>(bm, k.next()));
      load(A.tile<Cfg::BM, Cfg::BK>(bm, k), a);
      load(B.tile<Cfg::BK, Cfg::BN>(k, bn), b);
      mma(a, b, acc, {.accumulate = !k.first()});
    }
    store(acc, C.tile<Cfg::BM, Cfg::BN>(bm, bn), epilogue::bias(bias) | epilogue::gelu | epilogue::cast<bf16>);
  }
};
struct small_cfg {
  static constexpr std::size_t BM = 2 * mma_traits<bf16>::mr, BN = 2 * mma_traits<bf16>::nr, BK = 32;
};

TEST_CASE("a user-written fused tile program matches the reference", "[tile][program]") {
  const std::size_t M = 50, N = 70, K = 45;
  std::mt19937 g(1);
  std::uniform_int_distribution<int> d(-3, 3);
  std::vector<bf16> A(M * K), B(K * N), C(M * N);
  std::vector<float> bias(N);
  for (auto& x : A) x = bf16(float(d(g)));
  for (auto& x : B) x = bf16(float(d(g)));
  for (auto& x : bias) x = float(d(g)) * 0.25f;
  host_device dev(2);
  dev.launch(
      grid{ceil_div(M, small_cfg::BM), ceil_div(N, small_cfg::BN)},
      gemm_bias_gelu<small_cfg>{tensor<const bf16, 2>(A.data(), M, K), tensor<const bf16, 2>(B.data(), K, N), tensor<bf16, 2>(C.data(), M, N), bias});
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j) {
      float s = 0;
      for (std::size_t k = 0; k < K; ++k) s += float(A[i * K + k]) * float(B[k * N + j]);
      const float want = float(bf16(arch::math::gelu_tanh(s + bias[j])));
      REQUIRE(std::fabs(float(C[i * N + j]) - want) <= std::fabs(want) * 0.01f + 1e-6f);
    }
}

TEST_CASE("fragment mma, map and reduce", "[tile][compute]") {
  fragment<float, 2, 3> a;
  fragment<float, 3, 2> b;
  fragment<float, 2, 2> c{};
  for (std::size_t i = 0; i < 6; ++i) {
    a.v[i] = float(i + 1);
    b.v[i] = float(6 - i);
  }
  mma(a, b, c);
  REQUIRE(c(0, 0) == 1 * 6 + 2 * 4 + 3 * 2);
  REQUIRE(c(1, 1) == 4 * 5 + 5 * 3 + 6 * 1);
  map(c, [](float x) { return -x; });
  REQUIRE(c(0, 0) == -20.0f);
  float rows[2], cols[2];
  reduce_rows(
      c, rows, [](float x, float y) { return std::max(x, y); }, -1e30f);
  reduce_cols(
      c, cols, [](float x, float y) { return x + y; }, 0.0f);
  REQUIRE(rows[0] == std::max(c(0, 0), c(0, 1)));
  REQUIRE(cols[1] == c(0, 1) + c(1, 1));
}

TEST_CASE("store writes only the valid part and applies the chain", "[tile][store]") {
  std::vector<float> out(3 * 5, -1.0f);
  tensor<float, 2> t(out.data(), 3, 5);
  fragment<float, 4, 4> acc;
  for (std::size_t i = 0; i < 16; ++i) acc.v[i] = float(i) - 8.0f;
  store(acc, t.tile_at<4, 4>(0, 1), epilogue::relu);  // rows 0..2, cols 1..4
  for (std::size_t i = 0; i < 3; ++i) {
    REQUIRE(out[i * 5] == -1.0f);
    for (std::size_t j = 0; j < 4; ++j) REQUIRE(out[i * 5 + 1 + j] == std::max(0.0f, acc(i, j)));
  }
  std::vector<bf16> ob(4 * 4);
  tensor<bf16, 2> tb(ob.data(), 4, 4);
  store(acc, tb.tile<4, 4>(0, 0), epilogue::scale(0.5f) | epilogue::cast<bf16>);
  REQUIRE(float(ob[5]) == float(bf16(acc(1, 1) * 0.5f)));
  // beta reads the old destination
  std::vector<float> o2(16, 10.0f);
  store(acc, tensor<float, 2>(o2.data(), 4, 4).tile<4, 4>(0, 0), epilogue::alpha_beta(2.0f, 0.5f));
  REQUIRE(o2[3] == 2 * acc(0, 3) + 5.0f);
}

TEST_CASE("pipelined yields stages that know their neighbours", "[tile][pipelined]") {
  std::size_t n = 0;
  for (auto k : pipelined(4)) {
    REQUIRE(std::size_t(k) == n);
    REQUIRE(k.first() == (n == 0));
    REQUIRE(k.last() == (n == 3));
    REQUIRE(k.has_next() == (n < 3));
    ++n;
  }
  REQUIRE(n == 4);
  for ([[maybe_unused]] auto k : pipelined(0)) FAIL("empty loop ran");
}

TEST_CASE("scratch arena grows without moving and consolidates on reset", "[tile][scratch]") {
  scratch_arena a(1024);
  void* p = a.allocate(512);
  void* q = a.allocate(4096);  // needs a second chunk
  REQUIRE(p != q);
  std::memset(p, 1, 512);
  std::memset(q, 2, 4096);
  REQUIRE(static_cast<unsigned char*>(p)[511] == 1);
  a.reset();
  REQUIRE(a.capacity() >= 1024 + 4096);
  void* r = a.allocate(4096 + 512);  // fits in the merged chunk
  REQUIRE(r != nullptr);
  REQUIRE_THROWS_MATCHES(a.allocate(8, 3), tile_error, is_error(errc::invalid_argument, "tile", "scratch alignment"));
  REQUIRE_THROWS_MATCHES(a.allocate_array<double>(SIZE_MAX / 4), tile_error, is_error(errc::overflow, "tile", "scratch array"));
}

// A read in place (row-major), B staged; odd K exercises the padded K-pair tail.
template <class T>
struct inplace_a_program {
  static constexpr std::size_t BM = 2 * mma_traits<T>::mr + 3, BN = mma_traits<T>::nr, BK = 40;
  tensor<const T, 2> A, B;
  tensor<float, 2> C;
  void operator()(block_ctx& ctx) const {
    using tr = mma_traits<T>;
    auto [bm, bn] = ctx.block_index();
    staged<float, BM, BN> acc{ctx};                                         // (BM,BN)
    staged<typename tr::stage_type, BK, BN, typename tr::b_layout> b{ctx};  // (BK,BN)
    for (auto k : pipelined(ceil_div(A.cols(), BK))) {
      load(B.template tile<BK, BN>(k, bn), b);
      mma(A.template tile<BM, BK>(bm, k), b, acc, {.accumulate = !k.first()});
    }
    store(acc, C.template tile<BM, BN>(bm, bn));
  }
};

TEMPLATE_TEST_CASE("mma with A read in place matches the reference for odd K", "[tile][mma]", float, bf16) {
  if constexpr (std::is_same_v<typename mma_traits<TestType>::stage_type, TestType>) {
    std::mt19937 g(2);
    std::uniform_int_distribution<int> d(-3, 3);
    for (std::size_t K : {1, 39, 41, 81}) {
      const std::size_t M = 41, N = 77;
      std::vector<TestType> A(M * K), B(K * N);
      std::vector<float> C(M * N);
      for (auto& x : A) x = TestType(float(d(g)));
      for (auto& x : B) x = TestType(float(d(g)));
      using P = inplace_a_program<TestType>;
      host_device dev(2);
      dev.launch(grid{ceil_div(M, P::BM), ceil_div(N, P::BN)},
                 P{tensor<const TestType, 2>(A.data(), M, K), tensor<const TestType, 2>(B.data(), K, N), tensor<float, 2>(C.data(), M, N)});
      for (std::size_t i = 0; i < M; ++i)
        for (std::size_t j = 0; j < N; ++j) {
          float s = 0;
          for (std::size_t k = 0; k < K; ++k) s += float(A[i * K + k]) * float(B[k * N + j]);
          REQUIRE(C[i * N + j] == s);
        }
    }
  }
}

// mma_options::n: only the atom panels holding the first n columns are computed (edge strips of C
// need not pay for the full BN); the accumulator's later panels keep their values.
TEMPLATE_TEST_CASE("mma computes only the panels holding the first n columns", "[tile][mma]", float, bf16) {
  using tr = mma_traits<TestType>;
  using S = typename tr::stage_type;
  constexpr std::size_t NR = tr::nr, BM = 2 * tr::mr, BN = 3 * NR, BK = 20;
  std::mt19937 g(4);
  std::uniform_int_distribution<int> d(-3, 3);
  std::vector<TestType> A(BM * BK), B(BK * BN);
  for (auto& x : A) x = TestType(float(d(g)));
  for (auto& x : B) x = TestType(float(d(g)));
  std::vector<S> bs(staged<S, BK, BN, typename tr::b_layout>::elements), as(staged<S, BM, BK, typename tr::a_layout>::elements);
  staged<S, BK, BN, typename tr::b_layout> b(bs.data());
  staged<S, BM, BK, typename tr::a_layout> a(as.data());
  const tensor<const TestType, 2> tA(A.data(), BM, BK), tB(B.data(), BK, BN);
  load(tB.template tile<BK, BN>(0, 0), b);
  load(tA.template tile<BM, BK>(0, 0), a);
  std::vector<float> accs(BM * BN);
  staged<float, BM, BN> acc(accs.data());
  for (bool in_place : {false, true}) {
    if (in_place && !std::is_same_v<S, TestType>) continue;  // in-place A needs the pair atom's element type
    for (std::size_t n : {std::size_t{1}, NR, NR + 1, BN}) {
      std::fill(accs.begin(), accs.end(), 7.5f);
      if constexpr (std::is_same_v<S, TestType>) {
        if (in_place)
          mma(tA.template tile<BM, BK>(0, 0), b, acc, {.accumulate = false, .n = n});
        else
          mma(a, b, acc, {.accumulate = false, .n = n});
      } else {
        mma(a, b, acc, {.accumulate = false, .n = n});
      }
      const std::size_t computed = (n + NR - 1) / NR * NR;
      INFO("n " << n << " in place " << in_place);
      for (std::size_t i = 0; i < BM; ++i)
        for (std::size_t j = 0; j < BN; ++j) {
          float s = 0;
          for (std::size_t k = 0; k < BK; ++k) s += float(A[i * BK + k]) * float(B[k * BN + j]);
          REQUIRE(accs[i * BN + j] == (j < computed ? s : 7.5f));
        }
    }
  }
}

}  // namespace tessel_test_tile_tile_program
