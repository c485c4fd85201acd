// `mma(a, b, acc)`: acc(BM,BN) += a(BM,BK) · b(BK,BN) with the best atom for the operand types
// and target (AVX-512 FMA, AVX512-BF16 vdpbf16ps, AVX2 FMA, scalar). Operands are staged in the
// atom's panel layouts, which `mma_traits<T>` names; a row-major A may also be read in place.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <tessel/tile/errors.hpp>
#include <tessel/arch/gemm_atoms.hpp>
#include <tessel/tile/fragment.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

// How operands of element type In are staged for mma: the stage element type, the atom, and the
// layouts of A and B. f32/fp16 run on the f32 FMA atom; bf16/e4m3/e5m2 on the bf16 pair atom
// where the CPU has one (FP8 widens to bf16 exactly), else widen to f32.
template <class In>
struct mma_traits {
  static_assert(std::is_same_v<In, float> || std::is_same_v<In, fp16> || std::is_same_v<In, bf16> || std::is_same_v<In, e4m3> ||
                    std::is_same_v<In, e5m2>,
                "tessel::mma_traits: supported operand types are float, fp16, bf16, e4m3, e5m2");
  static constexpr bool pair = arch::has_pair_atom && !std::is_same_v<In, float> && !std::is_same_v<In, fp16>;
  using stage_type = std::conditional_t<pair, bf16, float>;
  using atom = std::conditional_t<pair, arch::best_bf16_atom, arch::best_f32_atom>;
  static constexpr std::size_t mr = atom::mr, nr = atom::nr, k_pack = atom::k_pack;
  using a_layout = layout::panel<mr, k_pack>;
  using b_layout = layout::col_panel<nr, k_pack>;
};

// Options of one mma call.
struct mma_options {
  bool accumulate = true;            // acc += a·b (false: acc = a·b)
  const float* row_scale = nullptr;  // BM scales: acc(i,j) (+)= (a·b)(i,j) * row_scale[i] * col_scale[j]
  const float* col_scale = nullptr;  // BN scales (null = 1)
  std::size_t k = SIZE_MAX;          // depth actually used (<= BK; rest treated as zero)
  std::size_t n = SIZE_MAX;          // columns actually used (<= BN): only the atom panels holding
                                     // them are computed; accumulator columns past those are left as they are
};
// The name before the options structs were named <op>_options (issue 16); kept for existing code.
using mma_opts [[deprecated("use tessel::mma_options")]] = mma_options;

}  // namespace v0
namespace detail {
template <class T>
struct atom_for_stage;
template <>
struct atom_for_stage<float> {
  using type = arch::best_f32_atom;
};
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <>
struct atom_for_stage<bf16> {
  using type = arch::best_bf16_atom;
};
#endif
template <class TA, class TB>
concept same_stage = std::is_same_v<TA, TB>;
}  // namespace detail
inline namespace v0 {

// Staged A (panel<MR,KP>) × staged B (col_panel<NR,KP>) → f32 accumulator tile.
template <class T, std::size_t BM, std::size_t BK, std::size_t BN, std::size_t MR, std::size_t NR, std::size_t KP, f32_accumulator Acc>
void mma(const staged<T, BM, BK, layout::panel<MR, KP>>& a, const staged<T, BK, BN, layout::col_panel<NR, KP>>& b, Acc& acc,
         const mma_options& o = {}) {
  using atom = typename detail::atom_for_stage<T>::type;
  static_assert(atom::mr == MR && atom::nr == NR && atom::k_pack == KP,
                "tessel::mma: staged layouts must be mma_traits<T>::a_layout / b_layout (the atom's panel shapes)");
  static_assert(Acc::tile_rows == BM && Acc::tile_cols == BN, "tessel::mma: accumulator must be (BM, BN)");
  static_assert(BM % MR == 0 && BN % NR == 0, "tessel::mma: BM and BN must be multiples of the atom's MR and NR");
  const std::size_t kd = o.k < BK ? o.k : BK;
  const std::size_t steps = (kd + KP - 1) / KP;
  constexpr std::size_t PK = layout::panel<MR, KP>::padded_cols(BK);
  constexpr std::size_t ldc = Acc::tile_cols;
  const std::size_t panels = (std::min(o.n, BN) + NR - 1) / NR;
  const T* a_data = a.data();
  if constexpr (KP > 1) {
    if (kd % KP != 0) {
      // a depth inside a K-pack: the atom reads whole packs, and the staged tile may hold data past
      // kd, which must count as zero, so the panels run on a copy of A with it zeroed
      thread_local std::vector<T> buf;
      buf.assign(a.data(), a.data() + layout::panel<MR, KP>::size(BM, BK));
      for (std::size_t r = 0; r < BM; ++r)
        for (std::size_t c = kd; c < steps * KP; ++c) buf[layout::panel<MR, KP>::offset(r, c, BM, BK)] = T{};
      a_data = buf.data();
    }
  }
  for (std::size_t jp = 0; jp < panels; ++jp) {
    for (std::size_t ip = 0; ip < BM / MR; ++ip) {
      arch::ukernel_args p;
      p.k = steps;
      p.a = a_data + ip * MR * PK;
      p.b = b.data() + jp * NR * PK;
      p.c = acc.data() + ip * MR * ldc + jp * NR;
      p.ldc = ldc;
      p.accumulate = o.accumulate;
      p.row_scale = o.row_scale ? o.row_scale + ip * MR : nullptr;
      p.col_scale = o.col_scale ? o.col_scale + jp * NR : nullptr;
      atom::run(p);
    }
  }
}

// A read in place from a row-major global tile (no packing: the atom broadcasts straight from A's
// rows; a row-major bf16 row holds its K-pairs adjacently). Rows/columns beyond the tensor's edge
// are treated as zero. Other A tiles (transposed, other element types) are staged by the caller.
template <class TA, std::size_t BM, std::size_t BK, std::size_t BN, std::size_t NR, std::size_t KP, f32_accumulator Acc>
void mma(const tensor_tile<TA, BM, BK>& a, const staged<std::remove_const_t<TA>, BK, BN, layout::col_panel<NR, KP>>& b, Acc& acc,
         const mma_options& o = {}) {
  using T = std::remove_const_t<TA>;
  using atom = typename detail::atom_for_stage<T>::type;
  constexpr std::size_t MR = atom::mr;
  static_assert(atom::nr == NR && atom::k_pack == KP, "tessel::mma: staged B layout must be mma_traits<T>::b_layout");
  static_assert(Acc::tile_rows == BM && Acc::tile_cols == BN, "tessel::mma: accumulator must be (BM, BN)");
  static_assert(BN % NR == 0, "tessel::mma: BN must be a multiple of the atom's NR");
  if (a.col_stride != 1 && a.cols > 1) throw tile_error(errc::invalid_argument, "mma: in-place A must be row-major (stage it with load otherwise)");
  std::size_t kd = o.k < a.cols ? o.k : a.cols;
  const std::size_t steps = kd / KP, tail = kd % KP;  // an odd K tail (pairs) is handled through a padded copy
  constexpr std::size_t ldc = Acc::tile_cols;
  constexpr std::size_t PK = layout::col_panel<NR, KP>::padded_rows(BK);
  const std::size_t rows = a.rows;
  const std::size_t panels = (std::min(o.n, BN) + NR - 1) / NR;
  // an odd K (pairs) reads a copy of the tile's rows with the tail zero-padded to a whole pair,
  // made once for all panels
  const T* base = a.data;
  std::size_t rs = a.row_stride, ksteps = steps;
  thread_local std::vector<T> buf;
  if (tail != 0) {
    const std::size_t kp = (steps + 1) * KP;
    buf.assign(rows * kp, T{});
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t k = 0; k < kd; ++k) buf[i * kp + k] = a.data[i * a.row_stride + k];
    base = buf.data();
    rs = kp;
    ksteps = steps + 1;
  }
  for (std::size_t jp = 0; jp < panels; ++jp) {
    for (std::size_t ip = 0; ip * MR < rows; ++ip) {
      const std::size_t pr = rows - ip * MR < MR ? rows - ip * MR : MR;
      arch::ukernel_args p;
      p.b = b.data() + jp * NR * PK;
      p.c = acc.data() + ip * MR * ldc + jp * NR;
      p.ldc = ldc;
      p.accumulate = o.accumulate;
      p.row_scale = o.row_scale ? o.row_scale + ip * MR : nullptr;
      p.col_scale = o.col_scale ? o.col_scale + jp * NR : nullptr;
      p.k = ksteps;
      p.a = base + ip * MR * rs;
      p.a_rs = rs;
      arch::run_rows<atom>(static_cast<int>(pr), p);
    }
  }
}

// Small register tiles: c(M,N) += a(M,K) · b(K,N) in f32 (any element types convertible to float).
template <std::size_t M, std::size_t K, std::size_t N>
void mma(const fragment<float, M, K>& a, const fragment<float, K, N>& b, fragment<float, M, N>& c) {
  for (std::size_t i = 0; i < M; ++i)
    for (std::size_t k = 0; k < K; ++k) {
      const float x = a(i, k);
      for (std::size_t j = 0; j < N; ++j) c(i, j) = __builtin_fmaf(x, b(k, j), c(i, j));
    }
}

}  // namespace v0
}  // namespace tessel
