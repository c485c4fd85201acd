// Embedding lookup and its gradient as tile programs: out[t] (+)= table[ids[t]] and
// dtable[ids[t]] += dout[t]. The gradient is deterministic: blocks own column ranges of the table
// and add the tokens' rows in token order, so repeated ids sum in the same order on any thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/ops/errors.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
namespace detail::embed {

template <class W, class Out>
struct fwd_program {
  const std::int64_t* ids;
  tensor<const W, 2> table;
  tensor<Out, 2> out;
  std::size_t rpb, rows;
  bool accumulate;
  void operator()(block_ctx& ctx) const {
    using namespace tessel::detail::rows;
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb), n = out.cols();
    for (std::size_t r = r0; r < r1; ++r) {
      const W* src = &table(static_cast<std::size_t>(ids[r]), 0);
      Out* dst = &out(r, 0);
      for_lanes(n, [&](std::size_t j, auto v) {
        using V = decltype(v);
        V x = typed_load<W, V>(src, j);
        if (accumulate) x = x + typed_load<Out, V>(dst, j);
        typed_store<Out, V>(dst, j, x);
      });
    }
  }
};

template <class G>
struct bwd_program {
  const std::int64_t* ids;
  tensor<const G, 2> dout;
  tensor<float, 2> dtable;
  std::size_t cols_per_block, tokens;
  void operator()(block_ctx& ctx) const {
    using namespace tessel::detail::rows;
    const std::size_t c0 = ctx.block_linear() * cols_per_block, c1 = std::min(dtable.cols(), c0 + cols_per_block);
    for (std::size_t t = 0; t < tokens; ++t) {
      const G* src = &dout(t, c0);
      float* dst = &dtable(static_cast<std::size_t>(ids[t]), c0);
      for_lanes(c1 - c0, [&](std::size_t j, auto v) {
        using V = decltype(v);
        typed_store<float, V>(dst, j, typed_load<float, V>(dst, j) + typed_load<G, V>(src, j));
      });
    }
  }
};

inline void check_ids(std::span<const std::int64_t> ids, std::size_t vocab, const std::string& who) {
  for (std::size_t t = 0; t < ids.size(); ++t)
    if (ids[t] < 0 || static_cast<std::uint64_t>(ids[t]) >= vocab)
      throw layer_error(errc::out_of_range,
                        who + ": id " + std::to_string(ids[t]) + " of token " + std::to_string(t) + " is outside [0, " + std::to_string(vocab) + ")");
}

}  // namespace detail::embed

inline namespace v0 {

// out (tokens, dim) = table[ids] (accumulate: out += table[ids], e.g. GPT-2's position table).
// table and out are f32 or bf16; an id outside [0, rows of table) is a layer_error naming the token.
template <class Dev, class W, class Out>
void embedding_forward(Dev& dev, std::span<const std::int64_t> ids, tensor<const W, 2> table, tensor<Out, 2> out, bool accumulate = false) {
  using namespace detail::rows;
  static_assert(row_io_type<W> && row_io_type<Out>, "tessel::embedding_forward: f32 or bf16 tensors");
  check_rows<layer_error>(out, ids.size(), table.cols(), "embedding_forward: out");
  check_rows<layer_error>(table, table.rows(), table.cols(), "embedding_forward: table");
  detail::embed::check_ids(ids, table.rows(), "embedding_forward");
  if (ids.empty() || table.cols() == 0) return;
  const std::size_t rpb = rows_per_block(ids.size(), table.cols());
  dev.launch(grid{ceil_div(ids.size(), rpb)}, detail::embed::fwd_program<W, Out>{ids.data(), table, out, rpb, ids.size(), accumulate});
}

// dtable (vocab, dim, f32) += scatter of dout (tokens, dim) by ids, in token order (deterministic).
template <class Dev, class G>
void embedding_backward(Dev& dev, std::span<const std::int64_t> ids, tensor<const G, 2> dout, tensor<float, 2> dtable) {
  using namespace detail::rows;
  static_assert(row_io_type<G>, "tessel::embedding_backward: dout must be f32 or bf16");
  check_rows<layer_error>(dout, ids.size(), dtable.cols(), "embedding_backward: dout");
  check_rows<layer_error>(dtable, dtable.rows(), dtable.cols(), "embedding_backward: dtable");
  detail::embed::check_ids(ids, dtable.rows(), "embedding_backward");
  if (ids.empty() || dtable.cols() == 0) return;
  // Column blocks of at least 256 floats (1 KiB per token row), enough of them to share the work.
  const std::size_t cpb = std::max<std::size_t>(256, ceil_div(dtable.cols(), 16));
  dev.launch(grid{ceil_div(dtable.cols(), cpb)}, detail::embed::bwd_program<G>{ids.data(), dout, dtable, cpb, ids.size()});
}

}  // namespace v0
}  // namespace tessel
