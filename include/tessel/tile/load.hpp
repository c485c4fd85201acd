// `load(source, destination)`: copy a global tile into a staged or fragment tile, converting the
// element type (bf16/fp16/e4m3/e5m2/f32 to f32 or bf16), optionally multiplying by a scale, and
// zero-filling whatever part of the tile lies outside the tensor (edge tiles) and layout padding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <tessel/arch/unpack.hpp>
#include <tessel/layout/layout.hpp>
#include <tessel/tile/fragment.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
inline namespace v0 {}  // namespace v0
namespace detail {
// Element types a tile can be loaded from.
template <class T>
inline constexpr bool loadable_v =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;
// Element types a staged/fragment tile can hold for compute.
template <class T>
inline constexpr bool stage_type_v = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

template <class D, class S>
inline D convert_elem(S x, float scale, bool scaled) {
  if constexpr (std::is_same_v<D, float>) {
    const float f = arch::to_f32(x);
    return scaled ? f * scale : f;
  } else {  // bf16
    if (!scaled) return bf16::from_bits(arch::to_bf16_bits(x));
    return bf16(arch::to_f32(x) * scale);
  }
}
template <class D>
inline D zero_elem() {
  if constexpr (std::is_same_v<D, float>)
    return 0.0f;
  else
    return D::from_bits(0);
}
}  // namespace detail
inline namespace v0 {

template <class S>
concept loadable_element = detail::loadable_v<std::remove_const_t<S>>;
template <class D>
concept stage_element = detail::stage_type_v<D>;

// The part of a staged (R, C) tile that a load writes: rows [0, rows) x columns [0, cols), rounded
// up to the layout's packing granule (col_panel: K pairs and whole NR-column panels; panel: whole
// MR-row panels and K groups) and capped at the tile. Inside it the tile holds the source where
// the tensor has it and zeros elsewhere; outside it the tile keeps what it held. A consumer that
// reads only this part (an mma of depth `rows` over `cols` columns) does not pay for zeroing a
// whole (KC, NB) tile when the tensor is small or shallow.
struct tile_extent {
  std::size_t rows = 0, cols = 0;
};

// Global tile -> the `used` part of a staged tile of the same (R, C), in any layout.
template <loadable_element S, std::size_t R, std::size_t C, stage_element D, class L>
void load(const tensor_tile<S, R, C>& src, staged<D, R, C, L>& dst, tile_extent used, float scale = 1.0f) {
  using SV = std::remove_const_t<S>;
  const bool scaled = scale != 1.0f;
  const std::size_t vr = src.rows, vc = src.cols;
  D* out = dst.data();
  const D zero = detail::zero_elem<D>();
  if constexpr (layout::is_col_panel<L>) {
    constexpr std::size_t NR = L::nr, KP = L::kp;
    constexpr std::size_t PR = L::padded_rows(R);
    // rows written (whole K groups) and panels written
    const std::size_t UR = used.rows < R ? L::padded_rows(used.rows) : PR;
    const std::size_t UP = (used.cols < C ? L::padded_cols(used.cols) : L::padded_cols(C)) / NR;
    if constexpr (KP == 1 && std::is_same_v<SV, D>) {
      // whole tile inside the tensor, unit column stride: fixed-size row copies (a variable-size
      // memcpy call per NR-wide piece cost more than the memory traffic), the source row a few
      // rows ahead requested meanwhile (rows are strided, so the prefetchers start late)
      constexpr std::size_t NP = L::padded_cols(C) / NR, ahead = 4;
      if (!scaled && src.col_stride == 1 && vr == R && vc == NP * NR && UR == PR && UP == NP) {
        for (std::size_t k = 0; k < R; ++k) {
          const SV* s = src.data + k * src.row_stride;
          if (k + ahead < R)
            for (std::size_t l = 0; l < vc * sizeof(D); l += 64) __builtin_prefetch(reinterpret_cast<const char*>(s + ahead * src.row_stride) + l);
          for (std::size_t p = 0; p < NP; ++p) std::memcpy(out + p * NR * PR + k * NR, s + p * NR, NR * sizeof(D));
        }
        for (std::size_t k = R; k < PR; ++k)
          for (std::size_t p = 0; p < NP; ++p) std::fill_n(out + p * NR * PR + k * NR, NR, zero);
        return;
      }
    }
    if constexpr (KP == 2 && std::is_same_v<SV, bf16> && std::is_same_v<D, bf16>) {
      // the same for bf16 K-pairs: two whole rows per step, interleaved per NR-wide piece
      constexpr std::size_t NP = L::padded_cols(C) / NR;
      constexpr std::size_t ahead = 8;
      if (!scaled && src.col_stride == 1 && vr == R && R % 2 == 0 && vc == NP * NR && UR == PR && UP == NP) {
        for (std::size_t k = 0; k < R; k += 2) {
          const SV* s = src.data + k * src.row_stride;
          if (k + ahead + 1 < R)
            for (std::size_t l = 0; l < vc * sizeof(D); l += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(s + ahead * src.row_stride) + l);
              __builtin_prefetch(reinterpret_cast<const char*>(s + (ahead + 1) * src.row_stride) + l);
            }
          for (std::size_t p = 0; p < NP; ++p)
            arch::interleave_u16(reinterpret_cast<const std::uint16_t*>(s + p * NR),
                                 reinterpret_cast<const std::uint16_t*>(s + src.row_stride + p * NR),
                                 reinterpret_cast<std::uint16_t*>(out + p * NR * PR + k * NR), NR, false);
        }
        return;
      }
    }
    if constexpr (std::is_same_v<SV, D> && (KP == 1 || KP == 2)) {
      // column-major source (a transposed B): per panel, 16 K rows at a time, so each column's
      // 16 values (K pairs for bf16) are one contiguous run read once, written across 16 rows of
      // the L1-resident panel. Element by element down the rows instead, each read touched a
      // new line ld apart (all in one L1 set for ld a multiple of 1 KiB): 16x512x1536 NT f32
      // spent ~20x the product's time packing B.
      if (!scaled && src.row_stride == 1 && src.col_stride != 1) {
        constexpr std::size_t KB = 16 * KP;
        for (std::size_t p = 0; p < UP; ++p) {
          D* panel = out + p * NR * PR;
          const std::size_t c0 = p * NR;
          const std::size_t nc = c0 < vc ? (vc - c0 < NR ? vc - c0 : NR) : 0;
          for (std::size_t k0 = 0; k0 < UR; k0 += KB) {
            const std::size_t kb = UR - k0 < KB ? UR - k0 : KB;
            const std::size_t kn = k0 < vr ? (vr - k0 < kb ? vr - k0 : kb) : 0;  // valid K rows here
            std::size_t j0 = 0;
            if constexpr (sizeof(D) * KP == 4 && NR % 16 == 0) {
              // 16 whole columns of 16 K units (f32 values or bf16 K-pairs): one 32-bit transpose
              if (kn == KB)
                for (; j0 + 16 <= nc; j0 += 16)
                  arch::transpose16_b32(src.data + k0 + (c0 + j0) * src.col_stride, src.col_stride * sizeof(SV), panel + k0 * NR + j0 * KP,
                                        NR * KP * sizeof(D));
            }
            for (std::size_t j = j0; j < NR; ++j) {
              D* o = panel + k0 * NR + j * KP;
              std::size_t kk = 0;
              if (j < nc && kn > 0) {
                const SV* s = src.data + k0 + (c0 + j) * src.col_stride;
                for (; kk < kn; ++kk) o[(kk - kk % KP) * NR + kk % KP] = s[kk];
              }
              for (; kk < kb; ++kk) o[(kk - kk % KP) * NR + kk % KP] = zero;
            }
          }
        }
        return;
      }
    }
    // rows outer, panels inner: the source is read row by row (long sequential bursts that the
    // prefetchers follow) while the writes land in the L1/L2-resident staged tile
    for (std::size_t k = 0; k < UR; k += KP) {
      for (std::size_t p = 0; p < UP; ++p) {
        D* panel = out + p * NR * PR;
        const std::size_t c0 = p * NR;
        const std::size_t nc = c0 < vc ? (vc - c0 < NR ? vc - c0 : NR) : 0;
        D* row = panel + k * NR;
        if constexpr (KP == 2 && std::is_same_v<D, bf16>) {
          // fast path: two full source rows into K-pairs (FP8 widened exactly on the way)
          if (!scaled && src.col_stride == 1 && k + 1 < vr && nc == NR) {
            const SV* s0 = src.data + k * src.row_stride + c0;
            if constexpr (std::is_same_v<SV, bf16>) {
              arch::interleave_u16(reinterpret_cast<const std::uint16_t*>(s0), reinterpret_cast<const std::uint16_t*>(s0 + src.row_stride),
                                   reinterpret_cast<std::uint16_t*>(row), NR);
            } else {
              alignas(64) bf16 w0[NR], w1[NR];
              arch::widen(s0, w0, NR);
              arch::widen(s0 + src.row_stride, w1, NR);
              __builtin_prefetch(s0 + 8 * NR);
              __builtin_prefetch(s0 + src.row_stride + 8 * NR);
              arch::interleave_u16(reinterpret_cast<const std::uint16_t*>(w0), reinterpret_cast<const std::uint16_t*>(w1),
                                   reinterpret_cast<std::uint16_t*>(row), NR, false);
            }
            continue;
          }
        }
        if constexpr (KP == 1 && !std::is_same_v<SV, D>) {
          if (!scaled && src.col_stride == 1 && k < vr && nc == NR) {
            arch::widen(src.data + k * src.row_stride + c0, row, NR);
            continue;
          }
        }
        for (std::size_t q = 0; q < KP; ++q) {
          const std::size_t r = k + q;
          if (r < vr && nc) {
            const SV* s = src.data + r * src.row_stride + c0 * src.col_stride;
            if (src.col_stride == 1) {
              if constexpr (KP == 1 && std::is_same_v<SV, D>) {
                if (!scaled) {
                  std::memcpy(row, s, nc * sizeof(D));
                } else
                  for (std::size_t j = 0; j < nc; ++j) row[j] = detail::convert_elem<D>(s[j], scale, true);
              } else {
                for (std::size_t j = 0; j < nc; ++j) row[j * KP + q] = detail::convert_elem<D>(s[j], scale, scaled);
              }
            } else {
              for (std::size_t j = 0; j < nc; ++j) row[j * KP + q] = detail::convert_elem<D>(s[j * src.col_stride], scale, scaled);
            }
            for (std::size_t j = nc; j < NR; ++j) row[j * KP + q] = zero;
          } else {
            for (std::size_t j = 0; j < NR; ++j) row[j * KP + q] = zero;
          }
        }
      }
    }
  } else if constexpr (layout::is_panel<L>) {
    constexpr std::size_t MR = L::mr, KP = L::kp;
    constexpr std::size_t PC = L::padded_cols(C);
    const std::size_t UC = used.cols < C ? L::padded_cols(used.cols) : PC;                        // K columns written
    const std::size_t UP = (used.rows < R ? L::padded_rows(used.rows) : L::padded_rows(R)) / MR;  // panels written
    if constexpr (KP == 2 && std::is_same_v<D, bf16>) {
      // column-major source (a transposed A): the K pair (k, k+1) of consecutive rows is two
      // contiguous runs of the source, widened (exactly) and interleaved a few panels at a time,
      // then copied to each panel. Element by element instead, every read was a column stride
      // away and the per-slab packing of a transposed bf16 A cost as much as its product.
      if (!scaled && src.row_stride == 1 && src.col_stride != 1) {
        constexpr std::size_t G = MR >= 64 ? 1 : 64 / MR;  // panels per run
        alignas(64) std::uint16_t w0[G * MR], w1[G * MR], tmp[2 * G * MR];
        const std::size_t cs = src.col_stride;
        for (std::size_t p0 = 0; p0 < UP; p0 += G) {
          const std::size_t np = UP - p0 < G ? UP - p0 : G, r0 = p0 * MR;
          const std::size_t nr = r0 < vr ? (vr - r0 < np * MR ? vr - r0 : np * MR) : 0;  // valid rows of the run
          for (std::size_t k = 0; k < UC; k += 2) {
            const bool has0 = k < vc && nr > 0, has1 = k + 1 < vc && nr > 0;
            if (has0) arch::widen(src.data + r0 + k * cs, reinterpret_cast<bf16*>(w0), nr);
            if (has1) arch::widen(src.data + r0 + (k + 1) * cs, reinterpret_cast<bf16*>(w1), nr);
            if (has0 && has1) {
              arch::interleave_u16(w0, w1, tmp, nr, false);
            } else {
              for (std::size_t i = 0; i < nr; ++i) {
                tmp[2 * i] = has0 ? w0[i] : std::uint16_t{0};
                tmp[2 * i + 1] = has1 ? w1[i] : std::uint16_t{0};
              }
            }
            for (std::size_t i = 2 * nr; i < 2 * np * MR; ++i) tmp[i] = 0;
            for (std::size_t q = 0; q < np; ++q)
              std::memcpy(reinterpret_cast<std::uint16_t*>(out + (p0 + q) * MR * PC + k * MR), tmp + q * MR * 2, MR * 2 * sizeof(D));
          }
        }
        return;
      }
    }
    if constexpr (KP == 1 && std::is_same_v<D, std::remove_const_t<SV>>) {
      // column-major source of the same type (a transposed f32 A): each K column's run of rows is
      // contiguous, so it is read once, in order, and dealt MR at a time to every panel. Panel by
      // panel instead, each panel re-read all KC columns (a column stride apart, MR elements each)
      // and the once-per-GEMM packing ran at a quarter of a copy's rate.
      if (!scaled && src.row_stride == 1 && src.col_stride != 1) {
        const std::size_t cs = src.col_stride, full = vr / MR < UP ? vr / MR : UP;  // panels with MR valid rows
        const std::size_t kv = vc < UC ? vc : UC;
        for (std::size_t k = 0; k < kv; ++k) {
          const D* s = src.data + k * cs;
          if (k + 8 < kv)  // the column 8 ahead: a column stride apart, beyond the hardware's stride prefetch
            for (std::size_t b = 0; b < vr * sizeof(D); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(s + 8 * cs) + b);
          D* o = out + k * MR;
          for (std::size_t p = 0; p < full; ++p) std::memcpy(o + p * MR * PC, s + p * MR, MR * sizeof(D));
          for (std::size_t p = full; p < UP; ++p) {
            const std::size_t r0 = p * MR, nr = r0 < vr ? (vr - r0 < MR ? vr - r0 : MR) : 0;
            for (std::size_t i = 0; i < MR; ++i) o[p * MR * PC + i] = i < nr ? s[r0 + i] : zero;
          }
        }
        for (std::size_t k = kv; k < UC; ++k)
          for (std::size_t p = 0; p < UP; ++p)
            for (std::size_t i = 0; i < MR; ++i) out[p * MR * PC + k * MR + i] = zero;
        return;
      }
    }
    for (std::size_t p = 0; p < UP; ++p) {
      D* panel = out + p * MR * PC;
      const std::size_t r0 = p * MR;
      const std::size_t nr = r0 < vr ? (vr - r0 < MR ? vr - r0 : MR) : 0;
      if (src.row_stride == 1 && KP == 1) {
        // column-major source: MR consecutive rows per K step
        for (std::size_t k = 0; k < UC; ++k) {
          D* o = panel + k * MR;
          if (k < vc && nr) {
            const SV* s = src.data + r0 + k * src.col_stride;
            for (std::size_t i = 0; i < nr; ++i) o[i] = detail::convert_elem<D>(s[i], scale, scaled);
            for (std::size_t i = nr; i < MR; ++i) o[i] = zero;
          } else {
            for (std::size_t i = 0; i < MR; ++i) o[i] = zero;
          }
        }
      } else {
        for (std::size_t i = 0; i < MR; ++i) {
          const std::size_t r = r0 + i;
          const SV* s = i < nr ? src.data + r * src.row_stride : nullptr;
          for (std::size_t k = 0; k < UC; ++k) {
            D* o = panel + (k / KP) * MR * KP + i * KP + k % KP;
            *o = (s && k < vc) ? detail::convert_elem<D>(s[k * src.col_stride], scale, scaled) : zero;
          }
        }
      }
    }
  } else if constexpr (std::is_same_v<L, layout::row>) {
    const std::size_t UR = used.rows < R ? used.rows : R, UC = used.cols < C ? used.cols : C;
    const std::size_t wr = vr < UR ? vr : UR, wc = vc < UC ? vc : UC;  // source rows/columns written
    if (src.row_stride == 1 && vc > 1) {
      // column-major source (a transposed operand): blocks of 16 rows, read down columns
      // (contiguous) and written across rows of the tile
      for (std::size_t r0 = 0; r0 < wr; r0 += 16) {
        const std::size_t nr = wr - r0 < 16 ? wr - r0 : 16;
        for (std::size_t c = 0; c < wc; ++c) {
          const SV* s = src.data + c * src.col_stride + r0;
          for (std::size_t i = 0; i < nr; ++i) out[(r0 + i) * C + c] = detail::convert_elem<D>(s[i], scale, scaled);
        }
      }
      for (std::size_t r = 0; r < UR; ++r)
        for (std::size_t c = (r < wr ? wc : 0); c < UC; ++c) out[r * C + c] = zero;
      return;
    }
    for (std::size_t r = 0; r < UR; ++r) {
      D* o = out + r * C;
      std::size_t c = 0;
      if (r < wr) {
        const SV* s = src.data + r * src.row_stride;
        if (src.col_stride == 1 && !scaled) {
          arch::widen(s, o, wc);
          c = wc;
        } else {
          for (; c < wc; ++c) o[c] = detail::convert_elem<D>(s[c * src.col_stride], scale, scaled);
        }
      }
      for (; c < UC; ++c) o[c] = zero;
    }
  } else {
    const std::size_t UR = used.rows < R ? used.rows : R, UC = used.cols < C ? used.cols : C;
    for (std::size_t r = 0; r < UR; ++r)
      for (std::size_t c = 0; c < UC; ++c) out[L::offset(r, c, R, C)] = (r < vr && c < vc) ? detail::convert_elem<D>(src(r, c), scale, scaled) : zero;
  }
}

// Global tile -> staged tile of the same (R, C), in any layout: the whole tile is written.
template <loadable_element S, std::size_t R, std::size_t C, stage_element D, class L>
void load(const tensor_tile<S, R, C>& src, staged<D, R, C, L>& dst, float scale = 1.0f) {
  load(src, dst, tile_extent{R, C}, scale);
}

// Global tile -> fragment (row-major).
template <loadable_element S, std::size_t R, std::size_t C, stage_element D>
void load(const tensor_tile<S, R, C>& src, fragment<D, R, C>& dst, float scale = 1.0f) {
  const bool scaled = scale != 1.0f;
  const D zero = detail::zero_elem<D>();
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) dst(r, c) = (r < src.rows && c < src.cols) ? detail::convert_elem<D>(src(r, c), scale, scaled) : zero;
}

// Mismatched shapes get a message instead of an overload-resolution wall.
template <class S, std::size_t R1, std::size_t C1, class Dst>
requires(Dst::tile_rows != R1 || Dst::tile_cols != C1) void load(const tensor_tile<S, R1, C1>&, Dst&, float = 1.0f) {
  static_assert(Dst::tile_rows == R1 && Dst::tile_cols == C1, "tessel::load: source tile and destination tile have different (R, C)");
}

// Hint the caches to fetch a tile that a later `load` will read (used by `pipelined` loops).
template <class S, std::size_t R, std::size_t C>
void prefetch(const tensor_tile<S, R, C>& src) {
  if (src.col_stride == 1) {
    for (std::size_t r = 0; r < src.rows; ++r)
      for (std::size_t c = 0; c < src.cols; c += 64 / sizeof(S)) __builtin_prefetch(src.data + r * src.row_stride + c);
  } else {
    for (std::size_t c = 0; c < src.cols; ++c) __builtin_prefetch(src.data + c * src.col_stride);
  }
}

}  // namespace v0
}  // namespace tessel
