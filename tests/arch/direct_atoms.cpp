// The direct GEMM atoms against their scalar references, bitwise (same operation order), for
// every row count, column counts across the masked edge, depths across the vector width, and
// A in both orders; the dot atoms' fixed 16-lane order also against a plain formula.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <tessel/arch/direct_atoms.hpp>

using namespace tessel;

namespace {
bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

float val(std::mt19937& g, bool integer) {
  if (integer) return static_cast<float>(static_cast<int>(g() % 9) - 4);
  return std::ldexp(static_cast<float>(static_cast<int>(g() % 2001) - 1000), -9);
}

template <class Atom, class Ref>
void check_rows(std::mt19937& g) {
  constexpr int MR = Atom::mr, NC = Atom::nc;
  for (int rows = 1; rows <= MR; ++rows)
    for (int n : {1, 7, NC / 2 + 1, NC - 1, NC})
      for (std::size_t k : {0, 1, 2, 15, 16, 17, 33})
        for (bool col_major_a : {false, true})
          for (bool integer : {false, true}) {
            const std::size_t ldb = static_cast<std::size_t>(n) + 3, ldc = NC + 5;
            std::vector<float> a(static_cast<std::size_t>(MR + 1) * (k + 2) + 8), b((k + 1) * ldb), c1(MR * ldc, -9.0f), c2 = c1;
            for (auto& x : a) x = val(g, integer);
            for (auto& x : b) x = val(g, integer);
            arch::direct_rows_args p;
            p.a = a.data();
            p.a_rs = col_major_a ? 1 : k + 2;
            p.a_cs = col_major_a ? MR + 1 : 1;
            p.b = b.data();
            p.ldb = ldb;
            p.k = k;
            p.n = n;
            p.ldc = ldc;
            p.prefetch_rows = integer ? 3 : 0;  // (a request past B's last row is harmless, and changes nothing)
            p.c = c1.data();
            arch::run_rows_of<Atom>(rows, p);
            p.c = c2.data();
            arch::run_rows_of<Ref>(rows, p);
            std::size_t bad = 0;
            for (std::size_t i = 0; i < c1.size(); ++i) bad += !same_bits(c1[i], c2[i]);
            // nothing outside (rows, n) was written
            for (int i = 0; i < MR; ++i)
              for (std::size_t j = 0; j < ldc; ++j)
                if ((i >= rows || j >= static_cast<std::size_t>(n)) && c1[i * ldc + j] != -9.0f) ++bad;
            INFO("rows " << rows << " n " << n << " k " << k << " col-major A " << col_major_a);
            REQUIRE(bad == 0);
          }
}

// Runs Atom and Ref on the same dot arguments (C's rows NR + 2 apart, prefilled with -9) and counts
// the elements whose bits differ, the ones outside (rows, n) that changed, and, when `exact`, the
// ones unequal to the fp64 dot (small integers give it in any order). to_f reads an operand element.
template <class Atom, class Ref, class E, class ToF>
std::size_t dot_mismatches(const std::vector<E>& a, const std::vector<E>& b, std::size_t lda, std::size_t ldb, std::size_t k, int rows, int n,
                           bool exact, ToF to_f) {
  constexpr int MR = Atom::mr;
  const std::size_t ldc = Atom::nr + 2;
  std::vector<float> c1(MR * ldc, -9.0f), c2 = c1;
  arch::dot_args<E> p{.a = a.data(), .lda = lda, .b = b.data(), .ldb = ldb, .k = k, .n = n, .c = c1.data(), .ldc = ldc};
  arch::run_rows_of<Atom>(rows, p);
  p.c = c2.data();
  arch::run_rows_of<Ref>(rows, p);
  std::size_t bad = 0;
  for (int i = 0; i < MR; ++i)
    for (std::size_t j = 0; j < ldc; ++j) {
      const float got = c1[i * ldc + j];
      if (!same_bits(got, c2[i * ldc + j])) ++bad;
      if (i >= rows || j >= static_cast<std::size_t>(n)) {
        if (got != -9.0f) ++bad;
      } else if (exact) {
        double want = 0;
        for (std::size_t q = 0; q < k; ++q) want += double(to_f(a[i * lda + q])) * double(to_f(b[j * ldb + q]));
        if (double(got) != want) ++bad;
      }
    }
  return bad;
}

template <class Atom, class Ref>
void check_dot(std::mt19937& g) {
  constexpr int MR = Atom::mr, NR = Atom::nr;
  for (int rows = 1; rows <= MR; ++rows)
    for (int n = 1; n <= NR; ++n)
      for (std::size_t k : {0, 1, 7, 15, 16, 17, 31, 32, 33, 100})
        for (bool integer : {false, true}) {
          const std::size_t lda = k + 3, ldb = k + 1;
          std::vector<float> a(MR * lda + 1), b(NR * ldb + 1);
          for (auto& x : a) x = val(g, integer);
          for (auto& x : b) x = val(g, integer);
          INFO("rows " << rows << " n " << n << " k " << k);
          REQUIRE(dot_mismatches<Atom, Ref>(a, b, lda, ldb, k, rows, n, integer, [](float x) { return x; }) == 0);
        }
}
}  // namespace

TEST_CASE("direct rows atoms equal their scalar reference bitwise", "[arch][direct]") {
  std::mt19937 g(51);
  check_rows<arch::scalar_direct_rows_f32<3, 8>, arch::scalar_direct_rows_f32<3, 8>>(g);
#if defined(__AVX512F__)
  check_rows<arch::avx512_direct_rows_f32<4, 4>, arch::scalar_direct_rows_f32<4, 64>>(g);
  check_rows<arch::avx512_direct_rows_f32<2, 1>, arch::scalar_direct_rows_f32<2, 16>>(g);
  check_rows<arch::avx512_direct_rows_f32<1, 16>, arch::scalar_direct_rows_f32<1, 256>>(g);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  check_rows<arch::avx2_direct_rows_f32<4, 2>, arch::scalar_direct_rows_f32<4, 16>>(g);
#endif
  check_rows<arch::best_direct_rows_atom, arch::scalar_direct_rows_f32<arch::best_direct_rows_atom::mr, arch::best_direct_rows_atom::nc>>(g);
  using few = arch::best_direct_rows_atom_few_rows;
  using gemv = arch::best_direct_rows_atom_gemv;
  check_rows<few, arch::scalar_direct_rows_f32<few::mr, few::nc>>(g);
  check_rows<gemv, arch::scalar_direct_rows_f32<gemv::mr, gemv::nc>>(g);
}

TEST_CASE("direct dot atoms equal their scalar reference bitwise (16 partial sums, halving tree)", "[arch][direct]") {
  std::mt19937 g(52);
  check_dot<arch::scalar_direct_dot_f32<2, 3>, arch::scalar_direct_dot_f32<2, 3>>(g);
#if defined(__AVX512F__)
  check_dot<arch::avx512_direct_dot_f32<4, 4>, arch::scalar_direct_dot_f32<4, 4>>(g);
  check_dot<arch::avx512_direct_dot_f32<2, 8>, arch::scalar_direct_dot_f32<2, 8>>(g);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  check_dot<arch::avx2_direct_dot_f32<2, 3>, arch::scalar_direct_dot_f32<2, 3>>(g);
#endif
  check_dot<arch::best_direct_dot_atom, arch::scalar_direct_dot_f32<arch::best_direct_dot_atom::mr, arch::best_direct_dot_atom::nr>>(g);
  using few = arch::best_direct_dot_atom_few_rows;
  check_dot<few, arch::scalar_direct_dot_f32<few::mr, few::nr>>(g);
  using one = arch::best_direct_dot_atom_one_col;
  check_dot<one, arch::scalar_direct_dot_f32<one::mr, one::nr>>(g);
}

namespace {
// bf16 bit patterns: small integers (every order exact), random finite values with subnormals
// among them (the flush to zero must match), or the top half of random floats
std::uint16_t bf16_val(std::mt19937& g, int kind) {
  if (kind == 0) {
    const float f = static_cast<float>(static_cast<int>(g() % 9) - 4);
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<std::uint16_t>(u >> 16);
  }
  std::uint16_t h = static_cast<std::uint16_t>(g());
  if (kind == 1 && g() % 8 == 0) h &= 0x807F;  // a subnormal (or zero) of either sign
  if ((h & 0x7F80) == 0x7F80) h &= 0xBFFF;     // no Inf/NaN
  return h;
}

template <class Atom, class Ref>
void check_dot_bf16(std::mt19937& g) {
  constexpr int MR = Atom::mr, NR = Atom::nr;
  for (int rows = 1; rows <= MR; ++rows)
    for (int n = 1; n <= NR; ++n)
      for (std::size_t k : {0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 300, 1000})
        for (int kind : {0, 1, 2}) {
          const std::size_t lda = k + 3, ldb = k + 1;
          std::vector<std::uint16_t> a(MR * lda + 1), b(NR * ldb + 1);
          // kind 2 keeps products far from overflow: exponents near 1
          for (auto& x : a) x = kind == 2 ? static_cast<std::uint16_t>((bf16_val(g, 2) & 0x807F) | 0x3F00) : bf16_val(g, kind);
          for (auto& x : b) x = kind == 2 ? static_cast<std::uint16_t>((bf16_val(g, 2) & 0x807F) | 0x3F80) : bf16_val(g, kind);
          if (kind == 1)  // subnormals among moderate values
            for (auto* v : {&a, &b})
              for (auto& x : *v)
                if ((x & 0x7F80) != 0) x = static_cast<std::uint16_t>((x & 0x807F) | 0x3F00);
          INFO("rows " << rows << " n " << n << " k " << k << " kind " << kind);
          REQUIRE(dot_mismatches<Atom, Ref>(a, b, lda, ldb, k, rows, n, kind == 0,
                                            [](std::uint16_t x) { return arch::detail::bf16_bits_to_f32(x); }) == 0);
        }
}
}  // namespace

TEST_CASE("bf16 direct dot atoms equal their scalar reference bitwise (vdpbf16ps pairs, flush to zero)", "[arch][direct]") {
  std::mt19937 g(53);
  check_dot_bf16<arch::scalar_direct_dot_bf16<2, 3>, arch::scalar_direct_dot_bf16<2, 3>>(g);
  // the reference's flush: a subnormal input contributes nothing
  {
    const std::uint16_t a[2] = {0x0001, 0x3F80}, b[2] = {0x3F80, 0x3F80};  // (subnormal, 1) · (1, 1)
    float c = -9.0f;
    arch::direct_dot_bf16_args p;
    p.a = a, p.b = b, p.lda = 2, p.ldb = 2, p.k = 2, p.n = 1, p.c = &c, p.ldc = 1;
    arch::scalar_direct_dot_bf16<1, 1>::run(p);
    REQUIRE(c == 1.0f);
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  check_dot_bf16<arch::avx512bf16_direct_dot_bf16<4, 4>, arch::scalar_direct_dot_bf16<4, 4>>(g);
  check_dot_bf16<arch::avx512bf16_direct_dot_bf16<1, 8>, arch::scalar_direct_dot_bf16<1, 8>>(g);
  check_dot_bf16<arch::avx512bf16_direct_dot_bf16<1, 8, 8>, arch::scalar_direct_dot_bf16<1, 8>>(g);  // bursts of 8 lines per row
  check_dot_bf16<arch::avx512bf16_direct_dot_bf16<1, 8, 4>, arch::scalar_direct_dot_bf16<1, 8>>(g);
  check_dot_bf16<arch::avx512bf16_direct_dot_bf16<2, 4, 2>, arch::scalar_direct_dot_bf16<2, 4>>(g);
  using best = arch::best_direct_dot_bf16_atom;
  check_dot_bf16<best, arch::scalar_direct_dot_bf16<best::mr, best::nr>>(g);
#endif
}
