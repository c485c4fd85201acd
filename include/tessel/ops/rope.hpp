// Rotary position embedding (Su et al. 2021) applied in place to x (tokens, heads·head_dim), as a
// row-streaming tile program. Pairs are (j, j + head_dim/2) (the GPT-NeoX/LLaMA "rotate half"
// layout) or (2j, 2j+1) (interleaved, GPT-J). Angles pos·theta^(-2j/head_dim) and their cos/sin
// are computed in double once per token, so large positions keep full accuracy. The backward is
// the inverse rotation.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <tessel/ops/detail/norm_rows.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/tensor.hpp>

namespace tessel {
inline namespace v0 {

struct rope_options {
  double theta = 10000.0;
  bool interleaved = false;
  // head_dim/2 frequencies replacing theta^(-2j/head_dim) (scaled RoPE: linear, Llama 3); empty: theta's.
  std::span<const double> inv_freq = {};
};

}  // namespace v0

namespace detail::rope {

namespace st = tessel::arch::stream;
using namespace tessel::detail::rows;

template <class T>
struct program {
  tensor<T, 2> x;
  const std::int64_t* pos;
  const double* inv_freq;  // head_dim / 2
  std::size_t head_dim, heads, rpb, rows;
  bool interleaved;
  float sign;  // +1 forward, -1 backward
  void operator()(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    const std::size_t half = head_dim / 2;
    float* cs = ctx.scratch().template allocate_array<float>(2 * half);
    float* sn = cs + half;
    for (std::size_t r = r0; r < r1; ++r) {
      for (std::size_t j = 0; j < half; ++j) {
        const double a = double(pos[r]) * inv_freq[j];
        cs[j] = float(std::cos(a));
        sn[j] = sign * float(std::sin(a));
      }
      T* row = &x(r, 0);
      for (std::size_t h = 0; h < heads; ++h) {
        T* v = row + h * head_dim;
        if (interleaved) {
          for (std::size_t j = 0; j < half; ++j) {
            const float a = load1(v, 2 * j), b = load1(v, 2 * j + 1);
            store1(v, 2 * j, st::fma(a, cs[j], -(b * sn[j])));
            store1(v, 2 * j + 1, st::fma(a, sn[j], b * cs[j]));
          }
        } else {
          T* w = v + half;
          for_lanes(half, [&](std::size_t j, auto v0) {
            using V = decltype(v0);
            const V a = typed_load<T, V>(v, j), b = typed_load<T, V>(w, j), c = lanes_load<V>(cs, j), s = lanes_load<V>(sn, j);
            typed_store<T, V>(v, j, st::fma(a, c, -(b * s)));
            typed_store<T, V>(w, j, st::fma(a, s, b * c));
          });
        }
      }
    }
  }
};

template <class Dev, class T>
void apply(Dev& dev, tensor<T, 2> x, std::size_t head_dim, std::span<const std::int64_t> positions, const rope_options& o, float sign,
           const char* who) {
  static_assert(row_io_type<T> && !std::is_const_v<T>, "tessel rope: x must be a mutable f32 or bf16 tensor");
  const std::string W = who;
  const std::size_t rows = x.rows(), n = x.cols();
  check_rows<layer_error>(x, rows, n, W + ": x");
  require<layer_error>(head_dim > 0 && head_dim % 2 == 0, W + ": head_dim must be positive and even, got " + std::to_string(head_dim));
  require<layer_error>(n % head_dim == 0, W + ": row length " + std::to_string(n) + " is not a multiple of head_dim " + std::to_string(head_dim));
  require<layer_error>(positions.size() == rows, W + ": " + std::to_string(positions.size()) + " positions for " + std::to_string(rows) + " tokens");
  require<layer_error>(std::isfinite(o.theta) && o.theta > 0.0, W + ": theta must be positive and finite");
  if (rows == 0 || n == 0) return;
  require<layer_error>(
      o.inv_freq.empty() || o.inv_freq.size() == head_dim / 2,
      W + ": " + std::to_string(o.inv_freq.size()) + " frequencies given for head_dim " + std::to_string(head_dim) + " (need head_dim/2)");
  std::vector<double> inv_freq(head_dim / 2);
  for (std::size_t j = 0; j < inv_freq.size(); ++j)
    inv_freq[j] = o.inv_freq.empty() ? std::pow(o.theta, -2.0 * double(j) / double(head_dim)) : o.inv_freq[j];
  const std::size_t rpb = rows_per_block(rows, n);
  dev.launch(grid{(rows + rpb - 1) / rpb}, program<T>{x, positions.data(), inv_freq.data(), head_dim, n / head_dim, rpb, rows, o.interleaved, sign});
}

}  // namespace detail::rope

inline namespace v0 {

// x (tokens, heads·head_dim) <- RoPE(x) in place, token t at position positions[t].
template <class Dev, class T>
void rope_forward(Dev& dev, tensor<T, 2> x, std::size_t head_dim, std::span<const std::int64_t> positions, const rope_options& o = {}) {
  detail::rope::apply(dev, x, head_dim, positions, o, 1.0f, "rope_forward");
}
// dx <- RoPE^-1(dy) in place (the transpose of a rotation is its inverse).
template <class Dev, class T>
void rope_backward(Dev& dev, tensor<T, 2> dy, std::size_t head_dim, std::span<const std::int64_t> positions, const rope_options& o = {}) {
  detail::rope::apply(dev, dy, head_dim, positions, o, -1.0f, "rope_backward");
}

}  // namespace v0
}  // namespace tessel
