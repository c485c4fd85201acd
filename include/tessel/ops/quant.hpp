// Bulk dtype conversion as a streaming tile program: dst[i] = To(float(src[i]) * scale), rounded to
// nearest even (the numeric policy), for any pair of tessel's element types. The model layer uses it
// where an f32 stream meets a bf16 GEMM operand; the e4m3 attention backward uses it to dequantise.
// Unscaled float <-> narrow conversions run the numbers layer's vectorised bulk convert on each
// chunk; every other case converts element by element (the same bits either way).
// Block quantisation to e4m3 (DeepSeek-V3's recipe): each (block_rows x 128) block of a matrix gets
// its own scale, amax / 448, so the GEMM's block scales (gemm_scales) undo it in FP32.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/arch/unpack.hpp>
#include <tessel/detail/checked.hpp>
#include <tessel/ops/errors.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/convert.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
namespace detail::quant {

template <class To>
inline To from_f32(float x) {
  if constexpr (std::is_same_v<To, float>)
    return x;
  else
    return To(x);
}

// The largest |float(src[i]) * scale| of n elements as the bits of a non-negative float: an
// integer max over the magnitudes' bits (it vectorises, and Inf and NaN compare above every finite
// value, NaN above Inf).
template <class From>
std::uint32_t amax_bits(const From* src, std::size_t n, float scale) {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) m = std::max(m, std::bit_cast<std::uint32_t>(arch::to_f32(src[i]) * scale) & 0x7fffffffu);
  return m;
}

template <class From, class To>
struct convert_program {
  const From* src;
  To* dst;
  std::size_t n;
  float scale;
  std::uint32_t* amax_chunks;  // if set: each chunk's amax_bits
  static constexpr std::size_t chunk = std::size_t{1} << 16;
  void operator()(block_ctx& ctx) const {
    const std::size_t i0 = ctx.block_linear() * chunk, i1 = std::min(n, i0 + chunk);
    if (amax_chunks) amax_chunks[ctx.block_linear()] = amax_bits(src + i0, i1 - i0, scale);
    if (scale == 1.0f) {
      // The numbers layer's bulk conversions (Highway; bit-identical to the scalar ones) per chunk.
      if constexpr (std::is_same_v<From, float> && narrow_float<To>) {
        tessel::convert(std::span<const float>(src + i0, i1 - i0), std::span<To>(dst + i0, i1 - i0));
        return;
      } else if constexpr (narrow_float<From> && std::is_same_v<To, float>) {
        tessel::convert(std::span<const From>(src + i0, i1 - i0), std::span<float>(dst + i0, i1 - i0));
        return;
      }
    }
    for (std::size_t i = i0; i < i1; ++i) dst[i] = from_f32<To>(arch::to_f32(src[i]) * scale);
  }
};

// One grid block per strip of `strip` rows (whole scale blocks) of an (R, C) source; each
// (block_rows x 128) block: amax, scale = amax / 448 (1 for an all-zero block, so zeros stay zeros),
// dst = e4m3(clamp(x / scale, ±448)). The strip's amax goes to amax_strips[strip index] (NaN when
// the strip holds Inf or NaN). Each 128-element row segment is widened to f32 in registers' reach
// (contiguous rows through arch::widen), its amax taken as the largest magnitude's bits (an
// integer max, which vectorises and sees Inf/NaN as larger than every finite value), divided and
// clamped in a vector loop, and encoded by the numbers layer's bulk RNE conversion: the same bits
// as the element-by-element definition.
template <class T>
struct quantize_blocks_program {
  tensor<const T, 2> src;
  e4m3* dst;
  std::size_t ldd;
  float* scales;
  std::size_t lds;  // scales(i, j) at scales[i * lds + j], or at scales[j * lds + i] when transposed
  bool scales_transposed;
  std::size_t block_rows, strip;
  float* amax_strips;
  static constexpr std::size_t block_cols = 128;
  static constexpr float max_e4m3 = 448.0f;
  static constexpr std::uint32_t max_finite_bits = 0x7f7fffffu;

  // The bits of the largest |t[i]| of t[0, n): an integer max (vectorises; no NaN rules).
  template <std::size_t N>
  static std::uint32_t max_bits(const float* t, std::size_t n) {
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < (N ? N : n); ++i) m = std::max(m, std::bit_cast<std::uint32_t>(t[i]) & 0x7fffffffu);
    return m;
  }
  template <std::size_t N>
  static void divide_clamp(float* t, std::size_t n, float scale) {
    for (std::size_t i = 0; i < (N ? N : n); ++i) {
      const float q = t[i] / scale;
      t[i] = q < -max_e4m3 ? -max_e4m3 : (q > max_e4m3 ? max_e4m3 : q);
    }
  }
  // Row r's columns [c0, c0 + n) as f32 into t; returns the bits of the largest |t[i]|. A whole
  // segment runs loops of a constant 128 (vectorised at -O2 too).
  std::uint32_t load(std::size_t r, std::size_t c0, std::size_t n, float* t) const {
    if (src.col_stride() == 1 || n == 1)
      arch::widen(&src(r, c0), t, n);
    else
      for (std::size_t i = 0; i < n; ++i) t[i] = arch::to_f32(src(r, c0 + i));
    return n == block_cols ? max_bits<block_cols>(t, n) : max_bits<0>(t, n);
  }
  void store(std::size_t r, std::size_t c0, std::size_t n, float* t, float scale) const {
    if (n == block_cols)
      divide_clamp<block_cols>(t, n, scale);
    else
      divide_clamp<0>(t, n, scale);
    tessel::convert(std::span<const float>(t, n), std::span<e4m3>(dst + r * ldd + c0, n));
  }

  // A transposed source (row stride 1: its rows are the storage's columns) is read 16 rows at a
  // time, so each column's 16 elements are one contiguous load: tt[c * lanes + i] = src(r + i, c0 + c)
  // (as f32 bits) for i < h; bits[i] = the bits of row i's largest magnitude.
  static constexpr std::size_t lanes = 16;
  template <std::size_t H>
  static void load_lanes_of(const T* __restrict base, std::size_t cs, std::size_t h, std::size_t n, std::uint32_t* __restrict tt,
                            std::uint32_t* bits) {
    std::uint32_t m[lanes] = {};
    // f32 bits from the storage (bf16 through its raw 16 bits: the vectoriser sees no class loads)
    const auto bits_at = [&](std::size_t k) -> std::uint32_t {
      if constexpr (std::is_same_v<T, bf16>)
        return std::uint32_t(reinterpret_cast<const std::uint16_t*>(base)[k]) << 16;
      else
        return std::bit_cast<std::uint32_t>(arch::to_f32(base[k]));
    };
    for (std::size_t c = 0; c < n; ++c)
      for (std::size_t i = 0; i < (H ? H : h); ++i) {
        const std::uint32_t u = bits_at(c * cs + i);
        tt[c * lanes + i] = u;
        m[i] = std::max(m[i], u & 0x7fffffffu);
      }
    for (std::size_t i = 0; i < lanes; ++i) bits[i] = m[i];
  }
  void load_lanes(std::size_t r, std::size_t h, std::size_t c0, std::size_t n, std::uint32_t* tt, std::uint32_t* bits) const {
    if (h == lanes)
      load_lanes_of<lanes>(&src(r, c0), src.col_stride(), h, n, tt, bits);
    else
      load_lanes_of<0>(&src(r, c0), src.col_stride(), h, n, tt, bits);
  }
  // Row r + i of the lanes in tt, quantised with `scale`.
  void store_lane(std::size_t r, std::size_t i, std::size_t c0, std::size_t n, const std::uint32_t* tt, float* t, float scale) const {
    for (std::size_t c = 0; c < n; ++c) t[c] = std::bit_cast<float>(tt[c * lanes + i]);
    store(r + i, c0, n, t, scale);
  }
  void set_scale(std::size_t bi, std::size_t bj, float scale) const { scales[scales_transposed ? bj * lds + bi : bi * lds + bj] = scale; }
  static float scale_of(std::uint32_t bits) {
    const float am = std::bit_cast<float>(bits);
    return am > 0.0f ? am / max_e4m3 : 1.0f;
  }

  // Rows [r0, r1) of a transposed source; returns the bits of their largest magnitude.
  std::uint32_t run_transposed(std::size_t r0, std::size_t r1) const {
    const std::size_t C = src.cols();
    alignas(64) std::uint32_t tt[block_cols * lanes];  // f32 bits
    alignas(64) float t[block_cols];
    std::uint32_t bits[lanes], strip_bits = 0;
    for (std::size_t cb = 0; cb < C; cb += block_cols) {
      const std::size_t n = std::min(C - cb, block_cols), bj = cb / block_cols;
      if (block_rows == 1) {  // one scale per row: 16 rows per pass
        for (std::size_t r = r0; r < r1; r += lanes) {
          const std::size_t h = std::min(lanes, r1 - r);
          load_lanes(r, h, cb, n, tt, bits);
          for (std::size_t i = 0; i < h; ++i) {
            strip_bits = std::max(strip_bits, bits[i]);
            if (bits[i] > max_finite_bits) continue;  // Inf or NaN: reported by the caller
            store_lane(r, i, cb, n, tt, t, scale_of(bits[i]));
            set_scale(r + i, bj, scale_of(bits[i]));
          }
        }
        continue;
      }
      for (std::size_t rb = r0; rb < r1; rb += block_rows) {  // one scale per tile: its amax, then the rows again
        const std::size_t re = std::min(r1, rb + block_rows);
        std::uint32_t tile_bits = 0;
        for (std::size_t r = rb; r < re; r += lanes) {
          load_lanes(r, std::min(lanes, re - r), cb, n, tt, bits);
          for (std::size_t i = 0; i < lanes; ++i) tile_bits = std::max(tile_bits, bits[i]);
        }
        strip_bits = std::max(strip_bits, tile_bits);
        if (tile_bits > max_finite_bits) continue;
        const float scale = scale_of(tile_bits);
        for (std::size_t r = rb; r < re; r += lanes) {
          const std::size_t h = std::min(lanes, re - r);
          load_lanes(r, h, cb, n, tt, bits);
          for (std::size_t i = 0; i < h; ++i) store_lane(r, i, cb, n, tt, t, scale);
        }
        set_scale(rb / block_rows, bj, scale);
      }
    }
    return strip_bits;
  }

  // Rows [r0, r1) of any other source, one row segment at a time.
  std::uint32_t run_rows(std::size_t r0, std::size_t r1) const {
    const std::size_t C = src.cols();
    alignas(64) float t[block_cols];
    std::uint32_t strip_bits = 0;
    for (std::size_t rb = r0; rb < r1; rb += block_rows) {
      const std::size_t re = std::min(r1, rb + block_rows);
      for (std::size_t cb = 0; cb < C; cb += block_cols) {
        const std::size_t n = std::min(C - cb, block_cols);
        std::uint32_t bits = 0;
        for (std::size_t r = rb; r < re; ++r) bits = std::max(bits, load(r, cb, n, t));
        strip_bits = std::max(strip_bits, bits);
        if (bits > max_finite_bits) continue;  // Inf or NaN: reported by the caller
        const float scale = scale_of(bits);
        // One row: t still holds it. More: load each row again (a 128x128 tile is 64 KiB of f32).
        if (re - rb == 1)
          store(rb, cb, n, t, scale);
        else
          for (std::size_t r = rb; r < re; ++r) {
            (void)load(r, cb, n, t);
            store(r, cb, n, t, scale);
          }
        set_scale(rb / block_rows, cb / block_cols, scale);
      }
    }
    return strip_bits;
  }

  void operator()(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * strip, r1 = std::min(src.rows(), r0 + strip);
    const bool transposed = src.row_stride() == 1 && src.col_stride() != 1 && src.cols() > 1;
    const std::uint32_t bits = transposed ? run_transposed(r0, r1) : run_rows(r0, r1);
    amax_strips[ctx.block_linear()] = bits > max_finite_bits ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(bits);
  }
};

template <class To, class From, class Dev>
void convert_on(Dev& dev, const From* src, To* dst, std::size_t n, float scale, float* amax = nullptr) {
  if (amax) *amax = 0.0f;
  if (!n) return;
  const std::size_t chunks = ceil_div(n, convert_program<From, To>::chunk);
  std::vector<std::uint32_t> am(amax ? chunks : 0, 0);
  dev.launch(grid{chunks}, convert_program<From, To>{src, dst, n, scale, amax ? am.data() : nullptr});
  if (amax) {
    const std::uint32_t m = *std::max_element(am.begin(), am.end());
    *amax = m > 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : std::bit_cast<float>(m);
  }
}

}  // namespace detail::quant

inline namespace v0 {

// dst = To(src * scale) elementwise on `dev`. src and dst must have the same length and must not
// overlap unless they are the same storage of the same type. With `amax`: the largest
// |src * scale| is written there (NaN if any is NaN; 0 for no elements), read in the same pass,
// so a caller can tell whether the conversion overflowed To's range (nn's fp16 layers do).
template <class Dev, class From, class To>
void convert(Dev& dev, std::span<const From> src, std::span<To> dst, float scale = 1.0f, float* amax = nullptr) {
  if (src.size() != dst.size())
    throw layer_error(errc::invalid_argument,
                      "convert: source has " + std::to_string(src.size()) + " elements, destination " + std::to_string(dst.size()));
  if (!src.empty() && (!src.data() || !dst.data())) throw layer_error(errc::invalid_argument, "convert: null buffer");
  if constexpr (std::is_same_v<std::remove_const_t<From>, To>) {
    if (static_cast<const void*>(src.data()) == static_cast<const void*>(dst.data()) && scale == 1.0f && !amax) return;
  }
  detail::quant::convert_on<To>(dev, src.data(), dst.data(), src.size(), scale, amax);
}

// How quantize_e4m3 blocks a matrix and where it reports.
struct quantize_options {
  std::size_t block_rows = 1;      // 1: 1x128 blocks (activations, along K); 128: 128x128 tiles (weights)
  bool scales_transposed = false;  // write scale (i, j) at scales[j * ceil(R/block_rows) + i]
  float* amax = nullptr;           // if set: max |x| over the matrix
};

// dst (R, C) row-major e4m3 = src / its block's scale; scales (ceil(R/block_rows), ceil(C/128))
// row-major (or transposed) hold scale = amax / 448 of each block (1 for an all-zero block).
// `src` may be any strided view (a transposed one included): a GEMM operand is quantised in the
// layout the GEMM reads, so the scales are already in gemm_scales' order: 1x128 blocks of a (M, K)
// A give a_block; 128x128 tiles of a (K, N) B give b_block. Inf or NaN in src is an error (its
// block's scale would poison every product with it); dst is then unspecified.
template <class Dev, class T>
void quantize_e4m3(Dev& dev, tensor<const T, 2> src, tensor<e4m3, 2> dst, std::span<float> scales, const quantize_options& o = {}) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16>, "quantize_e4m3: source must be f32, bf16 or fp16");
  const std::size_t R = src.rows(), C = src.cols();
  const auto shape = [&] { return " (source " + std::to_string(R) + "x" + std::to_string(C) + ")"; };
  if (o.block_rows != 1 && o.block_rows != 128)
    throw layer_error(errc::invalid_argument, "quantize_e4m3: block_rows must be 1 or 128, not " + std::to_string(o.block_rows));
  if (dst.rows() != R || dst.cols() != C) throw layer_error(errc::invalid_argument, "quantize_e4m3: destination shape differs" + shape());
  if (C > 1 && dst.col_stride() != 1) throw layer_error(errc::invalid_argument, "quantize_e4m3: destination must be row-major" + shape());
  const std::size_t bi = ceil_div(R, o.block_rows), bj = ceil_div(C, std::size_t{128});
  if (scales.size() != detail::mul_checked(bi, bj, "quantize_e4m3 scales"))
    throw layer_error(errc::invalid_argument, "quantize_e4m3: " + std::to_string(scales.size()) + " scales for " + std::to_string(bi) + "x" +
                                                  std::to_string(bj) + " blocks" + shape());
  if (o.amax) *o.amax = 0.0f;
  if (R == 0 || C == 0) return;
  if (!src.data() || !dst.data() || !scales.data()) throw layer_error(errc::invalid_argument, "quantize_e4m3: null buffer" + shape());
  // Strips of whole blocks, about 64K elements each (at least one block row).
  const std::size_t rows_per = std::max<std::size_t>(1, (std::size_t{1} << 16) / C);
  const std::size_t strip = std::max(o.block_rows, rows_per / o.block_rows * o.block_rows);
  const std::size_t strips = ceil_div(R, strip);
  std::vector<float> am(strips, 0.0f);
  dev.launch(grid{strips},
             detail::quant::quantize_blocks_program<T>{src, dst.data(), R > 1 ? dst.row_stride() : C, scales.data(), o.scales_transposed ? bi : bj,
                                                       o.scales_transposed, o.block_rows, strip, am.data()});
  float m = 0.0f;
  for (float a : am) {
    if (std::isnan(a)) throw layer_error(errc::invalid_argument, "quantize_e4m3: the source holds Inf or NaN" + shape());
    m = std::max(m, a);
  }
  if (o.amax) *o.amax = m;
}

}  // namespace v0
}  // namespace tessel
