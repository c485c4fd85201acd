// `store(acc, destination, epilogue)`: write an f32 accumulator tile to a global tile through an
// epilogue chain, row by row (each row is transformed in a small buffer while hot in cache), then
// converted to the destination type (saturating for narrow types). Only the part of the tile
// inside the tensor is written.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>

#include <tessel/arch/unpack.hpp>
#include <tessel/tile/epilogue.hpp>
#include <tessel/tile/fragment.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/convert.hpp>

namespace tessel {
inline namespace v0 {}  // namespace v0
namespace detail {
template <class T>
inline float read_as_f32(const void* p, std::size_t i) {
  return arch::to_f32(static_cast<const T*>(p)[i]);
}

template <class T>
inline constexpr bool storable_v =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16> || std::is_same_v<T, e4m3> || std::is_same_v<T, e5m2>;

// Converts n floats to T at dst (stride ds elements). Narrow types saturate.
template <class T>
inline void write_row(const float* v, std::size_t n, T* dst, std::size_t ds) {
  if constexpr (std::is_same_v<T, float>) {
    if (ds == 1)
      std::memcpy(dst, v, n * sizeof(float));
    else
      for (std::size_t j = 0; j < n; ++j) dst[j * ds] = v[j];
  } else {
    if (ds == 1) {
      convert(std::span<const float>(v, n), std::span<T>(dst, n), overflow::saturate);
    } else {
      T tmp[64];
      for (std::size_t j0 = 0; j0 < n; j0 += 64) {
        const std::size_t m = std::min<std::size_t>(64, n - j0);
        convert(std::span<const float>(v + j0, m), std::span<T>(tmp, m), overflow::saturate);
        for (std::size_t j = 0; j < m; ++j) dst[(j0 + j) * ds] = tmp[j];
      }
    }
  }
}

// The general row-wise store used by `store` and by operators that store micro-tiles directly.
// acc: nrows x ncols floats with leading dimension lda. dst: element (i,j) at dst[i*drs + j*dcs].
template <class T, class Chain>
void store_rows(const float* acc, std::size_t lda, std::size_t nrows, std::size_t ncols, T* dst, std::size_t drs, std::size_t dcs, std::size_t row0,
                std::size_t col0, const Chain& ep) {
  using cast_t = epilogue::cast_type_t<Chain>;
  static_assert(std::is_void_v<cast_t> || std::is_same_v<cast_t, T>,
                "tessel::store: the epilogue casts to a type different from the destination's element type");
  constexpr std::size_t chunk = 256;
  alignas(64) float buf[chunk];
  for (std::size_t i = 0; i < nrows; ++i) {
    for (std::size_t j0 = 0; j0 < ncols; j0 += chunk) {
      const std::size_t n = std::min(chunk, ncols - j0);
      T* d = dst + i * drs + j0 * dcs;
      if constexpr (Chain::empty) {
        write_row(acc + i * lda + j0, n, d, dcs);
      } else {
        std::memcpy(buf, acc + i * lda + j0, n * sizeof(float));
        epilogue::row_info ri;
        ri.row = row0 + i;
        ri.col0 = col0 + j0;
        ri.old = d;
        ri.old_stride = dcs;
        ri.old_at = &read_as_f32<T>;
        if constexpr (std::is_same_v<T, float>) ri.old_f32 = dcs == 1 ? d : nullptr;
        ep.apply(buf, n, ri);
        write_row(buf, n, d, dcs);
      }
    }
  }
}
}  // namespace detail
inline namespace v0 {

template <class T>
concept storable_element = detail::storable_v<T>;

// f32 accumulator (R, C) -> global tile of T, through the epilogue chain `ep`.
template <f32_accumulator Acc, storable_element T, std::size_t R, std::size_t C, class Chain = epilogue::chain<>>
void store(const Acc& acc, const tensor_tile<T, R, C>& dst, const Chain& ep = {}) {
  static_assert(Acc::tile_rows == R && Acc::tile_cols == C, "tessel::store: accumulator and destination tile have different (R, C)");
  const auto c = epilogue::detail::as_chain<Chain>::make(ep);
  detail::store_rows<T>(acc.data(), C, dst.rows, dst.cols, dst.data, dst.row_stride, dst.col_stride, dst.row0, dst.col0, c);
}

}  // namespace v0
}  // namespace tessel
