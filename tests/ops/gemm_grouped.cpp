// Grouped GEMM: every product against the fp64 reference (gamma_K bound; integer inputs bitwise)
// over transposes and edge sizes, bits independent of the thread count and of the group's other
// products, gemm's bits on the packed path, the epilogue per product, typed errors.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/gemm_grouped.hpp>

#include "reference/gemm_ref.hpp"
#include "error_match.hpp"
#include "host_devices.hpp"

namespace tessel_test_ops_gemm_grouped {

using tessel_test::is_error;
using tessel::errc;

using namespace tessel;

namespace {

using tessel_test::host;

// One product's operands, stored with padded leading dimensions.
template <class T, class TC = float>
struct product {
  std::size_t M, N, K;
  bool ta, tb;
  float alpha, beta;
  std::size_t lda, ldb, ldc;
  std::vector<T> A, B;
  std::vector<TC> C, C0;
  product(std::size_t m, std::size_t n, std::size_t k, bool a_t, bool b_t, float al = 1.0f, float be = 0.0f, std::size_t pad = 3)
      : M(m), N(n), K(k), ta(a_t), tb(b_t), alpha(al), beta(be) {
    lda = std::max<std::size_t>((ta ? M : K) + pad, 1);
    ldb = std::max<std::size_t>((tb ? K : N) + pad, 1);
    ldc = std::max<std::size_t>(N + pad, 1);
    A.resize((ta ? K : M) * lda);
    B.resize((tb ? N : K) * ldb);
    C.resize(M * ldc);
  }
  gemm_problem<T, T, TC> problem() {
    return {ta ? transpose::yes : transpose::none,
            tb ? transpose::yes : transpose::none,
            M,
            N,
            K,
            alpha,
            A.data(),
            lda,
            B.data(),
            ldb,
            beta,
            C.data(),
            ldc};
  }
  ref::gemm_result reference() const { return ref::gemm(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C0.data(), ldc); }
};

template <class T, class TC>
std::vector<gemm_problem<T, T, TC>> problems_of(std::vector<product<T, TC>>& ps) {
  std::vector<gemm_problem<T, T, TC>> q;
  for (auto& p : ps) q.push_back(p.problem());
  return q;
}

// Bitwise equality of two results (memcmp would be handed an empty vector's null data()).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class TC>
std::size_t violations(const std::vector<TC>& C, std::size_t ldc, const ref::gemm_result& r, std::size_t M, std::size_t N, std::size_t K,
                       bool exact) {
  if (!exact) return ref::gemm_violations(C, ldc, r, M, N, K);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t j = 0; j < N; ++j) bad += ref::to_d(C[i * ldc + j]) != r.c[i * N + j];
  return bad;
}

// A group over every transpose and the edge sizes 0, 1 and primes, skinny (M <= 32) and wide
// products, K = 0 and K across chunks, alpha/beta.
template <class T, class TC>
std::vector<product<T, TC>> mixed_group(std::mt19937& g, bool integers) {
  const std::size_t shapes[][3] = {{0, 5, 7},     {1, 1, 1},       {7, 33, 0},    {31, 97, 129},   {33, 260, 61}, {97, 31, 1},
                                   {131, 7, 300}, {200, 300, 700}, {5, 1100, 37}, {73, 257, 2100}, {300, 0, 9},   {149, 151, 157}};
  std::vector<product<T, TC>> ps;
  std::size_t i = 0;
  for (const auto& s : shapes) {
    const bool ta = (i & 1) != 0, tb = (i & 2) != 0;
    const float alpha = i % 3 == 0 ? 1.0f : 0.5f, beta = i % 4 == 1 ? 0.25f : 0.0f;
    ps.emplace_back(s[0], s[1], s[2], ta, tb, alpha, beta);
    auto& p = ps.back();
    if (integers) {
      ref::fill_int(p.A, g);
      ref::fill_int(p.B, g);
      ref::fill_int(p.C, g);
    } else {
      ref::fill_real(p.A, g);
      ref::fill_real(p.B, g);
      ref::fill_real(p.C, g);
    }
    p.C0 = p.C;
    ++i;
  }
  return ps;
}

}  // namespace

TEMPLATE_TEST_CASE("grouped GEMM: every product within gamma_K of fp64 over transposes and edge sizes", "[ops][gemm][grouped]", float, bf16) {
  std::mt19937 g(11);
  auto ps = mixed_group<TestType, float>(g, false);
  const auto q = problems_of(ps);
  gemm_grouped(host(2), q);
  for (auto& p : ps) {
    INFO("M " << p.M << " N " << p.N << " K " << p.K << " ta " << p.ta << " tb " << p.tb);
    CHECK(violations(p.C, p.ldc, p.reference(), p.M, p.N, p.K, false) == 0);
  }
}

TEMPLATE_TEST_CASE("grouped GEMM: integer inputs give the fp64 result bitwise", "[ops][gemm][grouped]", float, bf16, fp16, e4m3) {
  std::mt19937 g(12);
  auto ps = mixed_group<TestType, float>(g, true);
  const auto q = problems_of(ps);
  gemm_grouped(host(2), q);
  for (auto& p : ps) {
    INFO("M " << p.M << " N " << p.N << " K " << p.K);
    CHECK(violations(p.C, p.ldc, p.reference(), p.M, p.N, p.K, true) == 0);
  }
}

TEMPLATE_TEST_CASE("grouped GEMM: bits independent of the thread count and of the other products", "[ops][gemm][grouped]", float, bf16) {
  std::mt19937 g(13);
  auto ps = mixed_group<TestType, float>(g, false);
  auto one = ps, alone = ps;
  const auto q2 = problems_of(ps), q1 = problems_of(one);
  gemm_grouped(host(2), q2);
  gemm_grouped(host(1), q1);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    INFO("product " << i);
    REQUIRE(same_bits(ps[i].C, one[i].C));
    const std::vector<gemm_problem<TestType, TestType, float>> single{alone[i].problem()};
    gemm_grouped(host(2), single);
    REQUIRE(same_bits(ps[i].C, alone[i].C));
  }
}

TEMPLATE_TEST_CASE("grouped GEMM: an emulated card gives the host's bits (transposed A's packed once included)", "[ops][gemm][grouped]", float,
                   bf16) {
  std::mt19937 g(16);
  auto ps = mixed_group<TestType, float>(g, false);
  ps.emplace_back(150, 700, 900, true, false);  // several column blocks: A packed once for them
  ref::fill_real(ps.back().A, g);
  ref::fill_real(ps.back().B, g);
  auto on_card = ps;
  const auto qh = problems_of(ps), qc = problems_of(on_card);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t{1} << 28;
  emu::card card(0, spec, ex, false, nullptr);
  gemm_grouped(host(2), qh);
  gemm_grouped(card, qc);
  card.synchronize();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    INFO("product " << i);
    REQUIRE(same_bits(ps[i].C, on_card[i].C));
  }
  CHECK(card.clock() > 0.0);  // the launches were charged to the card
}

// Shapes gemm runs on its packed path (above the direct path's size, K not split, no skinny-dot
// path): a grouped product has the same bits, wide (M > 32) or skinny, with an epilogue that
// reads the product's own row and column indices.
TEMPLATE_TEST_CASE("grouped GEMM: gemm's bits on the packed path, epilogue per product", "[ops][gemm][grouped]", float, bf16) {
  std::mt19937 g(14);
  const std::size_t shapes[][3] = {{200, 300, 700}, {130, 520, 333}, {20, 600, 500}, {33, 257, 1500}, {75, 1030, 2200}};
  std::vector<product<TestType, bf16>> ps;
  std::vector<float> bias(1030);
  ref::fill_real(bias, g);
  const auto ep = epilogue::bias(std::span<const float>(bias)) | epilogue::gelu | epilogue::cast<bf16>;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const auto& s : shapes) {
        // bf16 gemm streams a row-major B for M <= 48 (its skinny rows path): those keep tb
        if (std::is_same_v<TestType, bf16> && s[0] <= 48 && !tb) continue;
        ps.emplace_back(s[0], s[1], s[2], ta, tb, 0.75f, 0.0f);
        ref::fill_real(ps.back().A, g);
        ref::fill_real(ps.back().B, g);
      }
  auto single = ps;
  const auto q = problems_of(ps);
  gemm_grouped(host(2), q, ep);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto& p = single[i];
    gemm(host(2), p.ta ? transpose::yes : transpose::none, p.tb ? transpose::yes : transpose::none, p.M, p.N, p.K, p.alpha, p.A.data(), p.lda,
         p.B.data(), p.ldb, p.beta, p.C.data(), p.ldc, ep);
    INFO("M " << p.M << " N " << p.N << " K " << p.K << " ta " << p.ta << " tb " << p.tb);
    REQUIRE(same_bits(ps[i].C, p.C));
  }
}

TEST_CASE("grouped GEMM: FP8 products with block scales (DeepSeek-V3) give gemm's bits with the same scales", "[ops][gemm][grouped][fp8]") {
  // every transpose; skinny and wide rows (a block-scaled product runs wide, as in gemm), K off and
  // on the 128 scale blocks, N across 128-column scale blocks; per-tensor scales folded in too
  std::mt19937 g(15);
  std::uniform_real_distribution<float> sd(0.25f, 4.0f);
  const std::size_t shapes[][3] = {{1, 200, 130}, {17, 130, 256}, {64, 300, 700}, {129, 129, 1}, {200, 515, 384}};
  std::vector<product<e4m3, bf16>> ps;
  std::vector<std::vector<float>> sa, sb;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const auto& sh : shapes) {
        ps.emplace_back(sh[0], sh[1], sh[2], ta, tb, 0.75f, 0.0f);
        ref::fill_real(ps.back().A, g);
        ref::fill_real(ps.back().B, g);
        const std::size_t kb = (sh[2] + 127) / 128, nb = (sh[1] + 127) / 128;
        sa.emplace_back(sh[0] * kb);
        sb.emplace_back(kb * nb);
        for (float& x : sa.back()) x = sd(g);
        for (float& x : sb.back()) x = sd(g);
      }
  auto single = ps;
  auto q = problems_of(ps);
  for (std::size_t i = 0; i < q.size(); ++i) q[i].scales = gemm_scales{0.5f, 1.5f, sa[i].data(), sb[i].data()};
  gemm_grouped(host(2), q, epilogue::cast<bf16>);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto& p = single[i];
    gemm(host(2), p.ta ? transpose::yes : transpose::none, p.tb ? transpose::yes : transpose::none, p.M, p.N, p.K, p.alpha, p.A.data(), p.lda,
         p.B.data(), p.ldb, p.beta, p.C.data(), p.ldc, epilogue::cast<bf16>, gemm_scales{0.5f, 1.5f, sa[i].data(), sb[i].data()});
    INFO("M " << p.M << " N " << p.N << " K " << p.K << " ta " << p.ta << " tb " << p.tb);
    REQUIRE(same_bits(ps[i].C, p.C));
  }
  // the scales matter: without them the products differ
  auto plain = problems_of(single);
  gemm_grouped(host(2), plain, epilogue::cast<bf16>);
  CHECK_FALSE(same_bits(ps[2].C, single[2].C));
  // all or none, and both halves of a block scale
  q[3].scales.a_block = nullptr;
  REQUIRE_THROWS_MATCHES(gemm_grouped(host(2), q, epilogue::cast<bf16>), gemm_error,
                         is_error(errc::invalid_argument, "gemm", "both a_block and b_block, grouped product 3 of 20"));
  q[3].scales.b_block = nullptr;
  REQUIRE_THROWS_MATCHES(gemm_grouped(host(2), q, epilogue::cast<bf16>), gemm_error,
                         is_error(errc::invalid_argument, "gemm", "block scales on 19 of the 20 products of a group: all or none"));
}

TEST_CASE("grouped GEMM: an empty group and empty products do nothing", "[ops][gemm][grouped]") {
  REQUIRE_NOTHROW(gemm_grouped(host(2), std::vector<gemm_problem<float, float, float>>{}));
  std::vector<float> C(4, 7.0f);
  const std::vector<gemm_problem<float, float, float>> q{
      {transpose::none, transpose::none, 0, 4, 0, 1.0f, nullptr, 1, nullptr, 4, 0.0f, nullptr, 4},
      {transpose::none, transpose::none, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, C.data(), 2}};
  gemm_grouped(host(2), q);
  CHECK(C == std::vector<float>{3.5f, 3.5f, 3.5f, 3.5f});  // K = 0: beta·C
}

TEST_CASE("grouped GEMM: bad products give typed errors naming the product", "[ops][gemm][grouped][errors]") {
  std::vector<float> A(100), B(100), C(100);
  const auto N_ = transpose::none;
  std::vector<gemm_problem<float, float, float>> q(3, {N_, N_, 5, 5, 5, 1.0f, A.data(), 5, B.data(), 5, 0.0f, C.data(), 5});
  q[2].lda = 4;
  REQUIRE_THROWS_MATCHES(gemm_grouped(host(2), q), gemm_error, is_error(errc::invalid_argument, "gemm", "grouped product 2 of 3"));
  REQUIRE_THROWS_MATCHES(gemm_grouped(host(2), q), gemm_error, is_error(errc::invalid_argument, "gemm", "leading dimension of A"));
  q[2].lda = 5;
  q[1].C = nullptr;
  REQUIRE_THROWS_MATCHES(gemm_grouped(host(2), q), gemm_error, is_error(errc::invalid_argument, "gemm", "null C"));
  q[1].C = C.data();
  q[0].M = std::size_t{1} << 62;
  q[0].lda = 5;
  REQUIRE_THROWS_AS(gemm_grouped(host(2), q), tessel::error);
}

TEST_CASE("gemm_problem_of: tensor views (transposed or not) as grouped products, gemm's tensor form's bits", "[ops][gemm][grouped]") {
  std::mt19937 g(15);
  const std::size_t M = 90, N = 300, K = 400;
  std::vector<float> A(M * K), At(K * M), B(K * N), Bt(N * K);
  for (auto* v : {&A, &B}) ref::fill_real(*v, g);
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t k = 0; k < K; ++k) At[k * M + i] = A[i * K + k];
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t j = 0; j < N; ++j) Bt[j * K + k] = B[k * N + j];
  const tensor<const float, 2> a(A.data(), M, K), b(B.data(), K, N), at(At.data(), K, M), bt(Bt.data(), N, K);
  std::vector<float> want(M * N), got(4 * M * N);
  gemm(host(2), a, b, tensor<float, 2>(want.data(), M, N), 0.5f);
  std::vector<gemm_problem<float, float, float>> q;
  q.push_back(gemm_problem_of(a, b, tensor<float, 2>(got.data(), M, N), 0.5f));
  q.push_back(gemm_problem_of(at.transposed(), b, tensor<float, 2>(got.data() + M * N, M, N), 0.5f));
  q.push_back(gemm_problem_of(a, bt.transposed(), tensor<float, 2>(got.data() + 2 * M * N, M, N), 0.5f));
  q.push_back(gemm_problem_of(at.transposed(), bt.transposed(), tensor<float, 2>(got.data() + 3 * M * N, M, N), 0.5f));
  CHECK(q[1].ta == transpose::yes);
  CHECK(q[2].tb == transpose::yes);
  gemm_grouped(host(2), q);
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("transposes " << i);
    CHECK(std::memcmp(got.data() + i * M * N, want.data(), M * N * sizeof(float)) == 0);
  }
  // a view strided both ways, or shapes that do not chain, are typed errors
  const auto every_other = tensor<const float, 2>::strided(A.data(), M / 2, K / 2, 2 * K, 2);
  std::vector<float> C(M * N);
  CHECK_THROWS_MATCHES(gemm_problem_of(every_other, tensor<const float, 2>(B.data(), K / 2, N), tensor<float, 2>(C.data(), M / 2, N)), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "neither unit row nor unit column stride"));
  CHECK_THROWS_MATCHES(gemm_problem_of(a, a, tensor<float, 2>(C.data(), M, K)), gemm_error,
                       is_error(errc::invalid_argument, "gemm", "mismatched shapes"));
}

TEST_CASE("grouped GEMM program declares its cost (costed_program)", "[ops][gemm][grouped]") {
  using P = tessel::detail::gemm_grouped_program<float, float, float, epilogue::chain<epilogue::alpha_beta>, false>;
  STATIC_REQUIRE(costed_program<P>);
  using Q = tessel::detail::gemm_grouped_program<e4m3, e4m3, float, epilogue::chain<epilogue::alpha_beta>, true>;
  STATIC_REQUIRE(costed_program<Q>);
}

}  // namespace tessel_test_ops_gemm_grouped
