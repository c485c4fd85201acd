// mma against plain loops. Staged A x staged B for every operand type (through mma_traits: f32,
// fp16, bf16, e4m3, e5m2), depths 1, 2, odd, primes and several K-packs, with and without
// accumulation and row/column scales, and a used depth k below the staged one; A read in place from
// row-major tensors with edge rows; fragments. Inputs are small integers and scales powers of two,
// so every result is exact and must match bitwise (DESIGN.md: integer-valued inputs match bitwise).
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include <tessel/tile/load.hpp>
#include <tessel/tile/mma.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_mma {

using namespace tessel;
using Catch::Matchers::Contains;

namespace {
template <class T>
std::vector<T> small_ints(std::size_t n, std::mt19937& g, int lim = 4) {
  std::vector<T> v(n);
  for (auto& x : v) x = T(float(int(g() % unsigned(2 * lim + 1)) - lim));
  return v;
}

// C = A(M,K) . B(K,N) over the first k of K, in double (exact for these inputs).
template <class T>
std::vector<double> reference(const std::vector<T>& A, const std::vector<T>& B, std::size_t M, std::size_t K, std::size_t N, std::size_t k) {
  std::vector<double> C(M * N, 0.0);
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j)
      for (std::size_t q = 0; q < k; ++q) C[i * N + j] += double(float(A[i * K + q])) * double(float(B[q * N + j]));
  return C;
}

template <class T, std::size_t BK>
void check_staged_mma(std::mt19937& g) {
  using tr = mma_traits<T>;
  using S = typename tr::stage_type;
  constexpr std::size_t BM = 2 * tr::mr, BN = 2 * tr::nr;
  const auto A = small_ints<T>(BM * BK, g), B = small_ints<T>(BK * BN, g);
  using SA = staged<S, BM, BK, typename tr::a_layout>;
  using SB = staged<S, BK, BN, typename tr::b_layout>;
  std::vector<S> am(SA::elements), bm(SB::elements);
  SA a(am.data());
  SB b(bm.data());
  load(tensor<const T, 2>(A.data(), BM, BK).template tile<BM, BK>(0, 0), a);
  load(tensor<const T, 2>(B.data(), BK, BN).template tile<BK, BN>(0, 0), b);
  std::vector<float> rs(BM), cs(BN);
  for (auto& x : rs) x = std::ldexp(1.0f, int(g() % 5) - 2);
  for (auto& x : cs) x = std::ldexp(1.0f, int(g() % 5) - 2);
  fragment<float, BM, BN> acc;
  std::vector<float> old(BM * BN);
  for (auto& x : old) x = float(int(g() % 100) - 50);
  // every used depth 1..BK: "the rest treated as zero" although the staged tile holds data there
  for (std::size_t used = 1; used <= BK; ++used) {
    const auto ref = reference(A, B, BM, BK, BN, used);
    for (int mode = 0; mode < 4; ++mode) {
      const bool accumulate = mode & 1, scaled = mode & 2;
      if (accumulate)
        std::copy(old.begin(), old.end(), acc.v.begin());
      else
        acc.fill(std::numeric_limits<float>::quiet_NaN());  // overwritten, never read
      mma(a, b, acc, {.accumulate = accumulate, .row_scale = scaled ? rs.data() : nullptr, .col_scale = scaled ? cs.data() : nullptr, .k = used});
      std::size_t bad = 0;
      for (std::size_t i = 0; i < BM; ++i)
        for (std::size_t j = 0; j < BN; ++j) {
          double want = ref[i * BN + j] * (scaled ? double(rs[i]) * cs[j] : 1.0);
          if (accumulate) want += old[i * BN + j];
          bad += acc(i, j) != float(want);
        }
      INFO("k " << used << " of " << BK << ", accumulate " << accumulate << ", scaled " << scaled);
      REQUIRE(bad == 0);
    }
  }
}

template <class T>
void check_all_depths(std::mt19937& g) {
  check_staged_mma<T, 1>(g);
  check_staged_mma<T, 2>(g);
  check_staged_mma<T, 7>(g);
  check_staged_mma<T, 32>(g);
  check_staged_mma<T, 41>(g);
}
}  // namespace

TEMPLATE_TEST_CASE("staged mma is exact for integer inputs: every type, depth, accumulate and scale", "[tile][mma]", float, fp16, bf16, e4m3, e5m2) {
  std::mt19937 g(61);
  check_all_depths<TestType>(g);
}

TEST_CASE("mma_traits: the stage type and layouts are the chosen atom's", "[tile][mma]") {
  STATIC_REQUIRE(std::is_same_v<mma_traits<float>::stage_type, float>);
  STATIC_REQUIRE(std::is_same_v<mma_traits<fp16>::stage_type, float>);
  STATIC_REQUIRE(std::is_same_v<mma_traits<bf16>::stage_type, std::conditional_t<arch::has_pair_atom, bf16, float>>);
  STATIC_REQUIRE(std::is_same_v<mma_traits<e4m3>::stage_type, mma_traits<bf16>::stage_type>);
  STATIC_REQUIRE(std::is_same_v<mma_traits<bf16>::a_layout, layout::panel<mma_traits<bf16>::mr, mma_traits<bf16>::k_pack>>);
  STATIC_REQUIRE(std::is_same_v<mma_traits<bf16>::b_layout, layout::col_panel<mma_traits<bf16>::nr, mma_traits<bf16>::k_pack>>);
  STATIC_REQUIRE(mma_traits<float>::k_pack == 1);
  STATIC_REQUIRE(mma_traits<bf16>::k_pack == (arch::has_pair_atom ? 2 : 1));
}

namespace {
// A (rows, K) read in place from a row-major tensor (rows <= BM: an edge tile), B staged.
template <class T, std::size_t BK>
void check_in_place(std::mt19937& g) {
  using tr = mma_traits<T>;
  if constexpr (std::is_same_v<typename tr::stage_type, T>) {
    constexpr std::size_t BM = 2 * tr::mr + 3, BN = 2 * tr::nr;
    using SB = staged<T, BK, BN, typename tr::b_layout>;
    for (std::size_t rows : {std::size_t{1}, tr::mr - 1, tr::mr, tr::mr + 1, BM}) {
      for (std::size_t K : {std::size_t{1}, BK / 2 + 1, BK}) {
        if (K > BK || K == 0) continue;
        const auto A = small_ints<T>(rows * (K + 3), g), B = small_ints<T>(K * BN, g);
        const tensor<const T, 2> tA(A.data(), rows, K, K + 3);  // padded rows: the stride is honoured
        std::vector<T> bm(SB::elements);
        SB b(bm.data());
        load(tensor<const T, 2>(B.data(), K, BN).template tile<BK, BN>(0, 0), b);
        fragment<float, BM, BN> acc;
        for (auto& x : acc.v) x = 1.0f;
        mma(tA.template tile<BM, BK>(0, 0), b, acc);
        std::size_t bad = 0;
        for (std::size_t i = 0; i < BM; ++i)
          for (std::size_t j = 0; j < BN; ++j) {
            double want = 1.0;  // rows past the tensor's edge add zero
            if (i < rows)
              for (std::size_t q = 0; q < K; ++q) want += double(float(A[i * (K + 3) + q])) * double(float(B[q * BN + j]));
            bad += acc(i, j) != float(want);
          }
        INFO("rows " << rows << " K " << K);
        REQUIRE(bad == 0);
      }
    }
  }
}
}  // namespace

TEMPLATE_TEST_CASE("mma with A read in place: edge rows, odd depths, padded row stride", "[tile][mma]", float, bf16) {
  std::mt19937 g(62);
  check_in_place<TestType, 8>(g);
  check_in_place<TestType, 33>(g);
}

TEST_CASE("mma with an in-place A that is not row-major is an error", "[tile][mma][errors]") {
  using tr = mma_traits<float>;
  constexpr std::size_t BM = tr::mr, BN = tr::nr, BK = 4;
  std::vector<float> A(BM * BK, 1.0f), bm(staged<float, BK, BN, tr::b_layout>::elements, 0.0f);
  staged<float, BK, BN, tr::b_layout> b(bm.data());
  fragment<float, BM, BN> acc{};
  const tensor<const float, 2> colmajor(A.data(), BM, BK, BM, order::col_major);
  REQUIRE_THROWS_WITH(mma(colmajor.tile<BM, BK>(0, 0), b, acc), Contains("row-major"));
  REQUIRE_THROWS_AS(mma(colmajor.tile<BM, BK>(0, 0), b, acc), std::exception);
}

TEST_CASE("fragment mma: one fma per k in k order, identity and zero are units", "[tile][mma]") {
  std::mt19937 g(63);
  std::normal_distribution<float> d(0.0f, 1.0f);
  fragment<float, 5, 7> a;
  fragment<float, 7, 3> b;
  fragment<float, 5, 3> c, ref;
  for (auto& x : a.v) x = d(g);
  for (auto& x : b.v) x = d(g);
  for (auto& x : c.v) x = d(g);
  ref = c;
  mma(a, b, c);
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t k = 0; k < 7; ++k)
      for (std::size_t j = 0; j < 3; ++j) ref(i, j) = std::fma(a(i, k), b(k, j), ref(i, j));
  for (std::size_t i = 0; i < c.v.size(); ++i) REQUIRE(std::bit_cast<std::uint32_t>(c.v[i]) == std::bit_cast<std::uint32_t>(ref.v[i]));
  // a . I added to zero is a; a . 0 leaves c
  fragment<float, 7, 7> eye{};
  for (std::size_t i = 0; i < 7; ++i) eye(i, i) = 1.0f;
  fragment<float, 5, 7> out{};
  mma(a, eye, out);
  for (std::size_t i = 0; i < a.v.size(); ++i) REQUIRE(out.v[i] == a.v[i]);
  const fragment<float, 7, 3> zero{};
  const auto before = c;
  mma(a, zero, c);
  for (std::size_t i = 0; i < c.v.size(); ++i) REQUIRE(c.v[i] == before.v[i]);
}

}  // namespace tessel_test_tile_mma
