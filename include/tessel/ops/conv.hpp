// conv2d as an implicit GEMM tile program: the output pixels are the rows of a GEMM, the output
// channels its columns and (kernel row, kernel column, input channel) its depth. The A tiles are
// loaded with im2col addressing straight from the image (no im2col buffer), multiplied with GEMM's
// own atoms, and stored through GEMM's epilogue chains (bias, activation, residual add), so
// Conv+BN(folded)+ReLU(+residual) is one kernel. The data and weight gradients are the same
// program with other operand loaders. NCHW forwards (f32, or bf16 where the bf16 pair-dot atoms
// run) with rows of 32+ output pixels at stride 1 or 2 run the same product transposed (output
// channels as rows, pixels as columns: see "the channel-rows orientation"), where an im2col row
// is a copy of an image row. Images are NCHW or
// NHWC, filters OIHW, f32 or bf16 inputs with f32 accumulation. Each output element is one chain
// in a K order and depth chunking fixed by the shape, so the bits never depend on the thread
// count, the device or the orientation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <tessel/arch/unpack.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/errors.hpp>

namespace tessel {
inline namespace v0 {

enum class conv_layout : std::uint8_t { nchw, nhwc };

// Geometry of a convolution. Padding may be asymmetric (ONNX pads: top/left and bottom/right).
struct conv2d_params {
  std::size_t stride_h = 1, stride_w = 1;
  std::size_t pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0;
  std::size_t dilation_h = 1, dilation_w = 1;
  std::size_t groups = 1;
  conv_layout layout = conv_layout::nchw;
};

// Logical image dimensions (N, C, H, W), whatever the memory layout (conv2d_params::layout).
struct image_dims {
  std::size_t n = 0, c = 0, h = 0, w = 0;
  std::size_t size() const {
    return detail::mul_checked(detail::mul_checked(detail::mul_checked(n, c, "image size"), h, "image size"), w, "image size");
  }
  friend bool operator==(const image_dims&, const image_dims&) = default;
};
// A dense image: NCHW or NHWC as the operation's params say.
template <class T>
struct image {
  T* data = nullptr;
  image_dims dims;
  operator image<const T>() const requires(!std::is_const_v<T>) { return {data, dims}; }
};
// Filter dimensions (O, I/groups, KH, KW); filters are OIHW.
struct filter_dims {
  std::size_t out = 0, in = 0, kh = 0, kw = 0;
  std::size_t size() const {
    return detail::mul_checked(detail::mul_checked(detail::mul_checked(out, in, "filter size"), kh, "filter size"), kw, "filter size");
  }
  friend bool operator==(const filter_dims&, const filter_dims&) = default;
};
template <class T>
struct filter {
  T* data = nullptr;
  filter_dims dims;
  operator filter<const T>() const requires(!std::is_const_v<T>) { return {data, dims}; }
};

template <class T>
concept conv_element = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

// The residual of a conv output in the image's own layout, as an epilogue op: the GEMM row is
// the output pixel (n, oh, ow) and the column the output channel, which NCHW does not store with
// one stride (epilogue::residual's 2-D view is enough for NHWC: (N·OH·OW, C) row-major).
template <class T>
struct conv_residual : epilogue::op_base {
  const T* r = nullptr;
  image_dims dims;
  conv_layout layout = conv_layout::nchw;
  conv_residual(image<const T> x, conv_layout l) : r(x.data), dims(x.dims), layout(l) {}
  void apply(float* v, std::size_t n, const epilogue::row_info& ri) const {
    const std::size_t plane = dims.h * dims.w;
    if (ri.row >= dims.n * plane || ri.col0 + n > dims.c)
      throw conv_error(errc::out_of_range, "conv_residual: a residual of " + std::to_string(dims.n) + "x" + std::to_string(dims.c) + "x" +
                                               std::to_string(dims.h) + "x" + std::to_string(dims.w) + " is smaller than the output");
    if (layout == conv_layout::nhwc) {
      const T* p = r + ri.row * dims.c + ri.col0;
      for (std::size_t j = 0; j < n; ++j) v[j] += arch::to_f32(p[j]);
    } else {
      const std::size_t img = ri.row / plane, q = ri.row % plane;
      const T* p = r + (img * dims.c + ri.col0) * plane + q;
      for (std::size_t j = 0; j < n; ++j) v[j] += arch::to_f32(p[j * plane]);
    }
  }
};

}  // namespace v0

namespace detail {

template <class Message>
void conv_check(bool ok, const Message& message) {
  if (!ok) [[unlikely]]
    throw conv_error(message());
}

inline std::string dims_str(const image_dims& d) {
  return std::to_string(d.n) + "x" + std::to_string(d.c) + "x" + std::to_string(d.h) + "x" + std::to_string(d.w);
}
inline std::string dims_str(const filter_dims& d) {
  return std::to_string(d.out) + "x" + std::to_string(d.in) + "x" + std::to_string(d.kh) + "x" + std::to_string(d.kw);
}

// The checked geometry of one convolution.
struct conv_geom {
  std::size_t n, c, h, w, k, kh, kw, oh, ow, groups, cg, kg;
  std::size_t sh, sw, pt, pl, dh, dw;
  conv_layout layout;
  std::size_t pixels() const { return n * oh * ow; }  // GEMM rows of the forward
  std::size_t depth() const { return cg * kh * kw; }  // GEMM depth of the forward
  image_dims out() const { return {n, k, oh, ow}; }
  image_dims in() const { return {n, c, h, w}; }
  filter_dims fil() const { return {k, cg, kh, kw}; }
};

// Output extent of one axis: (in + pads − dilation·(kernel − 1) − 1) / stride + 1, checked.
inline std::size_t conv_out_extent(const char* axis, std::size_t in, std::size_t pa, std::size_t pb, std::size_t k, std::size_t dil, std::size_t st) {
  const std::size_t padded = add_checked(add_checked(in, pa, "conv padded extent"), pb, "conv padded extent");
  const std::size_t span = add_checked(mul_checked(k - 1, dil, "conv kernel extent"), 1, "conv kernel extent");
  conv_check(padded >= span, [&] {
    return std::string("kernel ") + axis + " extent " + std::to_string(span) + " (kernel " + std::to_string(k) + ", dilation " + std::to_string(dil) +
           ") exceeds the padded input " + axis + " " + std::to_string(padded);
  });
  return (padded - span) / st + 1;
}

inline conv_geom conv_geometry(const image_dims& x, const filter_dims& f, const conv2d_params& p) {
  conv_check(p.layout == conv_layout::nchw || p.layout == conv_layout::nhwc, [] { return std::string("unknown layout"); });
  conv_check(p.stride_h >= 1 && p.stride_w >= 1,
             [&] { return "stride must be at least 1, got " + std::to_string(p.stride_h) + "x" + std::to_string(p.stride_w); });
  conv_check(p.dilation_h >= 1 && p.dilation_w >= 1,
             [&] { return "dilation must be at least 1, got " + std::to_string(p.dilation_h) + "x" + std::to_string(p.dilation_w); });
  conv_check(p.groups >= 1, [] { return std::string("groups must be at least 1"); });
  conv_check(f.kh >= 1 && f.kw >= 1, [&] { return "empty kernel " + dims_str(f); });
  conv_check(x.c >= 1 && f.out >= 1, [&] { return "no channels: input " + dims_str(x) + ", filter " + dims_str(f); });
  conv_check(x.c % p.groups == 0 && f.out % p.groups == 0, [&] {
    return "groups " + std::to_string(p.groups) + " must divide the input channels " + std::to_string(x.c) + " and the output channels " +
           std::to_string(f.out);
  });
  conv_check(f.in == x.c / p.groups, [&] {
    return "filter " + dims_str(f) + " (OIHW) needs I = C/groups = " + std::to_string(x.c / p.groups) + " for input " + dims_str(x) + " and groups " +
           std::to_string(p.groups);
  });
  (void)x.size();
  (void)f.size();
  conv_geom g{};
  g.n = x.n, g.c = x.c, g.h = x.h, g.w = x.w, g.k = f.out, g.kh = f.kh, g.kw = f.kw;
  g.groups = p.groups, g.cg = x.c / p.groups, g.kg = f.out / p.groups;
  g.sh = p.stride_h, g.sw = p.stride_w, g.pt = p.pad_top, g.pl = p.pad_left, g.dh = p.dilation_h, g.dw = p.dilation_w;
  g.layout = p.layout;
  g.oh = conv_out_extent("height", x.h, p.pad_top, p.pad_bottom, f.kh, p.dilation_h, p.stride_h);
  g.ow = conv_out_extent("width", x.w, p.pad_left, p.pad_right, f.kw, p.dilation_w, p.stride_w);
  (void)g.out().size();
  (void)mul_checked(mul_checked(g.pixels(), g.depth(), "conv implicit GEMM size"), g.groups, "conv implicit GEMM size");
  return g;
}

template <class T>
void conv_check_buffer(const char* name, const T* p, std::size_t elements) {
  conv_check(p != nullptr || elements == 0, [&] { return std::string("null ") + name + " with " + std::to_string(elements) + " elements"; });
}

// ---- operand loaders of the implicit GEMM ----
// Each writes a row-major (rows, cols) tile of the stage type S at dst (rows ld apart) for GEMM
// rows [r0, r0 + rows), columns [c0, c0 + cols) of group g, with zeros where the image has none.

// im2col addressing. Rows are the pixels (n, y, x) of a (rh, rw) grid; columns (r, s, ch) with ch
// fastest over cpg channels of group g (so an NHWC row is runs of contiguous channels). Forward
// (im2col): source pixel y·sh + r·dh − pt. Transposed (the data gradient gathers the output
// gradient): (y + pt − r·dh) / sh where that is a whole pixel of the source grid.
// d[0, len) = an input row's elements at columns [x, x + len), zeros (all-zero bits: f32 and bf16)
// where a column falls outside [0, W). D is S or an unsigned word of S's size (the gathers move
// bits); 4-byte runs are copied inline (a memcpy call of a short run cost as much as the copy).
template <class S, class D>
inline void conv_row_run(const S* row, std::size_t W, std::ptrdiff_t x, D* d, std::size_t len) {
  static_assert(sizeof(D) == sizeof(S), "conv_row_run: copies bits");
  const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(len), lo = std::min(n, std::max<std::ptrdiff_t>(0, -x)),
                       hi = std::max(lo, std::min(n, static_cast<std::ptrdiff_t>(W) - x));
  std::fill(d, d + lo, D{});
  if (hi > lo) {
    if constexpr (sizeof(D) == 4)
      arch::copy_words(reinterpret_cast<const D*>(row + (x + lo)), d + lo, static_cast<std::size_t>(hi - lo));
    else
      std::memcpy(d + lo, row + (x + lo), static_cast<std::size_t>(hi - lo) * sizeof(D));
  }
  std::fill(d + hi, d + n, D{});
}

// The same at a horizontal stride st >= 1: d[i] = row[x + i·st], zero where x + i·st falls
// outside [0, W) (stride 2 in vectors: ResNet's 7x7 stem).
template <class S, class D>
inline void conv_row_run(const S* row, std::size_t W, std::ptrdiff_t x, std::size_t st, D* d, std::size_t len) {
  static_assert(sizeof(D) == sizeof(S), "conv_row_run: copies bits");
  if (st == 1) return conv_row_run(row, W, x, d, len);
  const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(len), sp = static_cast<std::ptrdiff_t>(st), w = static_cast<std::ptrdiff_t>(W);
  const std::ptrdiff_t lo = std::min(n, x < 0 ? (-x + sp - 1) / sp : 0);                   // first i with x + i·st >= 0
  const std::ptrdiff_t hi = std::max(lo, std::min(n, x < w ? (w - x + sp - 1) / sp : 0));  // first i with x + i·st >= W
  std::fill(d, d + lo, D{});
  const D* src = reinterpret_cast<const D*>(row);
  if (st == 2)
    arch::copy_stride2(src + (x + 2 * lo), d + lo, static_cast<std::size_t>(hi - lo));
  else
    for (std::ptrdiff_t i = lo; i < hi; ++i) d[i] = src[x + i * sp];
  std::fill(d + hi, d + n, D{});
}

template <class T>
struct conv_gather {
  const T* src;
  conv_layout layout;
  std::size_t src_c, src_h, src_w;  // the source image's channels and extent
  std::size_t rh, rw;               // the row grid
  std::size_t cpg;                  // channels of a group in the GEMM depth
  std::size_t kh, kw, sh, sw, pt, pl, dh, dw;
  bool transposed;

  static std::ptrdiff_t coord(std::size_t o, std::size_t r, std::size_t st, std::size_t pad, std::size_t dil, std::size_t extent, bool tr) {
    std::ptrdiff_t v;
    if (!tr) {
      v = static_cast<std::ptrdiff_t>(o * st + r * dil) - static_cast<std::ptrdiff_t>(pad);
    } else {
      v = static_cast<std::ptrdiff_t>(o + pad) - static_cast<std::ptrdiff_t>(r * dil);
      if (v < 0 || v % static_cast<std::ptrdiff_t>(st) != 0) return -1;
      v /= static_cast<std::ptrdiff_t>(st);
    }
    return v >= 0 && v < static_cast<std::ptrdiff_t>(extent) ? v : -1;
  }

  template <class S>
  void gather(S* dst, std::size_t ld, std::size_t r0, std::size_t rows, std::size_t c0, std::size_t cols, std::size_t g) const {
    const std::size_t grid = rh * rw, plane = src_h * src_w;
    // NCHW: whole rows of at least 32 output pixels at stride 1 go column by column in 16x16 blocks
    // (U-Net b1 on 1 thread 120 -> 83 ms); narrower rows stay on this row order (ResNet-18 b1, whose
    // 7x7 to 56x56 rows mostly straddle image rows, ran 37.5 ms column by column, 34.4 ms so)
    if constexpr (std::is_same_v<S, T>)
      if (layout == conv_layout::nchw && !transposed && sw == 1 && rw >= 32) return gather_nchw_columns(dst, ld, r0, rows, c0, cols, g);
    for (std::size_t i = 0; i < rows; ++i) {
      const std::size_t m = r0 + i, img = m / grid, q = m % grid, y = q / rw, x = q % rw;
      S* d = dst + i * ld;
      std::size_t kk = c0, rs = c0 / cpg, ch = c0 % cpg;
      while (kk < c0 + cols) {
        const std::size_t r = rs / kw, s = rs % kw, len = std::min(cpg - ch, c0 + cols - kk);
        const std::ptrdiff_t iy = coord(y, r, sh, pt, dh, src_h, transposed), ix = iy < 0 ? -1 : coord(x, s, sw, pl, dw, src_w, transposed);
        S* o = d + (kk - c0);
        if (ix < 0) {
          std::fill_n(o, len, zero_elem<S>());
        } else if (layout == conv_layout::nhwc) {
          arch::widen(src + ((img * src_h + std::size_t(iy)) * src_w + std::size_t(ix)) * src_c + g * cpg + ch, o, len);
        } else {
          const T* p = src + (img * src_c + g * cpg + ch) * plane + std::size_t(iy) * src_w + std::size_t(ix);
          for (std::size_t j = 0; j < len; ++j) o[j] = convert_elem<S>(p[j * plane], 1.0f, false);
        }
        kk += len;
        ch = 0;
        ++rs;
      }
    }
  }

  // The forward NCHW gather column by column: a column (r, s, ch) of consecutive rows (pixels along
  // x) reads a run of one input row, where the row-by-row order read each pixel's channels a whole
  // plane apart (a page per element on large images: U-Net's 128x128 layers were bound by it). At
  // stride 1, sixteen rows by sixteen columns move at a time: each column's sixteen values are one
  // or two runs (two where the rows cross an output row; the dispatch guarantees rows of 32+
  // pixels), each copied whole, and the 16x16 block transposed into the tile's rows; blocks cut
  // short by the tile's edge go through a scratch block. The tile holds the same values as the row
  // order wrote: only the order of the copies changes.
  template <class S>
  void gather_nchw_columns(S* dst, std::size_t ld, std::size_t r0, std::size_t rows, std::size_t c0, std::size_t cols, std::size_t g) const {
    static_assert(std::is_same_v<S, T> && (sizeof(S) == 4 || sizeof(S) == 2), "gather_nchw_columns: no conversion on this path");
    const std::size_t grid = rh * rw, plane = src_h * src_w;
    constexpr std::size_t chunk = 128, batch = 64, V = 16;
    // rows: window origin (yy, xx) and the source offset of its (0, 0) tap; columns: the tap's (dy,
    // dx) and its offset from the origin (channel plane, row, column), so an element is one add
    std::ptrdiff_t yy[chunk], xx[chunk], ro[chunk], dy[batch], dx[batch], co[batch];
    const auto H = static_cast<std::ptrdiff_t>(src_h), W = static_cast<std::ptrdiff_t>(src_w);
    // 16-bit values travel as the low halves of 32-bit words through the same transpose
    using word = std::conditional_t<sizeof(S) == 4, std::uint32_t, std::uint16_t>;
    alignas(64) word t[V * V];
    alignas(64) std::uint32_t wide[V * V], tr[V * V];
    for (std::size_t i0 = 0; i0 < rows; i0 += chunk) {
      const std::size_t n = std::min(chunk, rows - i0);
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t m = r0 + i0 + i, img = m / grid, q = m % grid, y = q / rw, x = q % rw;
        yy[i] = static_cast<std::ptrdiff_t>(y * sh) - static_cast<std::ptrdiff_t>(pt);
        xx[i] = static_cast<std::ptrdiff_t>(x * sw) - static_cast<std::ptrdiff_t>(pl);
        ro[i] = static_cast<std::ptrdiff_t>((img * src_c + g * cpg) * plane) + yy[i] * W + xx[i];
      }
      for (std::size_t j0 = 0; j0 < cols; j0 += batch) {
        const std::size_t nc = std::min(batch, cols - j0);
        for (std::size_t j = 0; j < nc; ++j) {
          const std::size_t kk = c0 + j0 + j, rs = kk / cpg, ch = kk % cpg;
          dy[j] = static_cast<std::ptrdiff_t>((rs / kw) * dh), dx[j] = static_cast<std::ptrdiff_t>((rs % kw) * dw);
          co[j] = static_cast<std::ptrdiff_t>(ch * plane) + dy[j] * W + dx[j];
        }
        for (std::size_t i1 = 0; i1 < n; i1 += V) {
          const std::size_t nv = std::min(V, n - i1);
          // the block's rows as runs of neighbours along one output row of one image: [seg[u], seg[u + 1])
          // (stride 1: the next x one on means the same output row, rw >= 32 keeps a wrap from looking like that)
          std::size_t seg[V + 1], ns = 0;
          seg[ns++] = 0;
          for (std::size_t i = 1; i < nv; ++i) {
            const std::size_t a = i1 + i;
            if (!(xx[a] == xx[a - 1] + 1 && ro[a] == ro[a - 1] + 1)) seg[ns++] = i;
          }
          seg[ns] = nv;
          for (std::size_t j = 0; j < nc; j += V) {
            const std::size_t ncv = std::min(V, nc - j);
            for (std::size_t v = 0; v < V; ++v) {  // column j + v's values for the block's rows, in row v of t
              word* tv = t + v * V;
              if (v >= ncv) {
                std::fill_n(tv, V, word{0});
                continue;
              }
              for (std::size_t u = 0; u < ns; ++u) {
                const std::size_t a = seg[u], len = seg[u + 1] - a;
                const std::ptrdiff_t iy = yy[i1 + a] + dy[j + v], ix = xx[i1 + a] + dx[j + v];
                const std::ptrdiff_t lo = std::max<std::ptrdiff_t>(0, -ix), hi = std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(len), W - ix);
                if (len == V && lo == 0 && hi == static_cast<std::ptrdiff_t>(V) && iy >= 0 && iy < H) {
                  std::memcpy(tv, src + (ro[i1] + co[j + v]), V * sizeof(S));  // inside the image: one fixed-size copy
                  continue;
                }
                word* ta = tv + a;
                if (iy < 0 || iy >= H) {  // zero_elem is all-zero bits for f32 and bf16
                  std::fill_n(ta, len, word{0});
                  continue;
                }
                conv_row_run(src + (ro[i1 + a] + co[j + v] - ix), src_w, ix, ta, len);  // from the start of input row iy
              }
              std::fill(tv + nv, tv + V, word{0});
            }
            S* d0 = dst + (i0 + i1) * ld + j0 + j;
            const bool whole = nv == V && ncv == V;
            if constexpr (sizeof(S) == 4) {
              if (whole) {
                arch::transpose16_b32(t, V * sizeof(S), d0, ld * sizeof(S));
                continue;
              }
              arch::transpose16_b32(t, V * sizeof(S), tr, V * 4);
            } else {
              for (std::size_t q = 0; q < V * V; ++q) wide[q] = t[q];
              arch::transpose16_b32(wide, V * 4, tr, V * 4);
            }
            for (std::size_t i = 0; i < nv; ++i) {
              word row[V];
              for (std::size_t q = 0; q < ncv; ++q) row[q] = static_cast<word>(tr[i * V + q]);
              std::memcpy(d0 + i * ld, row, ncv * sizeof(S));
            }
          }
        }
      }
    }
  }
};

// An image's channels of group g as the rows of a (cpg, pixels) matrix (the weight gradient's A:
// the output gradient transposed).
template <class T>
struct conv_channel_rows {
  const T* src;
  conv_layout layout;
  std::size_t channels, plane, cpg;
  template <class S>
  void gather(S* dst, std::size_t ld, std::size_t r0, std::size_t rows, std::size_t c0, std::size_t cols, std::size_t g) const {
    if (layout == conv_layout::nhwc) {
      for (std::size_t j = 0; j < cols; ++j) {  // one pixel's channels are contiguous
        const T* p = src + (c0 + j) * channels + g * cpg + r0;
        for (std::size_t i = 0; i < rows; ++i) dst[i * ld + j] = convert_elem<S>(p[i], 1.0f, false);
      }
      return;
    }
    for (std::size_t i = 0; i < rows; ++i) {
      const std::size_t ch = g * cpg + r0 + i;
      for (std::size_t j = 0; j < cols;) {
        const std::size_t m = c0 + j, img = m / plane, q = m % plane, len = std::min(plane - q, cols - j);
        arch::widen(src + (img * channels + ch) * plane + q, dst + i * ld + j, len);
        j += len;
      }
    }
  }
};

// A dense (rows, cols) matrix per group (packed filters), loaded as GEMM loads B: row-major, or
// transposed (each column contiguous: an OHWI filter, whose output channel's (r, s, c) taps are one
// run, which GEMM's B load packs with 16x16 register transposes).
template <class S>
struct conv_matrix {
  const S* p;
  std::size_t rows, cols;
  bool transposed = false;
  tensor<const S, 2> view(std::size_t g) const {
    return transposed ? tensor<const S, 2>::strided(p + g * rows * cols, rows, cols, 1, rows)
                      : tensor<const S, 2>::strided(p + g * rows * cols, rows, cols, cols, 1);
  }
};

// B already in the atoms' (KC,NB) panel tiles: tile (g, column block nb, depth chunk k) at
// p + ((g·nblocks + nb)·nk + k)·tile (a prepacked filter; see conv2d_pack).
template <class S>
struct conv_panels {
  const S* p;
  std::size_t nblocks, nk, tile;
  bool narrow = false;  // packed for the narrow atom's panels (conv_narrow)
  const S* at(std::size_t g, std::size_t nb, std::size_t k) const { return p + ((g * nblocks + nb) * nk + k) * tile; }
};

// Whether the stage type has the narrow atom (see conv_narrow).
template <class S>
inline constexpr bool conv_has_narrow = !std::is_same_v<typename gemm_config<S, S>::atom, typename gemm_config<S, S, false, true>::atom>;

// ---- the channel-rows orientation (NCHW at horizontal stride 1 or 2, f32 or bf16 pairs) ----
// The same product transposed: Cᵀ(O/groups, pixels) = Wᵀ(O/groups, K) · im2colᵀ(K, pixels). An NCHW
// output row of pixels is a run of one input row (every other element at stride 2), so B (K rows
// of pixels) is plain copies of the image, no transposes, and the output channels' rows go to
// their planes as they lie. U-Net's 32-channel layers at 128x128 spent most of their time
// transposing 16x16 blocks in the pixel-rows orientation (im2col rows and the NCHW store), and
// ResNet's 7x7 stride-2 stem gathering its pixel rows element by element (50 -> 114 GFLOP/s f32
// at batch 8 as channel rows). The depth runs in the same (r, s, c) order, in the same depth
// chunks (conv_channel_rows_run), so both orientations give the same bits.

// B: row k = (r, s, ch) of group g over output pixels (n, y, x) of an (rh, rw) grid; zeros outside.
template <class T>
struct conv_pixel_cols {
  const T* src;
  std::size_t src_c, H, W, rh, rw, cpg, kw, sh, sw, pt, pl, dh, dw;
  // Writes straight into the (KC, NB) B tile of NR-column panels (panel_elems apart), zeros in the
  // last panel's columns past cols. KP = 1 (f32): each depth row is the image's run as it lies;
  // KP = 2 (bf16 pair-dot atoms): depth rows k and k+1 (two channels, or the next tap) interleave
  // word by word, zeros standing in for a missing k+1.
  static constexpr bool writes_panels = true;
  template <std::size_t NR, std::size_t KP, class S>
  void gather_panels(S* tile, std::size_t panel_elems, std::size_t k0, std::size_t kv, std::size_t n0, std::size_t cols, std::size_t g) const {
    static_assert(std::is_same_v<S, T> && ((KP == 1 && sizeof(S) == 4) || (KP == 2 && sizeof(S) == 2)),
                  "conv_pixel_cols: copies the image as it lies (f32), or interleaves its rows in pairs (bf16)");
    constexpr std::size_t PF = 8, SEG = 256;  // columns per pass (a block's NB at most)
    using word = std::conditional_t<sizeof(S) == 4, std::uint32_t, std::uint16_t>;
    const std::size_t grid = rh * rw, plane = H * W;
    // the pixels as runs along one output row: (first column, length, the run's first input row
    // and column at tap (0, 0), its image's first plane); a run spans panels
    struct run {
      std::size_t at, len;
      std::ptrdiff_t y, x;
      const S* img;
    };
    // a depth row's source for a run: its input row (nullptr in the vertical padding) and the input
    // column of the run's first pixel
    struct source {
      const S* row;
      std::ptrdiff_t x;
    };
    run runs[SEG];
    source s0[SEG], s1[SEG];
    word lo[SEG], hi[SEG];
    // column c of depth row i in the tile
    auto at = [&](std::size_t i, std::size_t c) { return tile + (c / NR) * panel_elems + (i / KP) * NR * KP + (c % NR) * KP; };
    for (std::size_t j0 = 0; j0 < cols; j0 += SEG) {
      const std::size_t n = std::min(SEG, cols - j0);
      std::size_t nr = 0;
      for (std::size_t t = 0; t < n;) {
        const std::size_t m = n0 + j0 + t, q = m % grid, x = q % rw, len = std::min(rw - x, n - t);
        runs[nr++] = {j0 + t, len, static_cast<std::ptrdiff_t>((q / rw) * sh) - static_cast<std::ptrdiff_t>(pt),
                      static_cast<std::ptrdiff_t>(x * sw) - static_cast<std::ptrdiff_t>(pl), src + ((m / grid) * src_c + g * cpg) * plane};
        t += len;
      }
      // depth k = (r·kw + s)·cpg + ch, stepped without divisions; each row's sources, with the
      // same run PF planes on prefetched (H·W elements apart: too far for the hardware's prefetch)
      std::size_t ch = k0 % cpg, s = (k0 / cpg) % kw, r = k0 / cpg / kw;
      auto sources = [&](source* out) {
        for (std::size_t u = 0; u < nr; ++u) {
          const run& a = runs[u];
          const std::ptrdiff_t iy = a.y + static_cast<std::ptrdiff_t>(r * dh), x = a.x + static_cast<std::ptrdiff_t>(s * dw);
          if (iy < 0 || iy >= static_cast<std::ptrdiff_t>(H)) {
            out[u] = {nullptr, x};
            continue;
          }
          const S* rowp = a.img + ch * plane + static_cast<std::size_t>(iy) * W;
          if (ch + PF < cpg) {
            const std::ptrdiff_t l0 = std::max<std::ptrdiff_t>(0, x),
                                 l1 = std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(W), x + static_cast<std::ptrdiff_t>(a.len * sw));
            for (std::ptrdiff_t l = l0; l < l1; l += std::ptrdiff_t{64 / sizeof(S)}) __builtin_prefetch(rowp + PF * plane + l, 0, 3);
          }
          out[u] = {rowp, x};
        }
        if (++ch == cpg) {
          ch = 0;
          if (++s == kw) s = 0, ++r;
        }
      };
      // elements [o, o + len) of a run of a source into dst (zeros outside the image)
      auto copy_run = [&](const source& q, std::size_t o, std::size_t len, auto* dst) {
        if (q.row)
          conv_row_run(q.row, W, q.x + static_cast<std::ptrdiff_t>(o * sw), sw, dst, len);
        else
          std::fill_n(dst, len, std::remove_reference_t<decltype(*dst)>{});
      };
      const std::ptrdiff_t Wp = static_cast<std::ptrdiff_t>(W);
      for (std::size_t i = 0; i < kv; i += KP) {
        sources(s0);
        const bool second = KP == 2 && i + 1 < kv;
        if (second) sources(s1);
        for (std::size_t u = 0; u < nr; ++u) {
          const run& a = runs[u];
          if constexpr (KP == 1) {  // each piece of the run inside one panel, copied as it lies
            for (std::size_t o = 0; o < a.len;) {
              const std::size_t c = a.at + o, piece = std::min(a.len - o, NR - c % NR);
              copy_run(s0[u], o, piece, at(i, c));
              o += piece;
            }
          } else {
            // depth rows i and i+1 side by side, word by word: the pairs as the atoms read them. A
            // run inside the image on both rows interleaves straight from it; one that reaches into
            // the padding (or a missing i+1, or stride 2) goes through zero-filled copies.
            auto inside = [&](const source& q) { return sw == 1 && q.row && q.x >= 0 && q.x + static_cast<std::ptrdiff_t>(a.len) <= Wp; };
            const bool direct = second && inside(s0[u]) && inside(s1[u]);
            const word *r0 = lo, *r1 = hi;
            if (direct) {
              r0 = reinterpret_cast<const word*>(s0[u].row + s0[u].x);
              r1 = reinterpret_cast<const word*>(s1[u].row + s1[u].x);
            } else {
              copy_run(s0[u], 0, a.len, lo);
              if (second)
                copy_run(s1[u], 0, a.len, hi);
              else
                std::fill_n(hi, a.len, word{0});
            }
            for (std::size_t o = 0; o < a.len;) {
              const std::size_t c = a.at + o, piece = std::min(a.len - o, NR - c % NR);
              arch::interleave_u16(r0 + o, r1 + o, reinterpret_cast<word*>(at(i, c)), piece, false);
              o += piece;
            }
          }
        }
        if (j0 + n == cols && cols % NR != 0) std::fill_n(at(i, cols), (NR - cols % NR) * KP, zero_elem<S>());  // the last panel's columns past cols
      }
    }
  }
};

// A: the filter's output channels of group g as rows over the depth (r, s, c): the OHWI matrix
// (kg rows of K taps per group; conv_pack_filter, or conv_filter_rows_program from a prepacked filter).
template <class S>
struct conv_filter_rows {
  const S* p;
  std::size_t K, kg;
  void gather(S* dst, std::size_t ld, std::size_t r0, std::size_t rows, std::size_t c0, std::size_t cols, std::size_t g) const {
    const S* w = p + g * kg * K;
    for (std::size_t i = 0; i < rows; ++i) std::memcpy(dst + i * ld, w + (r0 + i) * K + c0, cols * sizeof(S));
  }
};

// ---- output writers: the accumulator slab (rows, cols) with leading dimension lda ----

// An f32 accumulator block of n pixels x nc channels (pixel p, channel j at acc[p·ps + j·cs]: the
// pixel-rows orientation has cs = 1, the channel-rows one ps = 1) into NCHW channel planes at o
// (pixel p of channel j at o[j·plane + p]) through the chain, which sees pixel rows (row = pixel
// row + p, columns channels col0 ...) as store_rows gives them. Sixteen pixels by 64 channels at a
// time through a buffer, with 16x16 register transposes where whole (one store per element into
// the planes was most of a conv's store on U-Net).
template <class Chain>
void store_nchw_block(const float* acc, std::size_t ps, std::size_t cs, std::size_t n, std::size_t nc, float* o, std::size_t plane, std::size_t row,
                      std::size_t col0, const Chain& ep) {
  constexpr std::size_t V = 16, CW = 64;
  alignas(64) float buf[V * CW];
  for (std::size_t p0 = 0; p0 < n; p0 += V) {
    const std::size_t np = std::min(V, n - p0);
    for (std::size_t c0 = 0; c0 < nc; c0 += CW) {
      const std::size_t cw = std::min(CW, nc - c0);
      const float* a = acc + p0 * ps + c0 * cs;
      float* d = o + c0 * plane + p0;
      std::size_t j = 0;
      if (cs == 1) {
        for (std::size_t v = 0; v < np; ++v) std::memcpy(buf + v * CW, a + v * ps, cw * sizeof(float));
      } else {
        if (np == V && ps == 1)
          for (; j + V <= cw; j += V) arch::transpose16_b32(a + j * cs, cs * sizeof(float), buf + j, CW * sizeof(float));
        for (; j < cw; ++j)
          for (std::size_t v = 0; v < np; ++v) buf[v * CW + j] = a[v * ps + j * cs];
      }
      if constexpr (!Chain::empty)
        for (std::size_t v = 0; v < np; ++v) {
          epilogue::row_info ri;
          ri.row = row + p0 + v;
          ri.col0 = col0 + c0;
          ri.old = d + v;
          ri.old_stride = plane;
          ri.old_at = &read_as_f32<float>;
          ep.apply(buf + v * CW, cw, ri);
        }
      j = 0;
      if (np == V)
        for (; j + V <= cw; j += V) arch::transpose16_b32(buf + j, CW * sizeof(float), d + j * plane, plane * sizeof(float));
      for (; j < cw; ++j)
        for (std::size_t v = 0; v < np; ++v) d[j * plane + v] = buf[v * CW + j];
    }
  }
}

// Into an image: GEMM rows are its pixels, columns channel g·cpg + col (the forward's y, the data
// gradient's dx), through the epilogue chain with row = pixel, col = channel.
template <class TY>
struct conv_image_out {
  TY* y;
  conv_layout layout;
  std::size_t channels, plane, cpg;
  template <class Chain>
  void store(const float* acc, std::size_t lda, std::size_t m0, std::size_t rows, std::size_t n0, std::size_t cols, std::size_t g,
             const Chain& ep) const {
    const std::size_t col = g * cpg + n0;
    if (layout == conv_layout::nhwc) return store_rows<TY>(acc, lda, rows, cols, y + m0 * channels + col, channels, 1, m0, col, ep);
    for (std::size_t i = 0; i < rows;) {  // NCHW: rows split at image boundaries
      const std::size_t m = m0 + i, img = m / plane, q = m % plane, len = std::min(plane - q, rows - i);
      TY* d = y + (img * channels + col) * plane + q;
      if constexpr (std::is_same_v<TY, float>)
        store_nchw_block(acc + i * lda, lda, 1, len, cols, d, plane, m, col, ep);
      else
        store_rows<TY>(acc + i * lda, lda, len, cols, d, 1, plane, m, col, ep);
      i += len;
    }
  }
};

// Into an f32 NCHW image from the channel-rows orientation: rows are output channels g·cpg + row,
// columns consecutive pixels, so each row is a run of its plane (copied as it lies without a
// chain; with one, store_nchw_block turns sixteen pixels at a time to the pixel rows it sees).
struct conv_nchw_rows_out {
  float* y;
  std::size_t channels, plane, cpg;
  template <class Chain>
  void store(const float* acc, std::size_t lda, std::size_t m0, std::size_t rows, std::size_t n0, std::size_t cols, std::size_t g,
             const Chain& ep) const {
    const std::size_t ch0 = g * cpg + m0;
    for (std::size_t j = 0; j < cols;) {  // runs of pixels inside one image
      const std::size_t m = n0 + j, img = m / plane, q = m % plane, len = std::min(plane - q, cols - j);
      float* d = y + (img * channels + ch0) * plane + q;
      if constexpr (Chain::empty) {
        for (std::size_t i = 0; i < rows; ++i) std::memcpy(d + i * plane, acc + i * lda + j, len * sizeof(float));
      } else {
        store_nchw_block(acc + j, 1, lda, len, rows, d, plane, m, ch0, ep);
      }
      j += len;
    }
  }
};

// Into an OIHW filter gradient: rows are output channels of group g, columns (r, s, c).
struct conv_filter_out {
  float* dw;
  std::size_t kg, cg, kh, kw;
  template <class Chain>
  void store(const float* acc, std::size_t lda, std::size_t m0, std::size_t rows, std::size_t n0, std::size_t cols, std::size_t g,
             const Chain&) const {
    for (std::size_t i = 0; i < rows; ++i) {
      float* o = dw + (g * kg + m0 + i) * cg * kh * kw;
      for (std::size_t j = 0; j < cols; ++j) {
        const std::size_t k = n0 + j, rs = k / cg, c = k % cg;
        o[c * kh * kw + rs] = acc[i * lda + j];
      }
    }
  }
};

template <class T>
constexpr math_precision conv_precision() {
  return std::is_same_v<T, float> ? math_precision::f32 : math_precision::bf16;
}

// The implicit GEMM: C(M,N) of group g = A(M,K)·B(K,N), A and B from their loaders. The blocking
// is GEMM's (gemm_config: MC-row slabs, KC-deep chunks, NB-wide B strips packed once per block in
// pieces of at most KS_max, the same atoms); each element's chunks add in K order, so the result
// does not depend on the block shape or the thread count.
template <class S, class ASrc, class BSrc, class Out, class Chain, bool Narrow = false>
struct conv_gemm_program {
  using cfg = gemm_config<S, S, false, Narrow>;
  using atom = typename cfg::atom;
  static_assert(std::is_same_v<typename cfg::stage, S>, "conv_gemm_program: S must be the atoms' stage type");
  static constexpr std::size_t MR = cfg::MR, NR = cfg::NR, KP = cfg::KP, KC = cfg::KC, NB = cfg::NB, MC = cfg::MC;
  static constexpr std::size_t KS_max = 4096;
  static constexpr bool b_matrix = std::is_same_v<BSrc, conv_matrix<S>>;
  static constexpr bool b_panels = std::is_same_v<BSrc, conv_panels<S>>;
  static constexpr bool b_direct = requires { BSrc::writes_panels; };  // B gathered straight into its panels
  std::size_t M, N, K, groups, MB;
  std::size_t NW = NB;  // columns per block: NB, or NB/2^i (whole NR panels, never straddling an (KC,NB) tile) when M is small
  ASrc a;
  BSrc b;
  Out out;
  Chain ep;
  kernel_cost work;
  const char* what = "conv2d";

  kernel_cost cost(const grid&) const { return work; }
  std::string shape() const {
    return std::string(what) + " as GEMM (M,N,K)=(" + std::to_string(M) + "," + std::to_string(N) + "," + std::to_string(K) + ") x groups " +
           std::to_string(groups);
  }

  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t g = idx[2], m0 = idx[0] * MB, rows = std::min(MB, M - m0), n0 = idx[1] * NW, cols = std::min(NW, N - n0);
    using b_stage = staged<S, KC, NB, typename cfg::b_layout>;
    constexpr std::size_t panel_elems = NR * layout::col_panel<NR, KP>::padded_rows(KC);  // one (KC,NR) panel of a B tile
    const std::size_t p0 = (n0 % NB) / NR;                                                // a prepacked tile's first panel of this block
    const std::size_t nk = ceil_div(K, KC), chunks = std::min(nk, KS_max / KC);
    S* strip = b_panels ? nullptr : ctx.scratch().allocate_array<S>(chunks * b_stage::elements);  // chunks x (KC,NB)
    const std::size_t rows_pad = ceil_div(rows, MC) * MC;
    float* acc = ctx.scratch().allocate_array<float>((nk > chunks ? rows_pad : MC) * NB);             // (MB,NB) or one (MC,NB) slab
    staged<S, MC, KC, layout::row> at{ctx};                                                           // (MC,KC) A by im2col addressing
    S* bsrc = b_matrix || b_panels || b_direct ? nullptr : ctx.scratch().allocate_array<S>(KC * NB);  // (KC,NB) gathered B
    for (std::size_t kq = 0; kq < nk; kq += chunks) {
      const std::size_t kn = std::min(chunks, nk - kq);
      for (std::size_t k = 0; k < kn && !b_panels; ++k) {
        b_stage bk(strip + k * b_stage::elements);
        const std::size_t k0 = (kq + k) * KC, kv = std::min(KC, K - k0);
        if constexpr (b_panels) {
          (void)bk, (void)k0, (void)kv;
        } else if constexpr (b_matrix) {
          load(b.view(g).template tile_at<KC, NB>(k0, n0), bk, tile_extent{kv, cols});
        } else if constexpr (b_direct) {
          b.template gather_panels<NR, KP>(bk.data(), panel_elems, k0, kv, n0, cols, g);
        } else {
          b.gather(bsrc, NB, k0, kv, n0, cols, g);
          load(tensor<const S, 2>::strided(bsrc, kv, cols, NB, 1).template tile_at<KC, NB>(0, 0), bk, tile_extent{kv, cols});
        }
      }
      const bool last_piece = kq + kn == nk;
      for (std::size_t mc = 0; mc < rows; mc += MC) {
        const std::size_t r = std::min(MC, rows - mc);
        float* accm = acc + (nk > chunks ? mc * NB : 0);
        for (std::size_t k = 0; k < kn; ++k) {
          const std::size_t k0 = (kq + k) * KC, kv = std::min(KC, K - k0), kvp = ceil_div(kv, KP) * KP;
          a.gather(at.data(), KC, m0 + mc, r, k0, kv, g);
          if (kvp != kv)
            for (std::size_t i = 0; i < r; ++i) std::fill(at.data() + i * KC + kv, at.data() + i * KC + kvp, zero_elem<S>());
          arch::ukernel_args p;
          p.k = kvp / KP;
          p.ldc = NB;
          p.accumulate = kq + k > 0;
          p.a_rs = KC;
          const S* bkp;
          if constexpr (b_panels)
            bkp = b.at(g, n0 / NB, kq + k) + p0 * panel_elems;
          else
            bkp = strip + k * b_stage::elements;
          for (std::size_t jp = 0; jp * NR < cols; ++jp) {
            p.b = bkp + jp * panel_elems;
            for (std::size_t ip = 0; ip * MR < r; ++ip) {
              p.c = accm + ip * MR * NB + jp * NR;
              p.a = at.data() + ip * MR * KC;
              arch::run_rows<atom>(static_cast<int>(std::min(MR, r - ip * MR)), p);
            }
          }
        }
        if (last_piece) out.store(accm, NB, m0 + mc, r, n0, cols, g, ep);
      }
    }
  }
};

// The block shape (rows MB, columns NW) of a launch, from a cost model in multiply-add units: a
// block computes its rows and columns rounded up to the atom (MR, NR), gathers its rows' A
// (~8 per element: A is re-gathered by each column block) and, unless B comes prepacked, packs
// its columns' B (~8 per element: re-packed by each row block), plus a fixed cost per block; the
// launch takes ceil(blocks / workers) rounds of its largest block. Candidates: columns NB, NB/2,
// ... down to NR (whole panels of one B tile), rows whole MR-row panels up to MB_max. Small M
// (ResNet's 7x7 and 14x14 layers: 49..196 rows) then splits the columns instead of leaving a
// worker idle or running thin row blocks; large M keeps GEMM's full-width blocks. The shape
// never changes an element's arithmetic (one chain over the same K chunks), only who computes it.
struct conv_blocking {
  std::size_t MB, NW;
};
template <class S, bool Narrow = false>
conv_blocking conv_block_shape(std::size_t M, std::size_t N, std::size_t K, std::size_t groups, unsigned workers, bool packs_b) {
  using cfg = gemm_config<S, S, false, Narrow>;
  const std::size_t w = std::max(1u, workers);
  const double a_cost = 8.0, b_cost = packs_b ? 8.0 : 0.0, block_cost = 2.0e4;
  conv_blocking best{std::min(M, cfg::MB_max), cfg::NB};
  double best_t = -1.0;
  for (std::size_t nw = cfg::NB; nw >= cfg::NR; nw /= 2) {
    if (nw % cfg::NR != 0) continue;
    const std::size_t nblocks = ceil_div(N, nw) * groups, cols = ceil_div(std::min(nw, N), cfg::NR) * cfg::NR;
    // row blocks: from the fewest that fit MB_max up to one per MR panel (at most 64 per worker)
    const std::size_t mb_min = ceil_div(M, cfg::MB_max), mb_max = std::max(mb_min, std::min(ceil_div(M, cfg::MR), 64 * w));
    for (std::size_t mb = mb_min; mb <= mb_max; ++mb) {
      const std::size_t MB = std::min(M, ceil_div(ceil_div(M, mb), cfg::MR) * cfg::MR);
      if (MB > cfg::MB_max) continue;
      const std::size_t blocks = ceil_div(M, MB) * nblocks;
      const double one = double(ceil_div(MB, cfg::MR) * cfg::MR) * double(cols) * double(K) + a_cost * double(MB) * double(K) +
                         b_cost * double(cols) * double(K) + block_cost;
      const double t = double(ceil_div(blocks, w)) * one;
      if (best_t < 0 || t < best_t * 0.999) best_t = t, best = {MB, nw};
    }
    if (nw == cfg::NR) break;
  }
  return best;
}

// Whether a group of n output columns runs on the narrow atom (gemm_config's Narrow): when its
// 32-column panels cover n with fewer columns than the 64-column panels do (n mod 64 in 1..32:
// U-Net's 32-channel layers ran at half the f32 rate, the final 1x1 to 4 classes at 1/16). Only
// f32 stages with AVX-512 have two atoms; the choice depends on the shape alone, so a shape's bits
// never depend on the device or the thread count (a prepacked filter records the choice).
template <class S>
bool conv_narrow(std::size_t n) {
  if constexpr (!conv_has_narrow<S>) {
    (void)n;
    return false;
  } else {
    constexpr std::size_t wide = gemm_config<S, S>::NR, thin = gemm_config<S, S, false, true>::NR;
    return ceil_div(n, thin) * thin < ceil_div(n, wide) * wide;
  }
}

template <class S, bool Narrow, class ASrc, class BSrc, class Out, class Chain, class Dev>
void conv_gemm_launch(Dev& dev, std::size_t M, std::size_t N, std::size_t K, std::size_t groups, const ASrc& a, const BSrc& b, const Out& out,
                      const Chain& ep, const kernel_cost& work, const char* what) {
  using P = conv_gemm_program<S, ASrc, BSrc, Out, Chain, Narrow>;
  const auto bs = conv_block_shape<S, Narrow>(M, N, K, groups, dev.capabilities().workers, !P::b_panels);
  P prog{M, N, K, groups, bs.MB, bs.NW, a, b, out, ep, work, what};
  gemm_run(dev, grid{ceil_div(M, bs.MB), ceil_div(N, bs.NW), groups}, prog, work.flops);
}

// The filter rows (kg, K) of every group written out once per call from a prepacked filter's
// panels, for conv_filter_rows to copy per block: block (g, p) unpacks panel p's NR output
// channels of group g, 16x16 transposes of (depth, channel) blocks where whole (f32 panels).
template <class S, bool Narrow>
struct conv_filter_rows_program {
  using cfg = gemm_config<S, S, false, Narrow>;
  static constexpr std::size_t NR = cfg::NR, KP = cfg::KP, panel = NR * layout::col_panel<NR, KP>::padded_rows(cfg::KC);
  conv_panels<S> pk;
  S* out;
  std::size_t kg, K;
  kernel_cost cost(const grid& gr) const {
    return {0.0, 2.0 * double(std::min(NR, kg)) * double(K) * double(gr.size()) * double(sizeof(S)), math_precision::f32};
  }
  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t g = idx[0], o0 = idx[1] * NR, no = std::min(NR, kg - o0), nb = o0 / cfg::NB, pan = (o0 % cfg::NB) / NR;
    S* d = out + (g * kg + o0) * K;
    for (std::size_t kc = 0; kc * cfg::KC < K; ++kc) {
      const std::size_t kv = std::min(cfg::KC, K - kc * cfg::KC);
      const S* t = pk.at(g, nb, kc) + pan * panel;
      std::size_t k = 0;
      if constexpr (KP == 1 && sizeof(S) == 4) {
        for (; k + 16 <= kv; k += 16)
          for (std::size_t l = 0; l + 16 <= no; l += 16)
            arch::transpose16_b32(t + k * NR + l, NR * sizeof(S), d + l * K + kc * cfg::KC + k, K * sizeof(S));
        for (std::size_t l = no / 16 * 16; l < no; ++l)  // channels past the last whole 16
          for (std::size_t kk = 0; kk < k; ++kk) d[l * K + kc * cfg::KC + kk] = t[kk * NR + l];
      }
      for (; k < kv; ++k)
        for (std::size_t l = 0; l < no; ++l) d[l * K + kc * cfg::KC + k] = t[(k / KP) * NR * KP + l * KP + k % KP];
    }
  }
};

// Whether conv2d runs in the channel-rows orientation (conv_pixel_cols): NCHW in and f32 NCHW out
// at horizontal stride 1 or 2, the input already in the atoms' stage type (f32, or bf16 where the
// bf16 pair-dot atoms run), output rows of 32 pixels or more (shorter runs are not worth a copy each;
// ResNet's 28x28 and smaller layers stay on the pixel rows). A function of the shape alone.
template <class T, class TY>
bool conv_use_channel_rows(const conv_geom& g) {
  if constexpr (std::is_same_v<TY, float> && std::is_same_v<typename mma_traits<T>::stage_type, T>)
    return g.layout == conv_layout::nchw && g.sw <= 2 && g.ow >= 32;
  else
    return (void)g, false;
}

// The forward in the channel-rows orientation from the filter's OHWI rows, on the 64-column atom
// (the columns are pixels, plenty of them; 32 output channels as rows: 8.9 against 11.5 ms on
// the 32-row atom, 96 -> 32 channels at 128x128). Both f32 atoms sum the same depth chunks
// (gemm_config's KC), so the bits are those of the pixel-rows orientation on either; a bf16 pair
// dot is symmetric in its operands, so swapping A and B keeps bf16's bits too. bf16 U-Net (ONNX,
// batch 1, 1 thread) went from 51 to 22 ms: its pixel rows stored NCHW element by element.
template <class S, class Chain, class Dev>
void conv_channel_rows_run(Dev& dev, const conv_geom& g, const S* x, const S* rows, float* y, const Chain& ep, const kernel_cost& work) {
  const conv_filter_rows<S> a{rows, g.depth(), g.kg};
  const conv_pixel_cols<S> b{x, g.c, g.h, g.w, g.oh, g.ow, g.cg, g.kw, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw};
  const conv_nchw_rows_out out{y, g.k, g.oh * g.ow, g.kg};
  conv_gemm_launch<S, false>(dev, g.kg, g.pixels(), g.depth(), g.groups, a, b, out, ep, work, "conv2d");
}

// The same from a prepacked filter: its panels unpacked into rows once per call (one pass over
// the filter, against a strided walk of the panels by every block).
template <class S, class Chain, class Dev>
void conv_channel_rows_run(Dev& dev, const conv_geom& g, const S* x, const conv_panels<S>& pk, float* y, const Chain& ep, const kernel_cost& work) {
  S* rows = static_cast<S*>(dev.allocate(mul_checked(g.fil().size(), sizeof(S), "conv filter rows")));
  const device_workspace<Dev> guard{dev, rows};
  auto unpack = [&]<bool Narrow>() {
    using P = conv_filter_rows_program<S, Narrow>;
    gemm_run(dev, grid{g.groups, ceil_div(g.kg, P::NR)}, P{pk, rows, g.kg, g.depth()}, double(g.fil().size()) * 8.0);
  };
  if constexpr (conv_has_narrow<S>)
    if (pk.narrow) unpack.template operator()<true>();
  if (!conv_has_narrow<S> || !pk.narrow) unpack.template operator()<false>();
  conv_channel_rows_run<S>(dev, g, x, static_cast<const S*>(rows), y, ep, work);
}

template <class S, class ASrc, class BSrc, class Out, class Chain, class Dev>
void conv_gemm_run(Dev& dev, std::size_t M, std::size_t N, std::size_t K, std::size_t groups, const ASrc& a, const BSrc& b, const Out& out,
                   const Chain& ep, const kernel_cost& work, const char* what) {
  bool narrow = false;
  if constexpr (std::is_same_v<BSrc, conv_panels<S>>)
    narrow = b.narrow;  // as packed
  else
    narrow = conv_narrow<S>(N);
  if constexpr (conv_has_narrow<S>)
    if (narrow) return conv_gemm_launch<S, true>(dev, M, N, K, groups, a, b, out, ep, work, what);
  conv_gemm_launch<S, false>(dev, M, N, K, groups, a, b, out, ep, work, what);
}

// Packs an OIHW filter into per-group dense (K, N) matrices of the stage type: the data
// gradient's B[g][(r,s,o)][c] = W[g·kg + o][c][r][s]; the forward's transposed, OHWI:
// Bᵀ[g][o][(r,s,c)] = W[g·kg + o][c][r][s], a reorder within each output channel's filter (read
// once in order, written to KH·KW runs in L1) rather than a transpose of the whole filter, which
// GEMM's B load then packs with register transposes (the (K, N) transpose, element by element 16
// channels at a time, was most of a plain call on the deep layers: 128 channels at 28x28, n=1,
// 283 against 348 GFLOP/s prepacked).
template <class T, class S>
struct conv_pack_filter_program {
  const T* w;
  S* out;
  std::size_t kg, cg, kh, kw;
  bool for_data_grad;
  kernel_cost cost(const grid& gr) const {
    const double n = double(kg) * double(cg) * double(kh) * double(kw) * double(gr.size()) / double(ceil_div(kg, OB));  // the groups' filters
    return {0.0, n * double(sizeof(T) + sizeof(S)), math_precision::f32};
  }
  // block (g, b) packs output channels [16b, 16b + 16) of group g: their 16 filter rows stay in
  // cache while every (r, s, c) of them is written (one block per group ran a 512-channel filter
  // on one thread, longer than the convolution of a 7x7 image)
  static constexpr std::size_t OB = 16;
  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t g = idx[0], o0 = idx[1] * OB, on = std::min(OB, kg - o0), rs_n = kh * kw, per = kg * cg * rs_n;
    S* o = out + g * per;
    if (!for_data_grad) {
      const std::size_t total = kg * cg * rs_n * (g + 1);  // elements of the filter up to this group's end
      for (std::size_t oc = o0; oc < o0 + on; ++oc) {
        const std::size_t row0 = (g * kg + oc) * cg * rs_n;
        const T* src = w + row0;
        S* dst = o + oc * cg * rs_n;
        std::size_t c = 0;
        if constexpr (std::is_same_v<T, S> && sizeof(S) == 4) {
          // (cg, rs_n) -> (rs_n, cg) in 16x16 register transposes: 16 channels by 16 taps (the
          // reads of a block run up to 16 words into the next channels; never past the filter)
          alignas(64) S t[16 * 16];
          // whole blocks whose last read (channel c + 15, taps up to rs0 + 15 < rs_n + 15) stays in the filter
          for (; c + 16 <= cg && row0 + (c + 16) * rs_n + 15 <= total; c += 16)
            for (std::size_t rs0 = 0; rs0 < rs_n; rs0 += 16) {
              arch::transpose16_b32(src + c * rs_n + rs0, rs_n * sizeof(S), t, 16 * sizeof(S));
              for (std::size_t q = 0; q < std::min<std::size_t>(16, rs_n - rs0); ++q)
                std::memcpy(dst + (rs0 + q) * cg + c, t + q * 16, 16 * sizeof(S));
            }
        }
        for (; c < cg; ++c)
          for (std::size_t rs = 0; rs < rs_n; ++rs) dst[rs * cg + c] = convert_elem<S>(src[c * rs_n + rs], 1.0f, false);
      }
      return;
    }
    for (std::size_t rs = 0; rs < rs_n; ++rs)
      for (std::size_t c = 0; c < cg; ++c)
        for (std::size_t oc = o0; oc < o0 + on; ++oc) {
          o[(rs * kg + oc) * cg + c] = convert_elem<S>(w[((g * kg + oc) * cg + c) * rs_n + rs], 1.0f, false);
        }
  }
};

template <class S, class T, class Dev>
S* conv_pack_filter(Dev& dev, const conv_geom& g, const T* w, bool for_data_grad) {
  const std::size_t n = mul_checked(g.fil().size(), sizeof(S), "conv packed filter");
  S* p = static_cast<S*>(dev.allocate(std::max<std::size_t>(n, 1)));
  try {
    using P = conv_pack_filter_program<T, S>;
    gemm_run(dev, grid{g.groups, ceil_div(g.kg, P::OB)}, P{w, p, g.kg, g.cg, g.kh, g.kw, for_data_grad}, double(g.fil().size()) * 8.0);
  } catch (...) {
    dev.deallocate(p);
    throw;
  }
  return p;
}

// Packs the per-group (K,N) matrices of conv_pack_filter into the program's (KC,NB) panel tiles
// with GEMM's own B load, block (g, nb, k) writing tile (g, nb, k): the tile a block of
// conv_gemm_program would pack for itself, so a prepacked filter gives the same bits.
template <class S, bool Narrow = false>
struct conv_panel_pack_program {
  using cfg = gemm_config<S, S, false, Narrow>;
  using b_stage = staged<S, cfg::KC, cfg::NB, typename cfg::b_layout>;
  static constexpr std::size_t KC = cfg::KC, NB = cfg::NB;
  conv_matrix<S> b;
  S* out;
  std::size_t nblocks, nk;
  kernel_cost cost(const grid& gr) const { return {0.0, double(gr.size()) * double(b_stage::elements) * 2.0 * sizeof(S), math_precision::f32}; }
  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t g = idx[0], nb = idx[1], k = idx[2], k0 = k * KC, kv = std::min(KC, b.rows - k0), n0 = nb * NB,
                      cols = std::min(NB, b.cols - n0);
    b_stage bk(out + ((g * nblocks + nb) * nk + k) * b_stage::elements);  // (KC,NB)
    load(b.view(g).template tile_at<KC, NB>(k0, n0), bk, tile_extent{kv, cols});
  }
};

// The same tiles straight from the OIHW filter in one pass (no (K,N) matrix in between; used by
// conv2d_packed_filter — per call, the two-pass pack measured faster: bf16 n=1 512@7x7 147 vs 114
// GFLOP/s, the element-wise panel writes of bf16 pairs being slow): element
// (k, n) of tile (g, nb, kc), k = kc·KC + kk = (r·KW + s)·cg + c, n = nb·NB + nn, is
// W[g·kg + n][c][r][s] at the b_layout's offset, zero beyond the filter. Writes run in panel order;
// one output channel's filter row is read per column.
template <class T, class S, bool Narrow = false>
struct conv_panel_direct_pack_program {
  using cfg = gemm_config<S, S, false, Narrow>;
  using b_layout = typename cfg::b_layout;
  using b_stage = staged<S, cfg::KC, cfg::NB, b_layout>;
  static constexpr std::size_t KC = cfg::KC, NB = cfg::NB;
  const T* w;
  S* out;
  std::size_t kg, cg, rs_n, nblocks, nk;
  kernel_cost cost(const grid& gr) const {  // the tiles written, the groups' filters read once
    const double groups = double(gr.size()) / double(std::max<std::size_t>(1, nblocks * nk));
    return {0.0, double(gr.size()) * double(b_stage::elements) * sizeof(S) + groups * double(kg * cg * rs_n) * sizeof(T), math_precision::f32};
  }
  void operator()(block_ctx& ctx) const {
    const auto idx = ctx.block_index3();
    const std::size_t g = idx[0], nb = idx[1], kc = idx[2], K = cg * rs_n, k0 = kc * KC, kv = std::min(KC, K - k0), n0 = nb * NB,
                      cols = std::min(NB, kg - n0);
    S* t = out + ((g * nblocks + nb) * nk + kc) * b_stage::elements;
    std::fill_n(t, b_stage::elements, zero_elem<S>());
    for (std::size_t nn = 0; nn < cols; ++nn) {
      const T* row = w + (g * kg + n0 + nn) * K;  // the filter of one output channel, (c, r, s)
      std::size_t rs = k0 / cg, c = k0 % cg;
      for (std::size_t kk = 0; kk < kv; ++kk) {
        t[b_layout::offset(kk, nn, KC, NB)] = convert_elem<S>(row[c * rs_n + rs], 1.0f, false);
        if (++c == cg) c = 0, ++rs;
      }
    }
  }
};

}  // namespace detail

inline namespace v0 {

// What a conv2d does (declared before it runs, as every operator): 2·N·OH·OW·O·(C/groups)·KH·KW
// FLOPs and the bytes of x, w and y once each; the launch's precision is the input's.
template <conv_element T, conv_element TY = float>
kernel_cost conv2d_cost(const image_dims& x, const filter_dims& f, const conv2d_params& p) {
  const auto g = detail::conv_geometry(x, f, p);
  kernel_cost c;
  c.flops = 2.0 * double(g.pixels()) * double(g.k) * double(g.depth());
  c.bytes = double(g.in().size()) * sizeof(T) + double(g.fil().size()) * sizeof(T) + double(g.out().size()) * sizeof(TY);
  c.precision = detail::conv_precision<T>();
  return c;
}

// y = conv2d(x, w) + bias, then `ep` (the epilogue sees row = output pixel n·OH·OW + oh·OW + ow and
// column = output channel; conv_residual adds a residual in either layout). x is (N, C, H, W) and y
// (N, O, OH, OW) in the layout of p; w is OIHW (O, C/groups, KH, KW); bias has O values or none.
// A 1x1, stride-1, unpadded NHWC convolution without groups is a GEMM and runs as one.
template <class Dev, conv_element T, conv_element TY, class Chain = epilogue::chain<>>
void conv2d(Dev& dev, image<const T> x, filter<const T> w, std::span<const float> bias, image<TY> y, const conv2d_params& p, const Chain& ep = {}) {
  const auto g = detail::conv_geometry(x.dims, w.dims, p);
  detail::conv_check(y.dims == g.out(), [&] {
    return "output " + detail::dims_str(y.dims) + " does not match input " + detail::dims_str(x.dims) + " and filter " + detail::dims_str(w.dims) +
           ", which give " + detail::dims_str(g.out());
  });
  detail::conv_check(bias.empty() || bias.size() == g.k,
                     [&] { return "bias has " + std::to_string(bias.size()) + " values for " + std::to_string(g.k) + " output channels"; });
  detail::conv_check_buffer("x", x.data, x.dims.size());
  detail::conv_check_buffer("w", w.data, w.dims.size());
  detail::conv_check_buffer("y", y.data, y.dims.size());
  if (g.pixels() == 0) return;
  const auto chain = epilogue::detail::as_chain<Chain>::make(ep);
  const auto work = conv2d_cost<T, TY>(x.dims, w.dims, p);
  auto launch = [&](const auto& ch) {
    if (g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.pt == 0 && g.pl == 0 && g.oh == g.h && g.ow == g.w && g.groups == 1 &&
        p.layout == conv_layout::nhwc) {
      // 1x1: y(pixels, O) = x(pixels, C) · wᵀ, w being (O, C) row-major
      gemm(dev, tensor<const T, 2>::strided(x.data, g.pixels(), g.c, g.c, 1), tensor<const T, 2>::strided(w.data, g.c, g.k, 1, g.c),
           tensor<TY, 2>::strided(y.data, g.pixels(), g.k, g.k, 1), 1.0f, 0.0f, ch);
      return;
    }
    using S = typename mma_traits<T>::stage_type;
    if constexpr (std::is_same_v<S, T> && std::is_same_v<TY, float>) {
      if (detail::conv_use_channel_rows<T, TY>(g)) {
        if (g.kh * g.kw == 1)  // the 1x1 OIHW filter is the OHWI matrix
          return detail::conv_channel_rows_run<S>(dev, g, x.data, w.data, y.data, ch, work);
        S* wp = detail::conv_pack_filter<S>(dev, g, w.data, false);
        const detail::device_workspace<Dev> guard{dev, wp};
        return detail::conv_channel_rows_run<S>(dev, g, x.data, static_cast<const S*>(wp), y.data, ch, work);
      }
    }
    const detail::conv_gather<T> a{x.data, g.layout, g.c, g.h, g.w, g.oh, g.ow, g.cg, g.kh, g.kw, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, false};
    const detail::conv_image_out<TY> out{y.data, g.layout, g.k, g.oh * g.ow, g.kg};
    if constexpr (std::is_same_v<S, T>) {  // without a conversion to the stage type (bf16 stages in f32 without AVX512-BF16)
      if (g.kh * g.kw == 1) {              // a 1x1 OIHW filter is already OHWI: B is the filter itself, transposed
        const detail::conv_matrix<S> b{w.data, g.depth(), g.kg, true};
        return detail::conv_gemm_run<S>(dev, g.pixels(), g.kg, g.depth(), g.groups, a, b, out, ch, work, "conv2d");
      }
    }
    S* wp = detail::conv_pack_filter<S>(dev, g, w.data, false);
    const detail::device_workspace<Dev> guard{dev, wp};
    const detail::conv_matrix<S> b{wp, g.depth(), g.kg, true};
    detail::conv_gemm_run<S>(dev, g.pixels(), g.kg, g.depth(), g.groups, a, b, out, ch, work, "conv2d");
  };
  if (bias.empty())
    launch(chain);
  else
    launch(epilogue::bias(bias) | chain);
}

// A forward filter packed once into the implicit GEMM's B panel tiles (the layout the atoms read),
// for repeated conv2d calls with the same weights (inference): a call then neither transposes nor
// packs the filter, which on deep layers with few output pixels (512 channels at 7x7: a 9 MiB
// filter against 49 rows) is most of the work. Owns device memory; move-only. conv2d with it gives
// the bits of conv2d with the plain filter, except for the NHWC 1x1 GEMM shortcut that the plain
// call takes (the packed call stays on the implicit GEMM).
template <conv_element T, class Dev>
class conv2d_packed_filter {
 public:
  using stage = typename mma_traits<T>::stage_type;
  conv2d_packed_filter(Dev& dev, filter<const T> w, std::size_t groups) : dev_(&dev), dims_(w.dims), groups_(groups) {
    detail::conv_check(groups >= 1 && w.dims.out % groups == 0, [&] {
      return "packed filter: groups " + std::to_string(groups) + " must divide the output channels " + std::to_string(w.dims.out);
    });
    detail::conv_check(w.dims.in >= 1 && w.dims.kh >= 1 && w.dims.kw >= 1, [&] { return "packed filter: empty filter " + detail::dims_str(w.dims); });
    detail::conv_check_buffer("w", w.data, w.dims.size());
    conv2d_params p;
    p.groups = groups;
    const auto g = detail::conv_geometry({1, w.dims.in * groups, w.dims.kh, w.dims.kw}, w.dims, p);  // any image the kernel fits
    narrow_ = detail::conv_narrow<stage>(g.kg);  // the atom conv2d picks for these output channels
    if constexpr (detail::conv_has_narrow<stage>)
      if (narrow_) {
        pack<true>(dev, w.data, g);
        return;
      }
    pack<false>(dev, w.data, g);
  }
  conv2d_packed_filter(conv2d_packed_filter&& o) noexcept
      : dev_(o.dev_),
        p_(std::exchange(o.p_, nullptr)),
        dims_(o.dims_),
        groups_(o.groups_),
        nblocks_(o.nblocks_),
        nk_(o.nk_),
        tile_(o.tile_),
        narrow_(o.narrow_) {}
  conv2d_packed_filter& operator=(conv2d_packed_filter&& o) noexcept {
    if (this != &o) {
      release();
      dev_ = o.dev_, p_ = std::exchange(o.p_, nullptr), dims_ = o.dims_, groups_ = o.groups_, nblocks_ = o.nblocks_, nk_ = o.nk_;
      tile_ = o.tile_, narrow_ = o.narrow_;
    }
    return *this;
  }
  conv2d_packed_filter(const conv2d_packed_filter&) = delete;
  conv2d_packed_filter& operator=(const conv2d_packed_filter&) = delete;
  ~conv2d_packed_filter() { release(); }

  const filter_dims& dims() const { return dims_; }
  std::size_t groups() const { return groups_; }
  detail::conv_panels<stage> panels() const { return {p_, nblocks_, nk_, tile_, narrow_}; }

 private:
  template <bool Narrow>
  void pack(Dev& dev, const T* w, const detail::conv_geom& g) {
    using D = detail::conv_panel_direct_pack_program<T, stage, Narrow>;
    nblocks_ = ceil_div(g.kg, D::NB);
    nk_ = ceil_div(g.depth(), D::KC);
    tile_ = D::b_stage::elements;
    const std::size_t n = detail::mul_checked(detail::mul_checked(detail::mul_checked(g.groups, nblocks_, "packed filter"), nk_, "packed filter"),
                                              detail::mul_checked(tile_, sizeof(stage), "packed filter"), "packed filter");
    p_ = static_cast<stage*>(dev.allocate(n));
    try {
      detail::gemm_run(dev, grid{g.groups, nblocks_, nk_}, D{w, p_, g.kg, g.cg, g.kh * g.kw, nblocks_, nk_}, double(n));
    } catch (...) {
      dev.deallocate(p_);
      p_ = nullptr;
      throw;
    }
  }
  void release() {
    if (!p_) return;
    dev_->synchronize();
    dev_->deallocate(p_);
    p_ = nullptr;
  }
  Dev* dev_;
  stage* p_ = nullptr;
  filter_dims dims_;
  std::size_t groups_, nblocks_ = 0, nk_ = 0, tile_ = 0;
  bool narrow_ = false;
};

// conv2d with a prepacked filter (its groups must be p.groups); otherwise as conv2d above.
template <class Dev, conv_element T, conv_element TY, class Chain = epilogue::chain<>>
void conv2d(Dev& dev, image<const T> x, const conv2d_packed_filter<T, Dev>& w, std::span<const float> bias, image<TY> y, const conv2d_params& p,
            const Chain& ep = {}) {
  detail::conv_check(w.groups() == p.groups, [&] {
    return "packed filter was packed for " + std::to_string(w.groups()) + " groups, the convolution has " + std::to_string(p.groups);
  });
  const auto g = detail::conv_geometry(x.dims, w.dims(), p);
  detail::conv_check(y.dims == g.out(), [&] {
    return "output " + detail::dims_str(y.dims) + " does not match input " + detail::dims_str(x.dims) + " and filter " + detail::dims_str(w.dims()) +
           ", which give " + detail::dims_str(g.out());
  });
  detail::conv_check(bias.empty() || bias.size() == g.k,
                     [&] { return "bias has " + std::to_string(bias.size()) + " values for " + std::to_string(g.k) + " output channels"; });
  detail::conv_check_buffer("x", x.data, x.dims.size());
  detail::conv_check_buffer("y", y.data, y.dims.size());
  if (g.pixels() == 0) return;
  const auto chain = epilogue::detail::as_chain<Chain>::make(ep);
  const auto work = conv2d_cost<T, TY>(x.dims, w.dims(), p);
  using S = typename mma_traits<T>::stage_type;
  if constexpr (std::is_same_v<S, T> && std::is_same_v<TY, float>) {
    if (detail::conv_use_channel_rows<T, TY>(g)) {
      if (bias.empty())
        detail::conv_channel_rows_run<S>(dev, g, x.data, w.panels(), y.data, chain, work);
      else
        detail::conv_channel_rows_run<S>(dev, g, x.data, w.panels(), y.data, epilogue::bias(bias) | chain, work);
      return;
    }
  }
  const detail::conv_gather<T> a{x.data, g.layout, g.c, g.h, g.w, g.oh, g.ow, g.cg, g.kh, g.kw, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, false};
  const detail::conv_image_out<TY> out{y.data, g.layout, g.k, g.oh * g.ow, g.kg};
  if (bias.empty())
    detail::conv_gemm_run<S>(dev, g.pixels(), g.kg, g.depth(), g.groups, a, w.panels(), out, chain, work, "conv2d");
  else
    detail::conv_gemm_run<S>(dev, g.pixels(), g.kg, g.depth(), g.groups, a, w.panels(), out, epilogue::bias(bias) | chain, work, "conv2d");
}

// The data gradient: dx = conv2d's transpose applied to dy (same params; dx is (N, C, H, W)). An
// implicit GEMM over the input pixels whose A gathers dy at (ih + pad − r·dil) / stride.
template <class Dev, conv_element T, conv_element TX>
void conv2d_backward_data(Dev& dev, image<const T> dy, filter<const T> w, image<TX> dx, const conv2d_params& p) {
  const auto g = detail::conv_geometry(dx.dims, w.dims, p);
  detail::conv_check(dy.dims == g.out(), [&] {
    return "output gradient " + detail::dims_str(dy.dims) + " does not match input " + detail::dims_str(dx.dims) + " and filter " +
           detail::dims_str(w.dims) + ", which give " + detail::dims_str(g.out());
  });
  detail::conv_check_buffer("dy", dy.data, dy.dims.size());
  detail::conv_check_buffer("w", w.data, w.dims.size());
  detail::conv_check_buffer("dx", dx.data, dx.dims.size());
  if (g.n == 0) return;
  using S = typename mma_traits<T>::stage_type;
  S* wp = detail::conv_pack_filter<S>(dev, g, w.data, true);
  const detail::device_workspace<Dev> guard{dev, wp};
  const std::size_t K = g.kg * g.kh * g.kw, M = g.n * g.h * g.w;
  const detail::conv_gather<T> a{dy.data, g.layout, g.k, g.oh, g.ow, g.h, g.w, g.kg, g.kh, g.kw, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, true};
  const detail::conv_matrix<S> b{wp, K, g.cg};
  const detail::conv_image_out<TX> out{dx.data, g.layout, g.c, g.h * g.w, g.cg};
  kernel_cost work{2.0 * double(M) * double(g.c) * double(K),
                   double(g.out().size() + g.fil().size()) * sizeof(T) + double(g.in().size()) * sizeof(TX), detail::conv_precision<T>()};
  detail::conv_gemm_run<S>(dev, M, g.cg, K, g.groups, a, b, out, epilogue::chain<>{}, work, "conv2d_backward_data");
}

// The weight gradient: dw(o, c, r, s) = Σ over pixels dy(o) · x(c at the pixel's tap (r, s)); dw is
// f32 OIHW. An implicit GEMM (O/groups, C/groups·KH·KW) whose depth is the N·OH·OW output pixels.
template <class Dev, conv_element T>
void conv2d_backward_weight(Dev& dev, image<const T> x, image<const T> dy, filter<float> dw, const conv2d_params& p) {
  const auto g = detail::conv_geometry(x.dims, dw.dims, p);
  detail::conv_check(dy.dims == g.out(), [&] {
    return "output gradient " + detail::dims_str(dy.dims) + " does not match input " + detail::dims_str(x.dims) + " and filter " +
           detail::dims_str(dw.dims) + ", which give " + detail::dims_str(g.out());
  });
  detail::conv_check_buffer("x", x.data, x.dims.size());
  detail::conv_check_buffer("dy", dy.data, dy.dims.size());
  detail::conv_check_buffer("dw", dw.data, dw.dims.size());
  if (g.pixels() == 0) {
    std::fill_n(dw.data, dw.dims.size(), 0.0f);
    return;
  }
  using S = typename mma_traits<T>::stage_type;
  const detail::conv_channel_rows<T> a{dy.data, g.layout, g.k, g.oh * g.ow, g.kg};
  const detail::conv_gather<T> b{x.data, g.layout, g.c, g.h, g.w, g.oh, g.ow, g.cg, g.kh, g.kw, g.sh, g.sw, g.pt, g.pl, g.dh, g.dw, false};
  const detail::conv_filter_out out{dw.data, g.kg, g.cg, g.kh, g.kw};
  kernel_cost work{2.0 * double(g.pixels()) * double(g.k) * double(g.depth()),
                   double(g.in().size() + g.out().size()) * sizeof(T) + double(g.fil().size()) * sizeof(float), detail::conv_precision<T>()};
  detail::conv_gemm_run<S>(dev, g.kg, g.depth(), g.pixels(), g.groups, a, b, out, epilogue::chain<>{}, work, "conv2d_backward_weight");
}

}  // namespace v0

namespace detail {
// db[o] = Σ over pixels dy(o): block b owns channels [64b, 64b + 64), summed in pixel order.
template <class T>
struct conv_bias_grad_program {
  const T* dy;
  float* db;
  image_dims d;
  conv_layout layout;
  static constexpr std::size_t CB = 64;
  kernel_cost cost(const grid&) const { return {double(d.size()), double(d.size()) * sizeof(T), math_precision::f32}; }
  void operator()(block_ctx& ctx) const {
    const std::size_t c0 = ctx.block_index3()[0] * CB, nc = std::min(CB, d.c - c0), plane = d.h * d.w;
    float s[CB] = {};
    for (std::size_t img = 0; img < d.n; ++img) {
      if (layout == conv_layout::nhwc) {
        for (std::size_t q = 0; q < plane; ++q) {
          const T* p = dy + (img * plane + q) * d.c + c0;
          for (std::size_t j = 0; j < nc; ++j) s[j] += arch::to_f32(p[j]);
        }
      } else {
        for (std::size_t j = 0; j < nc; ++j) {
          const T* p = dy + (img * d.c + c0 + j) * plane;
          for (std::size_t q = 0; q < plane; ++q) s[j] += arch::to_f32(p[q]);
        }
      }
    }
    std::copy_n(s, nc, db + c0);
  }
};
}  // namespace detail

inline namespace v0 {
// The bias gradient: db[o] = Σ_{n, oh, ow} dy(n, o, oh, ow), in f32, in pixel order.
template <class Dev, conv_element T>
void conv2d_backward_bias(Dev& dev, image<const T> dy, std::span<float> db, conv_layout layout) {
  detail::conv_check(db.size() == dy.dims.c,
                     [&] { return "bias gradient has " + std::to_string(db.size()) + " values for " + std::to_string(dy.dims.c) + " channels"; });
  detail::conv_check_buffer("dy", dy.data, dy.dims.size());
  if (dy.dims.c == 0) return;
  using P = detail::conv_bias_grad_program<T>;
  detail::gemm_run(dev, grid{ceil_div(dy.dims.c, P::CB)}, P{dy.data, db.data(), dy.dims, layout}, double(dy.dims.size()));
}

// Folds an inference batch norm y = γ·(z − μ)/√(σ² + ε) + β after a convolution z = w∗x + b into the
// convolution: w'(o) = w(o)·γ_o/√(σ²_o + ε), b'_o = (b_o − μ_o)·γ_o/√(σ²_o + ε) + β_o (b empty: 0).
// w and bias_out are written in place of / next to the caller's f32 filter.
inline void fold_batchnorm(filter<float> w, std::span<const float> bias, std::span<const float> gamma, std::span<const float> beta,
                           std::span<const float> mean, std::span<const float> var, float eps, std::span<float> bias_out) {
  const std::size_t o = w.dims.out;
  detail::conv_check(
      gamma.size() == o && beta.size() == o && mean.size() == o && var.size() == o && bias_out.size() == o && (bias.empty() || bias.size() == o),
      [&] { return "fold_batchnorm: every per-channel vector needs " + std::to_string(o) + " values (the filter's output channels)"; });
  detail::conv_check(eps >= 0.0f, [] { return std::string("fold_batchnorm: eps must be non-negative"); });
  detail::conv_check_buffer("w", w.data, w.dims.size());
  const std::size_t per = w.dims.in * w.dims.kh * w.dims.kw;
  for (std::size_t c = 0; c < o; ++c) {
    detail::conv_check(var[c] + eps > 0.0f, [&] { return "fold_batchnorm: variance + eps of channel " + std::to_string(c) + " is not positive"; });
    const double sc = double(gamma[c]) / std::sqrt(double(var[c]) + double(eps));
    for (std::size_t i = 0; i < per; ++i) w.data[c * per + i] = static_cast<float>(double(w.data[c * per + i]) * sc);
    bias_out[c] = static_cast<float>(((bias.empty() ? 0.0 : double(bias[c])) - double(mean[c])) * sc + double(beta[c]));
  }
}

}  // namespace v0
}  // namespace tessel
