// Packing of token blocks into the B-operand panels of the attention atoms (col_panel<NR, KP>):
//  "T-form": X(n, D) stored as Xᵀ (D rows, n cols) - B of a product that contracts over D (Q·Kᵀ);
//  "N-form": X(n, D) stored as X  (n rows, D cols) - B of a product that contracts over tokens (P·V).
// Tokens past the end of the sequence and columns past D are zero, so edge blocks need no branches
// in the atoms. Users never include this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <tessel/arch/unpack.hpp>
#include <tessel/ops/detail/attention_common.hpp>

namespace tessel::detail::attn {

// T-form of rows(j) for j < n (n <= NB), D even (multiple of KP): out has D/KP groups per panel:
// out[(j/NR)*NR*D + (d/KP)*NR*KP + (j%NR)*KP + d%KP] = X(j, d); NB a multiple of NR.
template <class E, std::size_t NR, std::size_t KP, class T, class RowFn>
inline void pack_t(RowFn row, std::size_t n, std::size_t NB, std::size_t D, E* out) {
  const E zero{};
  for (std::size_t p = 0; p < NB; p += NR) {
    E* panel = out + p * D;
    std::size_t done = 0;  // rows of this panel already packed
    if constexpr (KP == 1 && std::is_same_v<T, float> && std::is_same_v<E, float> && NR % 16 == 0) {
      // f32: 16 rows evenly spaced (every caller's rows are) by 16 columns at a time as one 16x16
      // transpose, instead of one store per element a panel row (NR floats) apart
      for (; done + 16 <= NR && p + done + 16 <= n && D >= 16; done += 16) {
        const float* r0 = row(p + done);
        const std::ptrdiff_t ld = row(p + done + 1) - r0;
        if (ld <= 0 || row(p + done + 15) != r0 + 15 * ld) break;
        std::size_t d = 0;
        for (; d + 16 <= D; d += 16) arch::transpose16_b32(r0 + d, std::size_t(ld) * sizeof(float), panel + d * NR + done, NR * sizeof(float));
        for (; d < D; ++d)
          for (std::size_t r = 0; r < 16; ++r) panel[d * NR + done + r] = r0[std::size_t(ld) * r + d];
      }
    }
    for (std::size_t jj = done; jj < NR; ++jj) {
      const std::size_t j = p + jj;
      if (j < n) {
        const T* x = row(j);
        if constexpr (KP == 2 && std::is_same_v<T, bf16> && std::is_same_v<E, std::uint16_t>) {
          // one 32-bit pair per (d-pair, j): a transpose of 32-bit words
          for (std::size_t dp = 0; dp < D / 2; ++dp) std::memcpy(panel + dp * NR * 2 + jj * 2, x + 2 * dp, 4);
        } else {
          for (std::size_t d = 0; d < D; ++d) panel[(d / KP) * NR * KP + jj * KP + d % KP] = to_stage<E>(x[d]);
        }
      } else {
        for (std::size_t d = 0; d < D; ++d) panel[(d / KP) * NR * KP + jj * KP + d % KP] = zero;
      }
    }
  }
}

// N-form of rows(j): panels over d of NR columns (Dp = D rounded up to NR), NB rows each:
// out[(d/NR)*NR*NB + (j/KP)*NR*KP + (d%NR)*KP + j%KP] = X(j, d).
template <class E, std::size_t NR, std::size_t KP, class T, class RowFn>
inline void pack_n(RowFn row, std::size_t n, std::size_t NB, std::size_t D, E* out) {
  const std::size_t Dp = round_up(D, NR);
  const E zero{};
  for (std::size_t c0 = 0; c0 < Dp; c0 += NR) {
    E* panel = out + c0 * NB;
    const std::size_t nc = c0 < D ? std::min(NR, D - c0) : 0;
    for (std::size_t j = 0; j < NB; j += KP) {
      E* dst = panel + j * NR;
      if constexpr (KP == 2 && std::is_same_v<T, bf16> && std::is_same_v<E, std::uint16_t>) {
        if (j + 1 < n && nc == NR) {
          arch::interleave_u16(reinterpret_cast<const std::uint16_t*>(row(j) + c0), reinterpret_cast<const std::uint16_t*>(row(j + 1) + c0), dst, NR);
          continue;
        }
      }
      for (std::size_t q = 0; q < KP; ++q) {
        const std::size_t jr = j + q;
        const T* x = jr < n ? row(jr) : nullptr;
        for (std::size_t c = 0; c < NR; ++c) dst[c * KP + q] = (x && c < nc) ? to_stage<E>(x[c0 + c]) : zero;
      }
    }
  }
}

}  // namespace tessel::detail::attn
