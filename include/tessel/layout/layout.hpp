// Index algebra of tile storage: where element (r, c) of an (R, C) tile lives, as constexpr pure
// functions of layout tag types. Row/column-major, row panels of MR rows (packed A operands) and
// column panels of NR columns with K-pairs (packed B operands; KP = 2 is the VNNI layout vdpbf16ps
// reads). Panel layouts pad R/C up to whole panels (padding is zero-filled by `load`).
#pragma once

#include <concepts>
#include <cstddef>

namespace tessel::layout {

// Row-major (R, C): r * C + c.
struct row {
  static constexpr std::size_t size(std::size_t rows, std::size_t cols) { return rows * cols; }
  static constexpr std::size_t offset(std::size_t r, std::size_t c, std::size_t, std::size_t cols) { return r * cols + c; }
};

// Column-major (R, C): c * R + r.
struct col {
  static constexpr std::size_t size(std::size_t rows, std::size_t cols) { return rows * cols; }
  static constexpr std::size_t offset(std::size_t r, std::size_t c, std::size_t rows, std::size_t) { return c * rows + r; }
};

// Row panels: rows grouped by MR; inside a panel, K (columns) in groups of KP, each group holding
// MR rows x KP consecutive columns: [R/MR][C/KP][MR][KP]. The A operand of an (MR, NR) atom.
template <std::size_t MR, std::size_t KP = 1>
struct panel {
  static_assert(MR > 0 && KP > 0, "panel<MR, KP>: MR and KP must be positive");
  static constexpr std::size_t mr = MR, kp = KP;
  static constexpr std::size_t padded_rows(std::size_t rows) { return (rows + MR - 1) / MR * MR; }
  static constexpr std::size_t padded_cols(std::size_t cols) { return (cols + KP - 1) / KP * KP; }
  static constexpr std::size_t size(std::size_t rows, std::size_t cols) { return padded_rows(rows) * padded_cols(cols); }
  static constexpr std::size_t offset(std::size_t r, std::size_t c, std::size_t, std::size_t cols) {
    return (r / MR) * (MR * padded_cols(cols)) + (c / KP) * (MR * KP) + (r % MR) * KP + c % KP;
  }
};

// Column panels: columns grouped by NR; inside a panel, K (rows) in groups of KP:
// [C/NR][R/KP][NR][KP]. The B operand of an (MR, NR) atom.
template <std::size_t NR, std::size_t KP = 1>
struct col_panel {
  static_assert(NR > 0 && KP > 0, "col_panel<NR, KP>: NR and KP must be positive");
  static constexpr std::size_t nr = NR, kp = KP;
  static constexpr std::size_t padded_rows(std::size_t rows) { return (rows + KP - 1) / KP * KP; }
  static constexpr std::size_t padded_cols(std::size_t cols) { return (cols + NR - 1) / NR * NR; }
  static constexpr std::size_t size(std::size_t rows, std::size_t cols) { return padded_rows(rows) * padded_cols(cols); }
  static constexpr std::size_t offset(std::size_t r, std::size_t c, std::size_t rows, std::size_t) {
    return (c / NR) * (NR * padded_rows(rows)) + (r / KP) * (NR * KP) + (c % NR) * KP + r % KP;
  }
};

// B operand in K-pairs for bf16 pair-dot atoms (VNNI style).
template <std::size_t NR>
using vnni2 = col_panel<NR, 2>;

// XOR swizzle of 16-byte chunks within a row (bank-conflict avoidance on GPUs; kept for API parity,
// and testable as a bijection).
template <std::size_t Bits>
constexpr std::size_t swizzle(std::size_t row, std::size_t chunk) {
  return chunk ^ (row & ((std::size_t{1} << Bits) - 1));
}

// A layout: maps (r, c) of a (rows, cols) tile to an offset within size(rows, cols).
template <class L>
concept tile_layout = requires(std::size_t n) {
  { L::size(n, n) } -> std::convertible_to<std::size_t>;
  { L::offset(n, n, n, n) } -> std::convertible_to<std::size_t>;
};

template <class L>
inline constexpr bool is_panel = false;
template <std::size_t MR, std::size_t KP>
inline constexpr bool is_panel<panel<MR, KP>> = true;
template <class L>
inline constexpr bool is_col_panel = false;
template <std::size_t NR, std::size_t KP>
inline constexpr bool is_col_panel<col_panel<NR, KP>> = true;

}  // namespace tessel::layout
