// Every mma atom this machine can run against its scalar reference: bitwise for f32 FMA atoms
// (same operation order) and for integer-valued bf16 pairs, within a tight bound for real bf16.
#include <catch2/catch.hpp>

#include <cmath>
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
            if constexpr (KP == 2) x = bf16(val()).bits();
            else x = val();
          }
          for (auto& x : b) {
            if constexpr (KP == 2) x = bf16(val()).bits();
            else x = val();
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
          p.c = c1.data();
          Atom::run(p);
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
    check_atom<arch::best_f32_atom>(integer, g);
    check_atom<arch::avx512_fma_f32<1, 2>>(integer, g);
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

#if defined(__AVX2__) && defined(__FMA__)
TEST_CASE("avx2 fma atoms match the scalar reference bitwise", "[arch][atom][avx2]") {
  std::mt19937 g(4);
  for (bool integer : {true, false}) {
    check_atom<arch::avx2_fma_6x16_f32>(integer, g);
    check_atom<arch::avx2_fma_f32<2, 2>>(integer, g);
  }
}
#endif

TEST_CASE("run_rows dispatches the partial-panel atom", "[arch][atom]") {
  std::mt19937 g(5);
  using A = arch::best_f32_atom;
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

TEST_CASE("target flags are consistent", "[arch][target]") {
  if (arch::has_avx512_bf16) REQUIRE(arch::has_avx512);
  REQUIRE(std::string(arch::target_name()).size() > 0);
  REQUIRE(arch::vec_f32_width >= 1);
}
