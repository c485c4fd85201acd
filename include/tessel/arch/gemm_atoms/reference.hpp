// The matrix-multiply atoms' argument structs and their scalar references (part of
// arch/gemm_atoms.hpp). Each SIMD atom has a reference with the same arithmetic order, which the
// tests compare it with bit for bit; the references also run where no SIMD atom is compiled.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <tessel/arch/target.hpp>

namespace tessel::arch {

// Arguments of one micro-kernel call.
//  f32 atoms (k_pack = 1):   a = [k][MR] floats,          b = [k][NR] floats
//  pair atoms (k_pack = 2):  a = [k/2][MR][2] bf16 bits,  b = [k/2][NR][2] bf16 bits; `k` counts pairs
// Result t = A·B accumulated over k in order; with scales t(i,j) is multiplied by
// row_scale[i] * col_scale[j] (null = 1); then c = t (accumulate = false) or c = c + t.
struct ukernel_args {
  std::size_t k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  float* c = nullptr;
  std::size_t ldc = 0;
  bool accumulate = false;
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
  // 0: A is a packed panel. Otherwise A is read in place, row i at a + i*a_rs elements
  // (row-major f32, or row-major bf16 whose K-pairs are adjacent): no packing for row-major A.
  std::size_t a_rs = 0;
  // Optional (best_f32_atom and best_bf16_atom, and the scalar atoms): the finished tile (c + t,
  // or t) goes to `out` (rows ldo apart, each 64-byte aligned) instead of back to c, with
  // streaming stores where the target has them; the caller fences before publishing it.
  float* out = nullptr;
  std::size_t ldo = 0;
};

namespace detail {
template <int MR, int NR>
inline void finish_scalar(const ukernel_args& p, const float (&t)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float* c = p.c + static_cast<std::size_t>(i) * p.ldc + j;
      float* o = p.out ? p.out + static_cast<std::size_t>(i) * p.ldo + j : p.c + static_cast<std::size_t>(i) * p.ldc + j;
      if (p.row_scale || p.col_scale) {
        const float s = (p.row_scale ? p.row_scale[i] : 1.0f) * (p.col_scale ? p.col_scale[j] : 1.0f);
        *o = p.accumulate ? std::fma(t[i][j], s, *c) : t[i][j] * s;
      } else {
        *o = p.accumulate ? *c + t[i][j] : t[i][j];
      }
    }
}
inline float bf16_bits_to_f32(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Flush a subnormal to (signed) zero, as vdpbf16ps does with its inputs and outputs.
inline float flush_subnormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
}  // namespace detail

// ---- scalar references ------------------------------------------------------------------------

// c (MR,NR) from f32 panels with one fused multiply-add per k, in k order.
template <int MR, int NR>
struct scalar_fma_f32 {
  static constexpr int mr = MR, nr = NR, k_pack = 1;
  template <int R>
  using with_rows = scalar_fma_f32<R, NR>;
  using a_type = float;
  using b_type = float;
  static void run(const ukernel_args& p) {
    const float* a = static_cast<const float*>(p.a);
    const float* b = static_cast<const float*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 1, ks = p.a_rs ? 1 : MR;
    float t[MR][NR] = {};
    for (std::size_t k = 0; k < p.k; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) t[i][j] = std::fma(a[k * ks + i * rs], b[k * NR + j], t[i][j]);
    detail::finish_scalar<MR, NR>(p, t);
  }
};

// c (MR,NR) from bf16 K-pair panels with the semantics of vdpbf16ps: per pair,
// t += a1*b1 then t += a0*b0 (products exact, each sum rounded), subnormals flushed.
template <int MR, int NR>
struct scalar_dot2_bf16 {
  static constexpr int mr = MR, nr = NR, k_pack = 2;
  template <int R>
  using with_rows = scalar_dot2_bf16<R, NR>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const ukernel_args& p) {
    const auto* a = static_cast<const std::uint16_t*>(p.a);
    const auto* b = static_cast<const std::uint16_t*>(p.b);
    const std::size_t rs = p.a_rs ? p.a_rs : 2, ks = p.a_rs ? 2 : 2 * MR;
    float t[MR][NR] = {};
    using detail::bf16_bits_to_f32;
    using detail::flush_subnormal;
    for (std::size_t k = 0; k < p.k; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
          const float a0 = flush_subnormal(bf16_bits_to_f32(a[k * ks + i * rs]));
          const float a1 = flush_subnormal(bf16_bits_to_f32(a[k * ks + i * rs + 1]));
          const float b0 = flush_subnormal(bf16_bits_to_f32(b[(k * NR + j) * 2]));
          const float b1 = flush_subnormal(bf16_bits_to_f32(b[(k * NR + j) * 2 + 1]));
          float acc = flush_subnormal(t[i][j]);
          acc = flush_subnormal(acc + a1 * b1);
          acc = flush_subnormal(acc + a0 * b0);
          t[i][j] = acc;
        }
    detail::finish_scalar<MR, NR>(p, t);
  }
};

// Arguments of a block-scaled pair atom (FP8 with DeepSeek-V3 scales, staged as bf16 K-pairs):
// the k pair steps form scale blocks of `block_k` steps (the last may be shorter). For scale
// block q, t_q = A·B over its steps (FP32, from zero) and, with
// s(i,j) = row_scale[q*rs_stride + i] * col_scale[q*cs_stride + j],
// c = t_0·s (accumulate = false) or c = fma(t_q, s, c): the same arithmetic as one call of a
// pair atom per scale block with row_scale/col_scale, but C is read and written in L1 only.
struct scaled_ukernel_args : ukernel_args {
  std::size_t block_k = 64;
  std::size_t rs_stride = 0;
  std::size_t cs_stride = 0;
};

// Reference of the block-scaled pair atoms: scalar_dot2_bf16 per scale block, then the scaled
// accumulation into c, in block order.
template <int MR, int NR>
struct scalar_dot2_scaled_bf16 {
  static constexpr int mr = MR, nr = NR, k_pack = 2;
  template <int R>
  using with_rows = scalar_dot2_scaled_bf16<R, NR>;
  using a_type = std::uint16_t;
  using b_type = std::uint16_t;
  static void run(const scaled_ukernel_args& p) {
    const std::size_t bk = p.block_k ? p.block_k : 1;
    const std::size_t ks = p.a_rs ? 2 : 2 * MR;  // A words per pair step
    for (std::size_t q = 0, k0 = 0; k0 < p.k; ++q, k0 += bk) {
      ukernel_args s = p;
      s.k = p.k - k0 < bk ? p.k - k0 : bk;
      s.a = static_cast<const std::uint16_t*>(p.a) + k0 * ks;
      s.b = static_cast<const std::uint16_t*>(p.b) + k0 * 2 * NR;
      s.row_scale = p.row_scale + q * p.rs_stride;
      s.col_scale = p.col_scale + q * p.cs_stride;
      s.accumulate = p.accumulate || q > 0;
      scalar_dot2_bf16<MR, NR>::run(s);
    }
  }
};

// Column held at position p (0..31) of a 32-column unit when K pairs are formed lane-locally
// (vpunpck{l,h}wd): the low half holds columns 0-3, 8-11, 16-19, 24-27, the high half the rest.
constexpr int scrambled_col(int p) { return p < 16 ? 8 * (p / 4) + p % 4 : 8 * ((p - 16) / 4) + 4 + p % 4; }

// Arguments of a rows atom: a skinny product with A and B read where they lie (no packing).
//  c(MR, n) = [c +] a(MR, k) · b(k, n); row i of A at a + i*lda, row k of B at b + k*ldb (bf16 bits).
// `prefetch`, when set, names other B rows (row r at prefetch + r*ldb, r < prefetch_k, same
// columns) that the atom requests while it streams its own: the caller's next chunk.
struct rows_args {
  const std::uint16_t* a = nullptr;
  std::size_t lda = 0;
  const std::uint16_t* b = nullptr;
  std::size_t ldb = 0;
  std::size_t k = 0;
  int n = 0;
  float* c = nullptr;
  std::size_t ldc = 0;
  bool accumulate = false;  // start from c (true continuation of an earlier call) or from zero
  const std::uint16_t* prefetch = nullptr;
  std::size_t prefetch_k = 0;
};

// Reference of the rows atoms: vdpbf16ps semantics over K-pairs (k, k+1) formed from two rows of
// B and two adjacent elements of A (an odd K ends with a half pair whose second element is zero);
// the accumulator starts from c when accumulating, so a K split into calls gives the same bits.
template <int MR, int NC>
struct scalar_rows_dot2_bf16 {
  static constexpr int mr = MR, nc = NC;
  template <int R>
  using with_rows = scalar_rows_dot2_bf16<R, NC>;
  static void run(const rows_args& p) {
    using detail::bf16_bits_to_f32;
    using detail::flush_subnormal;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < p.n && j < NC; ++j) {
        float acc = p.accumulate ? p.c[static_cast<std::size_t>(i) * p.ldc + j] : 0.0f;
        for (std::size_t k = 0; k < p.k; k += 2) {
          const bool two = k + 1 < p.k;
          const float a0 = flush_subnormal(bf16_bits_to_f32(p.a[i * p.lda + k]));
          const float a1 = two ? flush_subnormal(bf16_bits_to_f32(p.a[i * p.lda + k + 1])) : 0.0f;
          const float b0 = flush_subnormal(bf16_bits_to_f32(p.b[k * p.ldb + j]));
          const float b1 = two ? flush_subnormal(bf16_bits_to_f32(p.b[(k + 1) * p.ldb + j])) : 0.0f;
          acc = flush_subnormal(acc);
          acc = flush_subnormal(acc + a1 * b1);
          acc = flush_subnormal(acc + a0 * b0);
        }
        p.c[static_cast<std::size_t>(i) * p.ldc + j] = acc;
      }
  }
};

// Runs Atom::with_rows<rows> for 1 <= rows <= Atom::mr with any argument struct.
template <class Atom, int R = Atom::mr, class Args>
inline void run_rows_of(int rows, const Args& p) {
  if constexpr (R >= 1) {
    if (rows == R) return Atom::template with_rows<R>::run(p);
    return run_rows_of<Atom, R - 1>(rows, p);
  }
}

// Runs a rows atom over p.n columns with the narrowest of its widths nc/4, nc/2, nc that holds
// them (a narrow last strip does not load a whole 64-column B row). Every width computes each
// element by the same FMA chain: the choice never changes the bits.
template <class Atom, class Args>
inline void run_rows_narrow(int rows, const Args& p) {
  if (p.n <= Atom::nc / 4)
    run_rows_of<typename Atom::template with_cols<Atom::nc / 4>>(rows, p);
  else if (p.n <= Atom::nc / 2)
    run_rows_of<typename Atom::template with_cols<Atom::nc / 2>>(rows, p);
  else
    run_rows_of<Atom>(rows, p);
}

}  // namespace tessel::arch
