// The AVX2 + FMA matrix-multiply atom (part of arch/gemm_atoms.hpp), for machines without
// AVX-512; compiled only when its instructions are enabled.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>
#include <tessel/arch/gemm_atoms/reference.hpp>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tessel::arch {

#if defined(__AVX2__) && defined(__FMA__)
// (MR, 8*NV) f32 tile with AVX2 FMA.
template <int MR, int NV>
struct avx2_fma_f32 {
  static constexpr int mr = MR, nr = 8 * NV, k_pack = 1;
  template <int R>
  using with_rows = avx2_fma_f32<R, NV>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    const float* a = static_cast<const float*>(p.a);
    const float* b = static_cast<const float*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 1, ks = p.a_rs ? 1 : MR;
    __m256 t[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) t[i][v] = _mm256_setzero_ps();
    std::size_t k = p.k;
#pragma GCC unroll 4
    for (; k > 0; --k) {
      __m256 bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m256 av = _mm256_broadcast_ss(a + i * rs);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) t[i][v] = _mm256_fmadd_ps(av, bv[v], t[i][v]);
      }
      a += ks;
      b += 8 * NV;
    }
    const bool scaled = p.row_scale || p.col_scale;
    for (int i = 0; i < MR; ++i) {
      float* c = p.c + static_cast<std::size_t>(i) * p.ldc;
      const __m256 rs = _mm256_set1_ps(p.row_scale ? p.row_scale[i] : 1.0f);
      for (int v = 0; v < NV; ++v) {
        __m256 r = t[i][v];
        if (scaled) {
          const __m256 s = _mm256_mul_ps(rs, p.col_scale ? _mm256_loadu_ps(p.col_scale + 8 * v) : _mm256_set1_ps(1.0f));
          r = p.accumulate ? _mm256_fmadd_ps(r, s, _mm256_loadu_ps(c + 8 * v)) : _mm256_mul_ps(r, s);
        } else if (p.accumulate) {
          r = _mm256_add_ps(_mm256_loadu_ps(c + 8 * v), r);
        }
        if (p.out)
          _mm256_stream_ps(p.out + static_cast<std::size_t>(i) * p.ldo + 8 * v, r);
        else
          _mm256_storeu_ps(c + 8 * v, r);
      }
    }
  }
};
using avx2_fma_6x16_f32 = avx2_fma_f32<6, 2>;
#endif

}  // namespace tessel::arch
