// Grouped GEMM: a list of independent products of different shapes (a mixture of experts' expert
// GEMMs, each over the rows routed to it) run as one launch. The blocks of every product go into
// one grid, largest first, so the workers share them out as they finish: no product waits for
// the one before it, and a product too small to keep the workers busy alone no longer leaves them
// idle.
//
// Each product runs GEMM's packed program for its shape (the skinny one up to
// gemm_config::skinny_max_m rows), with the blocking that depends on its own shape only: its bits
// never depend on the thread count, on the device, or on the other products of the group. They
// are the bits of `gemm` on the same operands wherever `gemm` takes that packed path (products
// above the direct path's size whose K is not split); `gemm`'s direct, skinny-dot and split-K
// paths exist to find parallelism or to skip packing in a product alone, which a group does not
// need, so a grouped product takes none of them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/ops/gemm.hpp>

namespace tessel {
inline namespace v0 {

// One product of a group: C(M,N) = alpha·op(A)·op(B) + beta·C, with gemm's operands and rules
// (row-major; op(A) is (M,K): A stored (M,K) with lda >= K, or (K,M) with lda >= M transposed),
// and gemm's scales (per-tensor, or DeepSeek-V3 block scales of this product's A and B: the
// products of a group have block scales all or none).
template <gemm_input TA, gemm_input TB, gemm_output TC>
struct gemm_problem {
  transpose ta = transpose::none, tb = transpose::none;
  std::size_t M = 0, N = 0, K = 0;
  float alpha = 1.0f;
  const TA* A = nullptr;
  std::size_t lda = 0;
  const TB* B = nullptr;
  std::size_t ldb = 0;
  float beta = 0.0f;
  TC* C = nullptr;
  std::size_t ldc = 0;
  gemm_scales scales{};
};

// The problem C = alpha·A·B + beta·C of tensor views (a view may be transposed: unit column
// stride is row-major storage, unit row stride the transpose of a row-major matrix; C must be
// row-major). Throws gemm_error for mismatched shapes or a view neither layout describes.
template <gemm_input TA, gemm_input TB, gemm_output TC>
gemm_problem<TA, TB, TC> gemm_problem_of(tensor<const TA, 2> A, tensor<const TB, 2> B, tensor<TC, 2> C, float alpha = 1.0f, float beta = 0.0f) {
  const auto shape = [&] { return detail::gemm_shape(C.rows(), C.cols(), A.cols()); };
  detail::gemm_check(A.rows() == C.rows() && B.cols() == C.cols() && A.cols() == B.rows(), [&] { return "mismatched shapes " + shape(); });
  detail::gemm_check(C.col_stride() == 1, [&] { return "C must be row-major (column stride 1), " + shape(); });
  // (stride along the rows, stride along the columns) -> (transpose, leading dimension)
  auto stored = [&](const char* name, std::size_t rs, std::size_t cs) {
    if (cs == 1) return std::pair{transpose::none, rs};
    detail::gemm_check(rs == 1, [&] { return std::string(name) + " has neither unit row nor unit column stride, " + shape(); });
    return std::pair{transpose::yes, cs};
  };
  const auto [ta, lda] = stored("A", A.row_stride(), A.col_stride());
  const auto [tb, ldb] = stored("B", B.row_stride(), B.col_stride());
  return {ta, tb, C.rows(), C.cols(), A.cols(), alpha, A.data(), lda, B.data(), ldb, beta, C.data(), std::max<std::size_t>(C.row_stride(), 1)};
}

}  // namespace v0

namespace detail {

template <class TA, class TB, class TC, class Chain, bool Scaled>
struct gemm_grouped_program {
  using wide_program = gemm_program<TA, TB, TC, Chain, Scaled, false>;
  // block-scaled products all run wide (as in gemm): no skinny scaled program is instantiated
  using skinny_program = std::conditional_t<Scaled, wide_program, gemm_program<TA, TB, TC, Chain, false, true>>;
  struct block {
    std::size_t program;  // index into wide (skinny = false) or skinny
    bool skinny;
    std::size_t mb, nb;
  };
  struct tables {
    std::vector<wide_program> wide;
    std::vector<skinny_program> skinny;
    std::vector<block> blocks;  // one per block of the launch, in launch order
    double flops = 0, bytes = 0;
  };
  std::shared_ptr<const tables> t;  // shared: the launch copies the program, not its tables

  std::string shape() const {
    return "grouped x " + std::to_string(t->wide.size() + t->skinny.size()) + " (" + std::to_string(t->blocks.size()) + " blocks)";
  }
  kernel_cost cost(const grid&) const {
    kernel_cost c;
    c.flops = t->flops;
    c.bytes = t->bytes;
    c.precision = std::is_same_v<TA, float>
                      ? math_precision::f32
                      : (std::is_same_v<TA, bf16> ? math_precision::bf16 : (std::is_same_v<TA, fp16> ? math_precision::fp16 : math_precision::fp8));
    return c;
  }
  void operator()(block_ctx& ctx) const {
    const block& b = t->blocks[ctx.block_linear()];
    if (b.skinny)
      t->skinny[b.program].run_block(ctx, b.mb, b.nb, 0);
    else
      t->wide[b.program].run_block(ctx, b.mb, b.nb, 0);
  }
};

// Packs the transposed A of every product that gemm would pack once (gemm_pack_a_once), as one
// launch: block b packs tile tiles[b] = (product's packer, slab, chunk).
template <class TA, class Cfg>
struct gemm_grouped_pack_a_program {
  struct tile {
    std::size_t packer, slab, chunk;
  };
  struct tables {
    std::vector<gemm_pack_a_program<TA, Cfg>> packers;
    std::vector<tile> tiles;
    double bytes = 0;
  };
  std::shared_ptr<const tables> t;
  kernel_cost cost(const grid&) const { return {0.0, t->bytes, math_precision::f32}; }
  void operator()(block_ctx& ctx) const {
    const tile& x = t->tiles[ctx.block_linear()];
    t->packers[x.packer].pack(x.slab, x.chunk);
  }
};

// gemm_grouped's body for a group with (Scaled) or without block scales; the problems are checked
// by gemm_grouped except for their operands, checked here.
template <bool Scaled, class Dev, class TA, class TB, class TC, class Chain>
void gemm_grouped_run(Dev& dev, std::span<const gemm_problem<TA, TB, TC>> problems, const Chain& chain) {
  using chain_t = Chain;
  using P = gemm_grouped_program<TA, TB, TC, chain_t, Scaled>;
  using wide_cfg = gemm_config<TA, TB, false>;
  using skinny_cfg = gemm_config<TA, TB, true>;
  auto t = std::make_shared<typename P::tables>();
  struct sized {
    double work;
    typename P::block b;
  };
  std::vector<sized> order;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    const auto& q = problems[i];
    const auto shape = [&] {
      return "grouped product " + std::to_string(i) + " of " + std::to_string(problems.size()) + ", " + gemm_shape(q.M, q.N, q.K);
    };
    gemm_check_operand("A", q.A, q.ta, q.M, q.K, q.lda, shape);
    gemm_check_operand("B", q.B, q.tb, q.K, q.N, q.ldb, shape);
    gemm_check_operand("C", q.C, transpose::none, q.M, q.N, q.ldc, shape);
    if (q.M == 0 || q.N == 0) continue;
    (void)mul_checked(q.M, q.N, "gemm_grouped size");
    (void)mul_checked(q.M, q.K, "gemm_grouped size");
    (void)mul_checked(q.K, q.N, "gemm_grouped size");
    const auto A = op_view(q.A, q.ta, q.M, q.K, q.lda);
    const auto B = op_view(q.B, q.tb, q.K, q.N, q.ldb);
    const auto C = tensor<TC, 2>::strided(q.C, q.M, q.N, q.ldc, 1);
    const bool skinny = !Scaled && q.M <= wide_cfg::skinny_max_m;  // block-scaled products run wide, as in gemm
    // rows per block as gemm's packed path picks them for one worker: a function of the shape only
    const std::size_t nbw = skinny ? skinny_cfg::NB : wide_cfg::NB;
    const std::size_t MB = skinny ? gemm_block_rows<skinny_cfg>(q.M, gemm_row_blocks<skinny_cfg>(q.M, false))
                                  : gemm_block_rows<wide_cfg>(q.M, gemm_row_blocks<wide_cfg>(q.M, !Scaled));
    std::size_t index = 0;
    if (skinny) {
      index = t->skinny.size();
      t->skinny.push_back(
          typename P::skinny_program{q.M, q.N, q.K, 1, A, B, C, 0, 0, 0, nullptr, nullptr, nullptr, q.alpha, q.beta, q.scales, MB, chain});
    } else {
      index = t->wide.size();
      t->wide.push_back(
          typename P::wide_program{q.M, q.N, q.K, 1, A, B, C, 0, 0, 0, nullptr, nullptr, nullptr, q.alpha, q.beta, q.scales, MB, chain});
    }
    const double flops = 2.0 * double(q.M) * double(q.N) * double(q.K);
    t->flops += flops;
    t->bytes += double(q.M) * double(q.K) * sizeof(TA) + double(q.K) * double(q.N) * sizeof(TB) +
                double(q.M) * double(q.N) * sizeof(TC) * (q.beta != 0 ? 2 : 1);
    for (std::size_t nb = 0; nb < ceil_div(q.N, nbw); ++nb)
      for (std::size_t mb = 0; mb < ceil_div(q.M, MB); ++mb) {
        const double rows = double(std::min(MB, q.M - mb * MB)), cols = double(std::min(nbw, q.N - nb * nbw));
        // a block's time: its multiply-adds plus packing its B strip and writing its C tile
        order.push_back({rows * cols * double(std::max<std::size_t>(q.K, 1)) + cols * double(q.K) + rows * cols, {index, skinny, mb, nb}});
      }
  }
  if (order.empty()) return;
  // transposed A's that gemm would pack once for all column blocks are packed once here too, all
  // in one launch before the products' (a pure copy: the bits are the per-block packing's)
  using packer = gemm_pack_a_program<TA, wide_cfg>;
  using S = typename wide_cfg::stage;
  auto pk = std::make_shared<typename gemm_grouped_pack_a_program<TA, wide_cfg>::tables>();
  std::vector<std::pair<std::size_t, std::size_t>> packed;  // (wide program, offset in S elements)
  std::size_t ws = 0;
  for (std::size_t w = 0; w < t->wide.size(); ++w) {
    const auto& p = t->wide[w];
    if (Scaled || !gemm_pack_a_once<TA, TB>(p.A, p.N, 1)) continue;  // as gemm (the products share the workers, so 1): scaled chunks pack their own
    const std::size_t slabs = ceil_div(p.M, wide_cfg::MC), chunks = ceil_div(p.K, wide_cfg::KC);
    packed.emplace_back(w, ws);
    ws = add_checked(ws, mul_checked(mul_checked(slabs, chunks, "gemm_grouped workspace"), wide_cfg::MC * wide_cfg::KC, "gemm_grouped workspace"),
                     "gemm_grouped workspace");
    pk->packers.push_back(packer{p.A, nullptr, chunks});
    pk->bytes += double(p.M) * double(p.K) * double(sizeof(TA) + sizeof(S));
    for (std::size_t s = 0; s < slabs; ++s)
      for (std::size_t c = 0; c < chunks; ++c) pk->tiles.push_back({pk->packers.size() - 1, s, c});
  }
  S* W = nullptr;
  device_workspace<Dev> guard{dev, nullptr};  // returned after both launches ran
  if (ws > 0) {
    W = static_cast<S*>(dev.allocate(mul_checked(ws, sizeof(S), "gemm_grouped workspace")));
    guard.p = W;
    for (std::size_t i = 0; i < packed.size(); ++i) {
      pk->packers[i].out = W + packed[i].second;
      t->wide[packed[i].first].a_packed = W + packed[i].second;
      t->wide[packed[i].first].a_chunks = pk->packers[i].chunks;
    }
    const double bytes = pk->bytes;
    const std::size_t tiles = pk->tiles.size();
    gemm_run(dev, grid{tiles}, gemm_grouped_pack_a_program<TA, wide_cfg>{std::move(pk)}, bytes / 4);
  }
  // largest first (ties in problem and block order): the last blocks to start are the short ones,
  // so the workers finish together. The order never changes a block's arithmetic.
  std::stable_sort(order.begin(), order.end(), [](const sized& a, const sized& b) { return a.work > b.work; });
  t->blocks.reserve(order.size());
  for (const auto& s : order) t->blocks.push_back(s.b);
  // a group that writes a large C in all streams it, as gemm streams one large product
  double out_bytes = 0;
  for (const auto& q : problems) out_bytes += double(q.M) * double(q.N) * sizeof(TC);
  if (out_bytes >= double(P::wide_program::stream_min_bytes)) {
    for (auto& w : t->wide) w.stream_large = true;
    for (auto& w : t->skinny) w.stream_large = true;
  }
  const double flops = t->flops;
  const std::size_t nblocks = t->blocks.size();
  gemm_run(dev, grid{nblocks}, P{std::move(t)}, flops);
}  // (guard: the workspace goes back to the pool after both launches ran)

}  // namespace detail

inline namespace v0 {

// Runs every product of `problems` in one launch, each followed by the epilogue chain `ep` (its
// row and column indices are the product's own). Products with M, N = 0 are skipped; K = 0 gives
// beta·C. Throws gemm_error naming the product for a bad operand, like gemm.
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm_grouped(Dev& dev, std::span<const gemm_problem<TA, TB, TC>> problems, const Chain& ep = {}) {
  using namespace tessel::detail;
  const auto chain = epilogue::detail::as_chain<Chain>::make(ep);
  // block scales: every product that computes something has both, or none has any
  std::size_t scaled = 0, computing = 0;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    const auto& q = problems[i];
    gemm_check(!(q.scales.a_block == nullptr) == !(q.scales.b_block == nullptr), [&] {
      return "block scales need both a_block and b_block, grouped product " + std::to_string(i) + " of " + std::to_string(problems.size()) + ", " +
             gemm_shape(q.M, q.N, q.K);
    });
    if (q.M == 0 || q.N == 0) continue;
    ++computing;
    if (q.scales.a_block) ++scaled;
  }
  gemm_check(scaled == 0 || scaled == computing, [&] {
    return "block scales on " + std::to_string(scaled) + " of the " + std::to_string(computing) + " products of a group: all or none";
  });
  if (scaled > 0)
    detail::gemm_grouped_run<true>(dev, problems, chain);
  else
    detail::gemm_grouped_run<false>(dev, problems, chain);
}

// The same with the products in a vector or array.
template <class Dev, gemm_input TA, gemm_input TB, gemm_output TC, class Chain = epilogue::chain<>>
void gemm_grouped(Dev& dev, const std::vector<gemm_problem<TA, TB, TC>>& problems, const Chain& ep = {}) {
  gemm_grouped(dev, std::span<const gemm_problem<TA, TB, TC>>(problems), ep);
}

}  // namespace v0
}  // namespace tessel
