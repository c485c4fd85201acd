// Matrix-multiply atoms: register-blocked micro-kernels computing an (MR,NR) f32 tile from packed
// panels. Named for target, shape and types (CuTe style); each has a scalar reference with the
// same arithmetic order, which tests compare it with. `best_*` aliases pick the fastest atom this
// compilation can run; an atom whose instructions are not enabled fails to compile with a message.
//
// In parts: the argument structs and scalar references in arch/gemm_atoms/reference.hpp, one header
// per target (arch/gemm_atoms/avx512.hpp, arch/gemm_atoms/avx2.hpp), and here the choice of the best
// atoms for this compilation.
#pragma once

#include <cstddef>
#include <type_traits>

#include <tessel/arch/gemm_atoms/avx2.hpp>
#include <tessel/arch/gemm_atoms/avx512.hpp>
#include <tessel/arch/gemm_atoms/reference.hpp>
#include <tessel/arch/target.hpp>

namespace tessel::arch {

// ---- best atoms for this compilation ----------------------------------------------------------
#if defined(__AVX512F__)
using best_f32_atom = avx512_fma_8x32_f32;
#elif defined(__AVX2__) && defined(__FMA__)
using best_f32_atom = avx2_fma_6x16_f32;
#else
using best_f32_atom = scalar_fma_f32<4, 8>;
#endif

// Atom for the f32 GEMM's long K streams (chunks hundreds deep): with AVX-512, 6x64 (24
// accumulators): per K step 6 broadcasts and 4 B loads feed 24 FMAs (8x32: 10 loads for 16), and
// a direct A is read as 6 row streams, not 8. Side by side against 8x32 in the GEMM (512-deep
// chunks): +0.6/+1.3/+1.6% on 1 thread and +0.9/+0.5/+1.5% on 2 threads for f32 2048^3,
// 2048x4096x4096, 2048x11008x4096; 12x32 was 1.6% slower. Tile programs (and attention, whose
// 96-row blocks hold whole 32-column panels) keep best_f32_atom.
#if defined(__AVX512F__)
using best_f32_gemm_atom = avx512_fma_6x64_f32;
#else
using best_f32_gemm_atom = best_f32_atom;
#endif

// Atom for bf16 x bf16 -> f32. Without avx512_bf16 there is no pair atom: bf16 operands are widened
// to f32 while packing and `best_f32_atom` runs (has_pair_atom tells callers which).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
using best_bf16_atom = avx512bf16_dot_bf16bf16f32<12, 2>;
inline constexpr bool has_pair_atom = true;
// Block-scaled (FP8 DeepSeek-V3) pair atom with the same tile as best_bf16_atom.
using best_bf16_scaled_atom = avx512bf16_dot_scaled_bf16bf16f32<12, 2>;
// bf16 rows of B paired in registers, A's pairs broadcast from its rows (the direct path's)
using best_rows_dot_bf16_atom = avx512bf16_rows_dot_bf16bf16f32<6, 2>;
#else
using best_bf16_atom = best_f32_atom;
inline constexpr bool has_pair_atom = false;
using best_bf16_scaled_atom = scalar_dot2_scaled_bf16<best_f32_atom::mr, best_f32_atom::nr>;  // unused: no pair staging
using best_rows_dot_bf16_atom = scalar_rows_dot2_bf16<6, 64>;                                 // unused: needs the instruction
#endif

// Runs Atom::with_rows<rows> (1 <= rows <= Atom::mr): the same atom for a partial row panel,
// so edge rows cost what they compute (M = 1 runs a 1-row kernel, not a padded MR-row one).
template <class Atom, int R = Atom::mr>
inline void run_rows(int rows, const ukernel_args& p) {
  if constexpr (R >= 1) {
    if (rows == R) return Atom::template with_rows<R>::run(p);
    return run_rows<Atom, R - 1>(rows, p);
  }
}

// Scalar reference matching an atom's arithmetic.
template <class Atom>
using reference_atom_for = std::conditional_t<Atom::k_pack == 2, scalar_dot2_bf16<Atom::mr, Atom::nr>, scalar_fma_f32<Atom::mr, Atom::nr>>;

}  // namespace tessel::arch
