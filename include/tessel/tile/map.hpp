// `map` (elementwise) and `reduce` (per row / per column) on tiles.
#pragma once

#include <cstddef>

#include <tessel/tile/fragment.hpp>

namespace tessel {
inline namespace v0 {

// dst(r,c) = f(src(r,c)); src and dst may be the same tile.
template <tile_like Src, tile_like Dst, class F>
void map(const Src& src, Dst& dst, F f) {
  static_assert(Src::tile_rows == Dst::tile_rows && Src::tile_cols == Dst::tile_cols, "tessel::map: tiles must have the same (R, C)");
  for (std::size_t r = 0; r < Src::tile_rows; ++r)
    for (std::size_t c = 0; c < Src::tile_cols; ++c) dst(r, c) = f(src(r, c));
}
template <tile_like T, class F>
void map(T& t, F f) {
  map(t, t, f);
}

// out[r] = op(... op(init, t(r,0)), t(r,1)) ...) in column order.
template <tile_like T, class Out, class Op>
void reduce_rows(const T& t, Out& out, Op op, typename T::value_type init) {
  for (std::size_t r = 0; r < T::tile_rows; ++r) {
    auto acc = init;
    for (std::size_t c = 0; c < T::tile_cols; ++c) acc = op(acc, t(r, c));
    out[r] = acc;
  }
}
// out[c] = op over rows, in row order.
template <tile_like T, class Out, class Op>
void reduce_cols(const T& t, Out& out, Op op, typename T::value_type init) {
  for (std::size_t c = 0; c < T::tile_cols; ++c) out[c] = init;
  for (std::size_t r = 0; r < T::tile_rows; ++r)
    for (std::size_t c = 0; c < T::tile_cols; ++c) out[c] = op(out[c], t(r, c));
}

}  // namespace v0
}  // namespace tessel
