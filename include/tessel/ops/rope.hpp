// Rotary position embedding (Su et al. 2021) applied in place to x (tokens, heads·head_dim), as a
// row-streaming tile program. Pairs are (j, j + head_dim/2) (the GPT-NeoX/LLaMA "rotate half"
// layout) or (2j, 2j+1) (interleaved, GPT-J). Angles pos·theta^(-2j/head_dim) and their cos/sin
// are computed in double once per token, so large positions keep full accuracy, or read from a
// rope_table that holds the same float-rounded values (the same bits, without a sin and a cos per
// token and frequency on every call). The backward is the inverse rotation.
#pragma once

#include <algorithm>
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

class rope_table;

struct rope_options {
  double theta = 10000.0;
  bool interleaved = false;
  // head_dim/2 frequencies replacing theta^(-2j/head_dim) (scaled RoPE: linear, Llama 3); empty: theta's.
  std::span<const double> inv_freq = {};
  // cos/sin of the positions it covers (built for these frequencies and head_dim, or the call
  // throws); positions past it are computed. Read, never grown, by the call: rope_table::cover
  // first. Null: every call computes its own.
  const rope_table* table = nullptr;
};

}  // namespace v0

namespace detail::rope {

// the head_dim/2 frequencies of o (its own, or theta^(-2j/head_dim))
inline std::vector<double> frequencies(std::size_t head_dim, const rope_options& o) {
  std::vector<double> f(head_dim / 2);
  for (std::size_t j = 0; j < f.size(); ++j) f[j] = o.inv_freq.empty() ? std::pow(o.theta, -2.0 * double(j) / double(head_dim)) : o.inv_freq[j];
  return f;
}

// cos and sin of position p's angles p·f[j], rounded to float from double: the one place both the
// table and the op without one compute them, so the two give the same bits
inline void angles(std::int64_t p, const double* f, std::size_t half, float* cs, float* sn, float sign) {
  for (std::size_t j = 0; j < half; ++j) {
    const double a = double(p) * f[j];
    cs[j] = float(std::cos(a));
    sn[j] = sign * float(std::sin(a));
  }
}

}  // namespace detail::rope

inline namespace v0 {

// The cos and sin of every frequency at positions [0, positions()), grown on demand by cover(): a
// model builds one for its frequencies and passes it in rope_options::table, so its attention's
// four RoPE calls per layer and step read the values instead of computing them. At most
// max_bytes are held (default 16 MiB, 32768 positions at head_dim 128); positions past that are
// computed per call, as without a table.
class rope_table {
 public:
  rope_table() = default;
  explicit rope_table(std::size_t head_dim, const rope_options& o = {}, std::size_t max_bytes = std::size_t(16) << 20)
      : head_dim_(head_dim), freq_(check(head_dim, o)), max_bytes_(max_bytes) {}

  // Grow (to at least twice the positions held, within max_bytes) so every position of p that can
  // be held is.
  void cover(std::span<const std::int64_t> p) {
    const std::size_t half = head_dim_ / 2;
    if (half == 0 || p.empty()) return;
    std::int64_t hi = -1;
    for (std::int64_t x : p) hi = std::max(hi, x);
    const std::size_t row = 2 * half * sizeof(float), cap = max_bytes_ / row;
    if (hi < 0 || std::size_t(hi) < rows_ || rows_ >= cap) return;
    const std::size_t want = std::min(cap, std::max({std::size_t(hi) + 1, 2 * rows_, std::size_t(64)}));
    v_.resize(want * 2 * half);
    for (std::size_t r = rows_; r < want; ++r)
      detail::rope::angles(std::int64_t(r), freq_.data(), half, &v_[r * 2 * half], &v_[r * 2 * half + half], 1.0f);
    rows_ = want;
  }
  std::size_t positions() const { return rows_; }
  std::size_t head_dim() const { return head_dim_; }
  std::span<const double> frequencies() const { return freq_; }
  // position p's head_dim/2 cosines then head_dim/2 sines (p < positions())
  const float* row(std::size_t p) const { return v_.data() + p * head_dim_; }

 private:
  static std::vector<double> check(std::size_t head_dim, const rope_options& o) {
    using detail::rows::require;
    require<layer_error>(head_dim > 0 && head_dim % 2 == 0, "rope_table: head_dim must be positive and even, got " + std::to_string(head_dim));
    require<layer_error>(
        o.inv_freq.empty() || o.inv_freq.size() == head_dim / 2,
        "rope_table: " + std::to_string(o.inv_freq.size()) + " frequencies given for head_dim " + std::to_string(head_dim) + " (need head_dim/2)");
    require<layer_error>(std::isfinite(o.theta) && o.theta > 0.0, "rope_table: theta must be positive and finite");
    return detail::rope::frequencies(head_dim, o);
  }
  std::size_t head_dim_ = 0;
  std::vector<double> freq_;
  std::size_t max_bytes_ = 0, rows_ = 0;
  std::vector<float> v_;
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
  const float* table;      // rows of cos then sin, table_rows of them (null: none)
  std::size_t table_rows, head_dim, heads, rpb, rows;
  bool interleaved;
  float sign;  // +1 forward, -1 backward
  void operator()(block_ctx& ctx) const {
    const std::size_t r0 = ctx.block_linear() * rpb, r1 = std::min(rows, r0 + rpb);
    const std::size_t half = head_dim / 2;
    float* cs = ctx.scratch().template allocate_array<float>(2 * half);
    float* sn = cs + half;
    for (std::size_t r = r0; r < r1; ++r) {
      if (pos[r] >= 0 && std::uint64_t(pos[r]) < table_rows) {
        const float* t = table + std::size_t(pos[r]) * head_dim;
        for (std::size_t j = 0; j < half; ++j) {
          cs[j] = t[j];
          sn[j] = sign * t[half + j];
        }
      } else {
        angles(pos[r], inv_freq, half, cs, sn, sign);
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
  const std::vector<double> inv_freq = frequencies(head_dim, o);
  const float* table = nullptr;
  std::size_t table_rows = 0;
  if (o.table) {
    const auto tf = o.table->frequencies();
    require<layer_error>(o.table->head_dim() == head_dim && std::equal(tf.begin(), tf.end(), inv_freq.begin(), inv_freq.end()),
                         W + ": the rope_table was built for other frequencies or another head_dim (" + std::to_string(o.table->head_dim()) +
                             ", this call's " + std::to_string(head_dim) + ")");
    table = o.table->row(0);
    table_rows = o.table->positions();
  }
  const std::size_t rpb = rows_per_block(rows, n);
  dev.launch(grid{(rows + rpb - 1) / rpb},
             program<T>{x, positions.data(), inv_freq.data(), table, table_rows, head_dim, n / head_dim, rpb, rows, o.interleaved, sign});
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
