// Internals shared by the attention programs: the per-sequence geometry every program reads
// (dense batches and varlen batches are both a list of sequences), the mask rule, the choice of
// atom and tile sizes, and element conversion into the atom's stage type. Users never include it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

// first: it includes the intrinsic headers with GCC 12's spurious -Wuninitialized silenced
#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/arch/gemm_atoms.hpp>
#include <tessel/arch/unpack.hpp>
#include <tessel/tile/mma.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel::detail::attn {

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr float ln2 = 0.6931471805599453f;

// One sequence of the batch: where its token 0 (head 0) lives in each tensor (elements), its
// lengths, and where its packed blocks start in the workspaces (in blocks).
struct seq_geom {
  std::size_t q_base = 0, k_base = 0, v_base = 0, o_base = 0, lse_base = 0;
  std::size_t sq = 0, skv = 0;
  std::size_t q_blk0 = 0, kv_blk0 = 0;  // first packed-block index of this sequence
  const std::int32_t* pages = nullptr;  // paged KV cache: this sequence's block table row
  std::size_t kv_lo = 0;                // decode: the first key of its first chunk (a multiple of the chunk)
};

// Strides (elements) shared by all sequences.
struct geom {
  std::size_t hq = 0, hkv = 0, d = 0, group = 1;
  std::size_t q_tok = 0, q_head = 0, k_tok = 0, k_head = 0, v_tok = 0, v_head = 0, o_tok = 0, o_head = 0;
  std::size_t lse_head = 0;
  std::size_t page = 0;         // paged KV: tokens per page (0 = contiguous)
  std::size_t page_stride = 0;  // elements between pages
  std::size_t ring = 0;         // paged KV: entries of a block-table ring (token j's page is entry (j / page) % ring); 0: no ring
};

// Which keys row i may attend to: [lo, hi). Causal and windows are offsets from the diagonal
// j = i + off, where off = skv - sq for bottom-right alignment and 0 for top-left.
struct mask_rule {
  bool causal = false, bottom_right = false;
  std::ptrdiff_t wl = -1, wr = -1;  // -1: unbounded
  void range(std::size_t i, std::size_t sq, std::size_t skv, std::size_t& lo, std::size_t& hi) const {
    const std::ptrdiff_t off = bottom_right ? static_cast<std::ptrdiff_t>(skv) - static_cast<std::ptrdiff_t>(sq) : 0;
    const std::ptrdiff_t diag = static_cast<std::ptrdiff_t>(i) + off;
    std::ptrdiff_t l = 0, h = static_cast<std::ptrdiff_t>(skv);
    if (wl >= 0) l = std::max<std::ptrdiff_t>(l, diag - wl);
    std::ptrdiff_t r = wr;
    if (causal) r = r < 0 ? 0 : std::min<std::ptrdiff_t>(r, 0);
    if (r >= 0) h = std::min<std::ptrdiff_t>(h, diag + r + 1);
    if (h <= l) {
      lo = hi = 0;
      return;
    }
    lo = static_cast<std::size_t>(l);
    hi = static_cast<std::size_t>(h);
  }
  bool any() const { return causal || wl >= 0 || wr >= 0; }
};

// The atom and stage element for inputs of type In (bf16/e4m3 use the bf16 pair atom where the CPU
// has one, else everything runs on the f32 atom).
template <class In>
struct stage_for {
  using atom = typename mma_traits<In>::atom;
  using elem = typename atom::a_type;  // float, or uint16_t bf16 codes
  static constexpr std::size_t MR = atom::mr, NR = atom::nr, KP = atom::k_pack;
};

template <class E, class T>
inline E to_stage(T x) {
  if constexpr (std::is_same_v<E, float>)
    return arch::to_f32(x);
  else
    return arch::to_bf16_bits(x);
}
template <class E>
inline E stage_from_f32(float x) {
  if constexpr (std::is_same_v<E, float>)
    return x;
  else
    return arch::softmax::f32_to_bf16_bits(x);
}

template <class T>
inline T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return T(x);
}

inline constexpr std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

// c(rows<=MR*k, ncols) (+)= a(rows, kdepth) · b, with a read in place (row stride a_rs elements,
// K-pairs adjacent), b packed as col_panel<NR, KP> with `b_rows` padded rows per panel, c row-major
// with ldc. Runs the atom over whole MR row panels (callers pad a with zero rows) and NR panels.
template <class Atom>
inline void mma_direct(const typename Atom::a_type* a, std::size_t a_rs, std::size_t rows, const typename Atom::b_type* b, std::size_t b_rows,
                       std::size_t ncols, std::size_t kdepth, float* c, std::size_t ldc, bool accumulate) {
  constexpr std::size_t MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  arch::ukernel_args p;
  p.k = kdepth / KP;
  p.ldc = ldc;
  p.accumulate = accumulate;
  p.a_rs = a_rs;
  for (std::size_t jp = 0; jp < ncols; jp += NR) {
    p.b = b + jp * b_rows;
    for (std::size_t ip = 0; ip < rows; ip += MR) {
      p.a = a + ip * a_rs;
      p.c = c + ip * ldc + jp;
      if (ip + MR <= rows)
        Atom::run(p);
      else
        arch::run_rows<Atom>(static_cast<int>(rows - ip), p);
    }
  }
}

// mma_direct where row panel r (rows [r*MR, r*MR+MR)) needs only the first `cols[r]` columns of c
// (when kdepth_from_cols is false: columns are cut to whole NR panels) or only the first `cols[r]`
// of the K depth (when true: rounded up to KP; the rest of a's row must be zero in effect, as for
// probabilities of masked keys). A causal diagonal block thus skips its fully masked micro-tiles.
// In the K-depth form with accumulate == false every row panel is written (zeros where it needs
// nothing); in the column form the skipped micro-tiles are left unwritten (their scores are masked
// and never read).
template <class Atom>
inline void mma_direct_panels(const typename Atom::a_type* a, std::size_t a_rs, std::size_t rows, const typename Atom::b_type* b, std::size_t b_rows,
                              std::size_t ncols, std::size_t kdepth, float* c, std::size_t ldc, bool accumulate, const std::size_t* cols,
                              bool kdepth_from_cols) {
  constexpr std::size_t MR = Atom::mr, NR = Atom::nr, KP = Atom::k_pack;
  arch::ukernel_args p;
  p.ldc = ldc;
  p.accumulate = accumulate;
  p.a_rs = a_rs;
  for (std::size_t jp = 0; jp < ncols; jp += NR) {
    p.b = b + jp * b_rows;
    for (std::size_t ip = 0, r = 0; ip < rows; ip += MR, ++r) {
      std::size_t kd = kdepth;
      if (kdepth_from_cols) {
        kd = std::min(kdepth, round_up(cols[r], KP));
        if (kd == 0 && accumulate) continue;
      } else if (jp >= cols[r]) {
        continue;
      }
      p.k = kd / KP;
      p.a = a + ip * a_rs;
      p.c = c + ip * ldc + jp;
      if (ip + MR <= rows)
        Atom::run(p);
      else
        arch::run_rows<Atom>(static_cast<int>(rows - ip), p);
    }
  }
}

}  // namespace tessel::detail::attn
