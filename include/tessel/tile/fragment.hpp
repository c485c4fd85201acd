// Tile types. `fragment<T, R, C>`: a small row-major tile held by the program (registers/stack).
// `staged<T, R, C, Layout>`: a tile in the worker's scratch arena with a layout type (row, col,
// packed panel, VNNI pairs) — what `load` packs into and `mma` reads. Concepts name what each
// primitive accepts, so a wrong combination fails to compile with a readable message.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <type_traits>

#include <tessel/layout/layout.hpp>
#include <tessel/tile/block_ctx.hpp>

namespace tessel {
inline namespace v0 {

template <class T, std::size_t R, std::size_t C>
struct alignas(64) fragment {
  static_assert(R > 0 && C > 0, "fragment<T, R, C>: extents must be positive");
  using value_type = T;
  using layout_type = layout::row;
  static constexpr std::size_t tile_rows = R, tile_cols = C, ld = C;
  std::array<T, R * C> v{};
  T* data() { return v.data(); }
  const T* data() const { return v.data(); }
  T& operator()(std::size_t r, std::size_t c) { return v[r * C + c]; }
  const T& operator()(std::size_t r, std::size_t c) const { return v[r * C + c]; }
  void fill(T x) { v.fill(x); }
};

template <class T, std::size_t R, std::size_t C, layout::tile_layout L = layout::row>
class staged {
 public:
  static_assert(R > 0 && C > 0, "staged<T, R, C, L>: extents must be positive");
  using value_type = T;
  using layout_type = L;
  static constexpr std::size_t tile_rows = R, tile_cols = C;
  static constexpr std::size_t elements = L::size(R, C);
  static constexpr std::size_t ld = std::is_same_v<L, layout::row> ? C : (std::is_same_v<L, layout::col> ? R : 0);

  // Takes its storage from the block's scratch arena (valid until the block returns).
  explicit staged(block_ctx& ctx) : data_(ctx.scratch().template allocate_array<T>(elements, 64)) {}
  // Over caller-provided storage of at least `elements`.
  explicit staged(T* storage) : data_(storage) {}

  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator()(std::size_t r, std::size_t c) { return data_[L::offset(r, c, R, C)]; }
  const T& operator()(std::size_t r, std::size_t c) const { return data_[L::offset(r, c, R, C)]; }
  void fill(T x) { std::fill_n(data_, elements, x); }

 private:
  T* data_;
};

// Per-dtype aliases (ThunderKittens style): rt_f<16,64> is a float register tile.
template <std::size_t R, std::size_t C>
using rt_f = fragment<float, R, C>;

// ---- concepts ----
template <class X>
concept tile_like = requires(X& x) {
  typename X::value_type;
  { X::tile_rows } -> std::convertible_to<std::size_t>;
  { X::tile_cols } -> std::convertible_to<std::size_t>;
  x(std::size_t{}, std::size_t{});
};
// A tile stored row-major with a compile-time leading dimension (accumulators, epilogue sources).
template <class X>
concept row_major_tile = tile_like<X> && std::is_same_v<typename X::layout_type, layout::row> && requires(X& x) {
  {x.data()};
};
template <class X>
concept f32_accumulator = row_major_tile<X> && std::is_same_v<typename X::value_type, float>;

}  // namespace v0
}  // namespace tessel
