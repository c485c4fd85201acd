// Global tensor views: a pointer plus shape and strides (row- or column-major or any strides),
// const or mutable, with checked construction and `.tile<R, C>(i, j)` sub-views that know how
// much of the (R, C) tile is inside the tensor (edge tiles are partial; `load` zero-fills them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <tessel/tile/errors.hpp>
#include <tessel/detail/checked.hpp>

namespace tessel {
inline namespace v0 {

enum class order : std::uint8_t { row_major, col_major };

}  // namespace v0
namespace detail {
// Built with append: GCC 12 -O3 reports a false -Wrestrict for `"(" + std::to_string(r)`.
inline std::string shape_str(std::size_t r, std::size_t c) {
  std::string s("(");
  s.append(std::to_string(r)).append(",").append(std::to_string(c)).append(")");
  return s;
}
// Number of elements a (rows, cols) view with these strides spans: (rows-1)*rs + (cols-1)*cs + 1.
inline std::size_t span_of(std::size_t rows, std::size_t cols, std::size_t rs, std::size_t cs) {
  if (rows == 0 || cols == 0) return 0;
  return add_checked(add_checked(mul_checked(rows - 1, rs, "tensor extent"), mul_checked(cols - 1, cs, "tensor extent"), "tensor extent"), 1,
                     "tensor extent");
}
}  // namespace detail
inline namespace v0 {

// A part of a tensor covering the (R, C) tile at (row0, col0); `rows`/`cols` are how much of it is
// inside the tensor (R/C for interior tiles, less at the bottom/right edges).
template <class T, std::size_t R, std::size_t C>
struct tensor_tile {
  using value_type = std::remove_const_t<T>;
  using element_type = T;
  static constexpr std::size_t tile_rows = R, tile_cols = C;
  T* data = nullptr;
  std::size_t rows = 0, cols = 0;  // valid extent
  std::size_t row_stride = 0, col_stride = 0;
  std::size_t row0 = 0, col0 = 0;  // position of element (0,0) in the whole tensor
  T& operator()(std::size_t r, std::size_t c) const { return data[r * row_stride + c * col_stride]; }
  bool full() const { return rows == R && cols == C; }
};

// 2-D view. Rank is fixed at 2 (batched operators take a batch stride separately).
template <class T, std::size_t Rank = 2>
class tensor;

template <class T>
class tensor<T, 2> {
 public:
  using value_type = std::remove_const_t<T>;
  using element_type = T;

  tensor() = default;

  // Unchecked-extent view over caller memory: validates null data and leading dimension.
  // row_major: element (r,c) at r*ld + c (ld >= cols); col_major: at c*ld + r (ld >= rows).
  tensor(T* data, std::size_t rows, std::size_t cols, std::size_t ld, order o = order::row_major) : data_(data), rows_(rows), cols_(cols) {
    const std::size_t need = o == order::row_major ? cols : rows;
    if (ld < need || ld == 0)
      throw tile_error(errc::invalid_argument, "leading dimension " + std::to_string(ld) + " too small for a " +
                                                   (o == order::row_major ? "row-major " : "column-major ") + detail::shape_str(rows, cols) +
                                                   " tensor (needs >= " + std::to_string(need == 0 ? 1 : need) + ")");
    rs_ = o == order::row_major ? ld : 1;
    cs_ = o == order::row_major ? 1 : ld;
    check_null();
    (void)detail::span_of(rows, cols, rs_, cs_);  // overflow check
  }
  // Dense view (ld = cols or rows).
  tensor(T* data, std::size_t rows, std::size_t cols, order o = order::row_major)
      : tensor(data, rows, cols, o == order::row_major ? (cols ? cols : 1) : (rows ? rows : 1), o) {}
  // Checked view over a span: throws std::out_of_range if the view would read beyond it.
  tensor(std::span<T> storage, std::size_t rows, std::size_t cols, std::size_t ld, order o = order::row_major)
      : tensor(storage.data(), rows, cols, ld, o) {
    const std::size_t need = detail::span_of(rows_, cols_, rs_, cs_);
    if (need > storage.size())
      throw tile_error(errc::out_of_range, "a " + detail::shape_str(rows, cols) + " tensor with leading dimension " + std::to_string(ld) + " needs " +
                                               std::to_string(need) + " elements but its storage has " + std::to_string(storage.size()));
  }
  tensor(std::span<T> storage, std::size_t rows, std::size_t cols, order o = order::row_major)
      : tensor(storage, rows, cols, o == order::row_major ? (cols ? cols : 1) : (rows ? rows : 1), o) {}

  // Any strides (elements).
  static tensor strided(T* data, std::size_t rows, std::size_t cols, std::size_t row_stride, std::size_t col_stride) {
    tensor t;
    t.data_ = data;
    t.rows_ = rows;
    t.cols_ = cols;
    t.rs_ = row_stride;
    t.cs_ = col_stride;
    t.check_null();
    (void)detail::span_of(rows, cols, row_stride, col_stride);
    return t;
  }

  // mutable -> const
  operator tensor<const T, 2>() const requires(!std::is_const_v<T>) { return tensor<const T, 2>::strided(data_, rows_, cols_, rs_, cs_); }

  T* data() const { return data_; }
  std::size_t rows() const { return rows_; }
  std::size_t cols() const { return cols_; }
  std::size_t row_stride() const { return rs_; }
  std::size_t col_stride() const { return cs_; }
  bool empty() const { return rows_ == 0 || cols_ == 0; }
  bool is_row_major() const { return cs_ == 1; }
  bool is_col_major() const { return rs_ == 1 && cs_ != 1; }

  T& operator()(std::size_t r, std::size_t c) const { return data_[r * rs_ + c * cs_]; }
  T& at(std::size_t r, std::size_t c) const {
    if (r >= rows_ || c >= cols_)
      throw tile_error(errc::out_of_range, "index " + detail::shape_str(r, c) + " outside a " + detail::shape_str(rows_, cols_) + " tensor");
    return (*this)(r, c);
  }

  tensor transposed() const { return strided(data_, cols_, rows_, cs_, rs_); }

  // Sub-view of nr x nc elements at (r0, c0); must lie inside.
  tensor sub(std::size_t r0, std::size_t c0, std::size_t nr, std::size_t nc) const {
    if (r0 > rows_ || c0 > cols_ || nr > rows_ - r0 || nc > cols_ - c0)
      throw tile_error(errc::out_of_range, "sub-view " + detail::shape_str(nr, nc) + " at " + detail::shape_str(r0, c0) + " outside a " +
                                               detail::shape_str(rows_, cols_) + " tensor");
    return strided((nr && nc) ? data_ + r0 * rs_ + c0 * cs_ : data_, nr, nc, rs_, cs_);
  }

  // The (R, C) tile number (i, j): elements [i*R, i*R+R) x [j*C, j*C+C), clipped to the tensor.
  template <std::size_t R, std::size_t C>
  tensor_tile<T, R, C> tile(std::size_t i, std::size_t j) const {
    static_assert(R > 0 && C > 0, "tile<R, C>: tile extents must be positive");
    const std::size_t r0 = detail::mul_checked(i, R, "tile row"), c0 = detail::mul_checked(j, C, "tile column");
    if (r0 >= rows_ || c0 >= cols_)
      throw tile_error(errc::out_of_range, "tile " + detail::shape_str(i, j) + " of shape " + detail::shape_str(R, C) + " starts outside a " +
                                               detail::shape_str(rows_, cols_) + " tensor");
    tensor_tile<T, R, C> t;
    t.data = data_ + r0 * rs_ + c0 * cs_;
    t.rows = rows_ - r0 < R ? rows_ - r0 : R;
    t.cols = cols_ - c0 < C ? cols_ - c0 : C;
    t.row_stride = rs_;
    t.col_stride = cs_;
    t.row0 = r0;
    t.col0 = c0;
    return t;
  }
  // Tile at an element offset (r0, c0) rather than a tile index.
  template <std::size_t R, std::size_t C>
  tensor_tile<T, R, C> tile_at(std::size_t r0, std::size_t c0) const {
    if (r0 >= rows_ || c0 >= cols_)
      throw tile_error(errc::out_of_range,
                       "tile at " + detail::shape_str(r0, c0) + " starts outside a " + detail::shape_str(rows_, cols_) + " tensor");
    tensor_tile<T, R, C> t;
    t.data = data_ + r0 * rs_ + c0 * cs_;
    t.rows = rows_ - r0 < R ? rows_ - r0 : R;
    t.cols = cols_ - c0 < C ? cols_ - c0 : C;
    t.row_stride = rs_;
    t.col_stride = cs_;
    t.row0 = r0;
    t.col0 = c0;
    return t;
  }

 private:
  void check_null() const {
    if (data_ == nullptr && rows_ != 0 && cols_ != 0)
      throw tile_error(errc::invalid_argument, "null data for a non-empty " + detail::shape_str(rows_, cols_) + " tensor");
  }
  T* data_ = nullptr;
  std::size_t rows_ = 0, cols_ = 0, rs_ = 1, cs_ = 1;
};

template <class T>
tensor(T*, std::size_t, std::size_t, std::size_t, order) -> tensor<T, 2>;

}  // namespace v0
}  // namespace tessel
