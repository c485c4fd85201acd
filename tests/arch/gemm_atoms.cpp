// Every mma atom this machine can run against its scalar reference: bitwise for f32 FMA atoms
// (same operation order) and for integer-valued bf16 pairs, within a tight bound for real bf16.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <tessel/arch/gemm_atoms.hpp>
#include <tessel/types/bf16.hpp>

using namespace tessel;

namespace {
template <class Atom>
void check_atom(bool integer, std::mt19937& g) {
  using Ref = arch::reference_atom_for<Atom>;
  constexpr int MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  for (std::size_t k : {1, 2, 17, 64}) {
    for (bool direct : {false, true})
      for (bool acc : {false, true})
        for (bool scaled : {false, true}) {
          std::vector<typename Atom::a_type> a(k * MR * KP + 64);
          std::vector<typename Atom::b_type> b(k * NR * KP);
          std::uniform_int_distribution<int> di(-4, 4);
          std::uniform_real_distribution<float> dr(0.5f, 2.0f);
          auto val = [&] { return integer ? static_cast<float>(di(g)) : dr(g); };
          for (auto& x : a) {
            if constexpr (KP == 2)
              x = bf16(val()).bits();
            else
              x = val();
          }
          for (auto& x : b) {
            if constexpr (KP == 2)
              x = bf16(val()).bits();
            else
              x = val();
          }
          std::vector<float> c1(MR * (NR + 3)), c2;
          for (auto& x : c1) x = integer ? static_cast<float>(di(g)) : dr(g);
          c2 = c1;
          std::vector<float> rs(MR), cs(NR);
          for (auto& x : rs) x = integer ? 2.0f : dr(g);
          for (auto& x : cs) x = integer ? 0.5f : dr(g);
          arch::ukernel_args p;
          p.k = k;
          p.a = a.data();
          p.b = b.data();
          p.ldc = NR + 3;
          p.accumulate = acc;
          if (direct) p.a_rs = k * KP;  // A as a row-major (MR, k*KP) matrix
          if (scaled) {
            p.row_scale = rs.data();
            p.col_scale = cs.data();
          }
          // the same tile written to a separate 64-byte aligned `out` (streamed) leaves c as it was
          constexpr std::size_t ldo = (NR + 15) / 16 * 16 + 16;
          std::vector<float> obuf(MR * ldo + 16, -7.0f);
          float* o = obuf.data() + (16 - reinterpret_cast<std::uintptr_t>(obuf.data()) / 4 % 16) % 16;
          const std::vector<float> c0 = c1;
          p.out = o;
          p.ldo = ldo;
          p.c = c1.data();
          Atom::run(p);
          REQUIRE(c1 == c0);
          p.out = nullptr;
          Atom::run(p);
          for (int i = 0; i < MR; ++i) REQUIRE(std::memcmp(o + i * ldo, c1.data() + i * (NR + 3), NR * 4) == 0);
          p.c = c2.data();
          Ref::run(p);
          INFO("k=" << k << " direct=" << direct << " acc=" << acc << " scaled=" << scaled << " integer=" << integer);
          if (KP == 1 || integer) {
            REQUIRE(std::memcmp(c1.data(), c2.data(), c1.size() * 4) == 0);
          } else {
            for (std::size_t i = 0; i < c1.size(); ++i) REQUIRE(std::fabs(c1[i] - c2[i]) <= 1e-5f * (std::fabs(c2[i]) + 1));
          }
        }
  }
}
}  // namespace

TEST_CASE("scalar reference atoms agree with each other's layouts", "[arch][atom]") {
  std::mt19937 g(1);
  check_atom<arch::scalar_fma_f32<3, 8>>(true, g);
  check_atom<arch::scalar_fma_f32<3, 8>>(false, g);
}

#if defined(__AVX512F__)
TEST_CASE("avx512 fma atoms match the scalar reference bitwise", "[arch][atom][avx512]") {
  std::mt19937 g(2);
  for (bool integer : {true, false}) {
    check_atom<arch::avx512_fma_6x32_f32>(integer, g);
    check_atom<arch::avx512_fma_8x32_f32>(integer, g);
    check_atom<arch::avx512_fma_6x64_f32>(integer, g);
    check_atom<arch::best_f32_atom>(integer, g);
    check_atom<arch::best_f32_gemm_atom>(integer, g);
    check_atom<arch::avx512_fma_f32<1, 2>>(integer, g);
    check_atom<arch::avx512_fma_f32<5, 4>>(integer, g);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
TEST_CASE("avx512_bf16 vdpbf16ps atoms match the scalar pair reference", "[arch][atom][avx512_bf16]") {
  std::mt19937 g(3);
  for (bool integer : {true, false}) {
    check_atom<arch::avx512bf16_dot_6x32_bf16bf16f32>(integer, g);
    check_atom<arch::best_bf16_atom>(integer, g);
    check_atom<arch::avx512bf16_dot_bf16bf16f32<5, 2>>(integer, g);
  }
}
#endif

namespace {
// A block-scaled pair atom (scaled_ukernel_args) against its scalar reference: several scale
// blocks per call (a short last one included), in-place and panel A, accumulate or not.
template <class Atom, int Rows = Atom::mr>
void check_scaled_atom(bool integer, std::mt19937& g) {
  constexpr int MR = Atom::mr, NR = Atom::nr;
  using Ref = arch::scalar_dot2_scaled_bf16<MR, NR>;
  for (std::size_t bk : {64, 5})
    for (std::size_t k : {1, 64, 65, 150, 256})
      for (bool direct : {false, true})
        for (bool acc : {false, true}) {
          const std::size_t nq = (k + bk - 1) / bk;
          std::vector<std::uint16_t> a(k * MR * 2 + 64), b(k * NR * 2);
          std::uniform_int_distribution<int> di(-4, 4);
          std::uniform_real_distribution<float> dr(-2.0f, 2.0f), ds(0.25f, 4.0f);
          auto val = [&] { return integer ? static_cast<float>(di(g)) : dr(g); };
          for (auto& x : a) x = bf16(val()).bits();
          for (auto& x : b) x = bf16(val()).bits();
          const std::size_t ldc = NR + 5, rs_stride = MR + 3, cs_stride = NR + 16;
          std::vector<float> c1(MR * ldc), c2, rs(nq * rs_stride), cs(nq * cs_stride);
          for (auto& x : c1) x = val();
          c2 = c1;
          for (auto& x : rs) x = integer ? 2.0f : ds(g);
          for (auto& x : cs) x = integer ? 0.5f : ds(g);
          arch::scaled_ukernel_args p;
          p.k = k;
          p.a = a.data();
          p.b = b.data();
          p.ldc = ldc;
          p.accumulate = acc;
          if (direct) p.a_rs = k * 2;  // A as a row-major (MR, 2k) matrix
          p.row_scale = rs.data();
          p.col_scale = cs.data();
          p.block_k = bk;
          p.rs_stride = rs_stride;
          p.cs_stride = cs_stride;
          p.c = c1.data();
          arch::run_rows_of<Atom>(Rows, p);
          p.c = c2.data();
          arch::run_rows_of<Ref>(Rows, p);
          INFO("k=" << k << " block_k=" << bk << " direct=" << direct << " acc=" << acc << " integer=" << integer << " rows=" << Rows);
          if (integer) {
            REQUIRE(std::memcmp(c1.data(), c2.data(), c1.size() * 4) == 0);
          } else {
            for (std::size_t i = 0; i < c1.size(); ++i) REQUIRE(std::fabs(c1[i] - c2[i]) <= 1e-5f * (std::fabs(c2[i]) + 1));
          }
        }
}
}  // namespace

TEST_CASE("scalar block-scaled pair reference is the pair reference once per scale block", "[arch][atom]") {
  std::mt19937 g(7);
  constexpr int MR = 3, NR = 4;
  const std::size_t k = 11, bk = 4, nq = 3;
  std::vector<std::uint16_t> a(k * MR * 2), b(k * NR * 2);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f), ds(0.25f, 4.0f);
  for (auto& x : a) x = bf16(d(g)).bits();
  for (auto& x : b) x = bf16(d(g)).bits();
  std::vector<float> rs(nq * MR), cs(nq * NR), c1(MR * NR, 7.0f), c2(MR * NR, 7.0f);
  for (auto& x : rs) x = ds(g);
  for (auto& x : cs) x = ds(g);
  arch::scaled_ukernel_args p;
  p.k = k;
  p.a = a.data();
  p.b = b.data();
  p.ldc = NR;
  p.c = c1.data();
  p.row_scale = rs.data();
  p.col_scale = cs.data();
  p.block_k = bk;
  p.rs_stride = MR;
  p.cs_stride = NR;
  arch::scalar_dot2_scaled_bf16<MR, NR>::run(p);
  // the same product as one unscaled pair-reference call per block, scaled and summed here
  for (std::size_t q = 0; q < nq; ++q) {
    std::vector<float> t(MR * NR);
    arch::ukernel_args u;
    u.k = std::min(bk, k - q * bk);
    u.a = a.data() + q * bk * 2 * MR;
    u.b = b.data() + q * bk * 2 * NR;
    u.c = t.data();
    u.ldc = NR;
    arch::scalar_dot2_bf16<MR, NR>::run(u);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        const float s = rs[q * MR + i] * cs[q * NR + j];
        float& c = c2[i * NR + j];
        c = q == 0 ? t[i * NR + j] * s : std::fma(t[i * NR + j], s, c);
      }
  }
  REQUIRE(c1 == c2);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
TEST_CASE("avx512_bf16 block-scaled pair atoms match the scalar reference", "[arch][atom][avx512_bf16]") {
  std::mt19937 g(8);
  for (bool integer : {true, false}) {
    check_scaled_atom<arch::best_bf16_scaled_atom>(integer, g);
    check_scaled_atom<arch::best_bf16_scaled_atom, 5>(integer, g);
    check_scaled_atom<arch::avx512bf16_dot_scaled_bf16bf16f32<4, 1>>(integer, g);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
TEST_CASE("avx2 fma atoms match the scalar reference bitwise", "[arch][atom][avx2]") {
  std::mt19937 g(4);
  for (bool integer : {true, false}) {
    check_atom<arch::avx2_fma_6x16_f32>(integer, g);
    check_atom<arch::avx2_fma_f32<2, 2>>(integer, g);
  }
}
#endif

TEMPLATE_TEST_CASE("run_rows dispatches the partial-panel atom", "[arch][atom]", arch::best_f32_atom, arch::best_f32_gemm_atom) {
  std::mt19937 g(5);
  using A = TestType;
  constexpr int NR = A::nr;
  for (int rows = 1; rows <= A::mr; ++rows) {
    const std::size_t k = 9;
    std::vector<float> a(rows * k), b(k * NR), c1(rows * NR), c2(rows * NR);
    std::uniform_int_distribution<int> d(-3, 3);
    for (auto& x : a) x = float(d(g));
    for (auto& x : b) x = float(d(g));
    arch::ukernel_args p;
    p.k = k;
    p.a = a.data();
    p.a_rs = k;
    p.b = b.data();
    p.ldc = NR;
    p.c = c1.data();
    arch::run_rows<A>(rows, p);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < NR; ++j) {
        float s = 0;
        for (std::size_t kk = 0; kk < k; ++kk) s += a[i * k + kk] * b[kk * NR + j];
        c2[i * NR + j] = s;
      }
    REQUIRE(c1 == c2);
  }
}

TEST_CASE("scrambled_col is a permutation of the 32 columns of a unit", "[arch][atom]") {
  std::vector<int> seen(32, 0);
  for (int p = 0; p < 32; ++p) ++seen[arch::scrambled_col(p)];
  for (int c = 0; c < 32; ++c) REQUIRE(seen[c] == 1);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
namespace {
// rows atom (A and B in place) against scalar_rows_dot2_bf16: every row count, partial column
// counts, odd and even K, fresh and continued accumulators, with and without prefetch
template <int MR, int NP>
void check_rows_atom(std::mt19937& g) {
  using Atom = arch::avx512bf16_rows_dot_bf16bf16f32<MR, NP>;
  constexpr int NC = Atom::nc;
  for (int rows = 1; rows <= MR; ++rows)
    for (int n : {1, 17, NC - 3, NC})
      for (std::size_t k : {1, 2, 9, 64})
        for (bool integer : {true, false})
          for (bool acc : {false, true}) {
            const std::size_t lda = k + 3, ldb = NC + 5, ldc = NC + 7;
            std::vector<std::uint16_t> a(rows * lda), b(k * ldb);
            std::uniform_int_distribution<int> di(-4, 4);
            std::uniform_real_distribution<float> dr(0.5f, 2.0f);
            auto val = [&] { return integer ? static_cast<float>(di(g)) : dr(g); };
            for (auto& x : a) x = bf16(val()).bits();
            for (auto& x : b) x = bf16(val()).bits();
            std::vector<float> c1(rows * ldc), c2;
            for (auto& x : c1) x = val();
            c2 = c1;
            arch::rows_args p;
            p.a = a.data();
            p.lda = lda;
            p.b = b.data();
            p.ldb = ldb;
            p.k = k;
            p.n = n;
            p.ldc = ldc;
            p.accumulate = acc;
            p.prefetch = b.data();
            p.prefetch_k = k;
            p.c = c1.data();
            arch::run_rows_of<Atom>(rows, p);
            p.c = c2.data();
            arch::run_rows_of<arch::scalar_rows_dot2_bf16<MR, NC>>(rows, p);
            INFO("MR=" << MR << " NP=" << NP << " rows=" << rows << " n=" << n << " k=" << k << " integer=" << integer << " acc=" << acc);
            if (integer) {
              REQUIRE(std::memcmp(c1.data(), c2.data(), c1.size() * 4) == 0);
            } else {
              for (std::size_t i = 0; i < c1.size(); ++i) REQUIRE(std::fabs(c1[i] - c2[i]) <= 1e-5f * (std::fabs(c2[i]) + 1));
            }
          }
}
}  // namespace

TEST_CASE("avx512_bf16 rows atoms (A and B in place) match the scalar rows reference", "[arch][atom][avx512_bf16]") {
  std::mt19937 g(6);
  check_rows_atom<2, 4>(g);
  check_rows_atom<4, 2>(g);
  check_rows_atom<12, 1>(g);
}

TEST_CASE("pack_pairs_bf16 lays out lane-scrambled K pairs, and pair atom + unscramble match the reference", "[arch][atom][avx512_bf16]") {
  std::mt19937 g(7);
  std::uniform_int_distribution<int> di(-4, 4);
  for (std::size_t k : {1, 2, 7, 40})
    for (std::size_t n : {1, 5, 31, 32, 33, 64, 70}) {
      const std::size_t ldb = n + 3, units = (n + 31) / 32, pairs = (k + 1) / 2, stride = pairs * 64 + 32;
      std::vector<std::uint16_t> b(k * ldb);
      for (auto& x : b) x = bf16(static_cast<float>(di(g))).bits();
      std::vector<std::uint16_t> out(units * stride, 0xFFFF);
      arch::pack_pairs_bf16(b.data(), ldb, k, n, out.data(), stride);
      INFO("k=" << k << " n=" << n);
      for (std::size_t u = 0; u < units; ++u)
        for (std::size_t q = 0; q < pairs; ++q)
          for (int w = 0; w < 64; ++w) {
            const std::size_t row = 2 * q + w % 2, col = 32 * u + static_cast<std::size_t>(arch::scrambled_col(w / 2));
            const std::uint16_t want = row < k && col < n ? b[row * ldb + col] : 0;
            REQUIRE(out[u * stride + q * 64 + w] == want);
          }
      // one 5-row pair-atom product per unit, unscrambled, against the rows reference
      constexpr int MR = 5;
      std::vector<std::uint16_t> a(MR * k), ap(pairs * MR * 2, 0);
      for (auto& x : a) x = bf16(static_cast<float>(di(g))).bits();
      for (std::size_t q = 0; q < pairs; ++q)
        for (int i = 0; i < MR; ++i) {
          ap[(q * MR + i) * 2] = a[i * k + 2 * q];
          ap[(q * MR + i) * 2 + 1] = 2 * q + 1 < k ? a[i * k + 2 * q + 1] : std::uint16_t{0};
        }
      const std::size_t ldc = units * 32;
      std::vector<float> c1(MR * ldc), c2(MR * ldc);
      for (std::size_t u = 0; u < units; ++u) {
        arch::ukernel_args p;
        p.k = pairs;
        p.a = ap.data();
        p.b = out.data() + u * stride;
        p.c = c1.data() + 32 * u;
        p.ldc = ldc;
        arch::avx512bf16_dot_bf16bf16f32<MR, 2>::run(p);
      }
      for (int i = 0; i < MR; ++i) arch::unscramble_pairs32(c1.data() + i * ldc, units);
      arch::rows_args r;
      r.a = a.data();
      r.lda = k;
      r.b = b.data();
      r.ldb = ldb;
      r.k = k;
      r.n = static_cast<int>(n);
      r.c = c2.data();
      r.ldc = ldc;
      arch::scalar_rows_dot2_bf16<MR, 96>::run(r);
      for (int i = 0; i < MR; ++i)
        for (std::size_t j = 0; j < n; ++j) REQUIRE(c1[i * ldc + j] == c2[i * ldc + j]);
    }
}
#endif

TEST_CASE("target flags are consistent", "[arch][target]") {
  if (arch::has_avx512_bf16) REQUIRE(arch::has_avx512);
  REQUIRE(std::string(arch::target_name()).size() > 0);
  REQUIRE(arch::vec_f32_width >= 1);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The skinny program's in-place pair atom (B rows paired in registers) must give the bits of
// packing B with pack_pairs_bf16 and running the pair atom on the panel: the skinny path kept its
// results when it stopped packing; the panel copy it leaves for the next row group holds the same
// rows.
template <int MR>
void check_inplace_atom(std::mt19937& g) {
  for (std::size_t k : {1, 2, 7, 64, 65})
    for (int n : {1, 17, 32})
      for (bool accumulate : {false, true})
        for (bool pf : {false, true}) {
          const std::size_t ldb = 40, kp = (k + 1) / 2, ldc = 36;
          std::vector<std::uint16_t> B(k * ldb - (ldb - static_cast<std::size_t>(n)));  // last row ends at column n
          std::vector<std::uint16_t> A(kp * MR * 2);
          for (auto& x : B) x = bf16(std::uniform_real_distribution<float>(-2.0f, 2.0f)(g)).bits();
          for (auto& x : A) x = bf16(std::uniform_real_distribution<float>(-2.0f, 2.0f)(g)).bits();
          if (k % 2)  // the packed A of an odd chunk ends with a half pair
            for (int i = 0; i < MR; ++i) A[2 * ((kp - 1) * MR + i) + 1] = 0;
          std::vector<float> c0(MR * ldc), c1;
          for (auto& x : c0) x = std::uniform_real_distribution<float>(-4.0f, 4.0f)(g);
          c1 = c0;
          std::vector<std::uint16_t> pk(kp * 64 + 64);
          arch::pack_pairs_bf16(B.data(), ldb, k, static_cast<std::size_t>(n), pk.data(), pk.size());
          arch::ukernel_args p;
          p.k = kp;
          p.a = A.data();
          p.b = pk.data();
          p.c = c0.data();
          p.ldc = ldc;
          p.accumulate = accumulate;
          arch::avx512bf16_dot_bf16bf16f32<MR, 2>::run(p);
          arch::inplace_pairs_args q;
          q.a = A.data();
          q.b = B.data();
          q.ldb = ldb;
          q.k = k;
          q.n = n;
          q.c = c1.data();
          q.ldc = ldc;
          q.accumulate = accumulate;
          std::vector<std::uint16_t> copy(32 * k + 32, 0xFFFF);
          std::vector<float> c2 = c1;
          if (pf) q.prefetch = reinterpret_cast<const char*>(B.data()), q.prefetch_lines = k, q.copy_out = copy.data();
          arch::avx512bf16_dot_inplace_bf16bf16f32<MR, 1>::run(q);
          INFO("MR=" << MR << " k=" << k << " n=" << n << " accumulate=" << accumulate);
          for (int i = 0; i < MR; ++i)
            for (int j = 0; j < 32; ++j) REQUIRE(std::bit_cast<std::uint32_t>(c0[i * ldc + j]) == std::bit_cast<std::uint32_t>(c1[i * ldc + j]));
          if (pf) {  // the copy holds the rows read (zero beyond n), and a call on it gives the same bits
            for (std::size_t r = 0; r < k; ++r)
              for (std::size_t j = 0; j < 32; ++j) REQUIRE(copy[32 * r + j] == (j < static_cast<std::size_t>(n) ? B[r * ldb + j] : 0));
            q.b = copy.data();
            q.ldb = 32;
            q.copy_out = nullptr;
            q.c = c2.data();
            arch::avx512bf16_dot_inplace_bf16bf16f32<MR, 2>::run(q);
            REQUIRE(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) == 0);
          }
        }
}

TEST_CASE("skinny in-place pair atom: same bits as pack_pairs_bf16 + pair atom, also from its panel copy", "[arch][gemm]") {
  std::mt19937 g(14);
  check_inplace_atom<1>(g);
  check_inplace_atom<3>(g);
  check_inplace_atom<8>(g);
  check_inplace_atom<12>(g);
}
#endif
