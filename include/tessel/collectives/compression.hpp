// Compressed all-reduce: contributions travel as BF16, E4M3, E5M2 (one power-of-two scale per chunk)
// or INT4 (one FP32 scale amax/7 per chunk), are decoded and reduced in FP32 in rank order by the
// block owner, and the result travels back compressed the same way. Optional error feedback keeps
// each quantization residual and adds it to the next call's data (error-compensated quantization),
// so the running sum of compressed all-reduces tracks the exact running sum.
//
// Error bound per element (no feedback), with u and eta of the wire format (table below), s_r the
// scale of rank r's chunk, s_y the scale of the result's chunk, and y_hat the FP32 sum:
//   |out - sum_r x_r| <= sum_r d(x_r, s_r) + gamma_{n-1} * sum_r |x_r| (1 + u) + d(y_hat, s_y)
//   d(x, s) = max(u |x|, eta s)   (bf16/e4m3/e5m2: RNE of x/s, exact power-of-two scaling)
//   d(x, s) = s / 2 + 2^-22 |x|   (int4: round(x/s) in [-7, 7], FP32 scale)
//   gamma_k = k 2^-24 / (1 - k 2^-24)
// format: bf16 u = 2^-8, eta = 2^-134 (s = 1: BF16's half subnormal step, binding below 2^-126);
// e4m3 u = 2^-4, eta = 2^-10; e5m2 u = 2^-3, eta = 2^-17. Scales are never below 2^-126.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <tessel/collectives/errors.hpp>
#include <tessel/collectives/communicator.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp8.hpp>

namespace tessel {
inline namespace v0 {

enum class wire_format : std::uint8_t { none, bf16, e4m3, e5m2, int4 };

constexpr std::string_view wire_format_name(wire_format f) {
  switch (f) {
    case wire_format::none: return "none";
    case wire_format::bf16: return "bf16";
    case wire_format::e4m3: return "e4m3";
    case wire_format::e5m2: return "e5m2";
    case wire_format::int4: return "int4";
  }
  throw comm_error(errc::invalid_argument, "invalid wire_format value");
}
inline wire_format wire_format_from_name(std::string_view s) {
  for (auto f : {wire_format::none, wire_format::bf16, wire_format::e4m3, wire_format::e5m2, wire_format::int4})
    if (wire_format_name(f) == s) return f;
  throw comm_error(errc::invalid_argument, "unknown wire format '" + std::string(s) + "'");
}

struct compression_options {
  wire_format format = wire_format::bf16;
  std::size_t chunk = 256;  // elements per scale
};

// Quantization residuals of one rank for one buffer shape: keep it across calls.
class error_feedback {
 public:
  error_feedback() = default;
  std::span<const float> send_residual() const { return send_; }
  std::span<const float> result_residual() const { return recv_; }
  float max_abs() const {
    float m = 0;
    for (float v : send_) m = std::max(m, std::fabs(v));
    for (float v : recv_) m = std::max(m, std::fabs(v));
    return m;
  }

 private:
  friend struct compression_impl;
  std::vector<float> send_, recv_;
  std::size_t count_ = 0;
  int ranks_ = 0;
};

struct compression_stats {
  std::size_t bytes_sent = 0;         // by this rank, both phases
  double wire_bytes_per_element = 0;  // bytes on the wire per reduced element (both phases, this rank)
};

// Per-format constants of the bound in the header comment.
struct wire_params {
  double u, eta, max;
  std::size_t bits;
};
constexpr wire_params wire_params_of(wire_format f) {
  switch (f) {
    case wire_format::bf16: return {0x1p-8, 0x1p-134, 3.3895313892515355e38, 16};
    case wire_format::e4m3: return {0x1p-4, 0x1p-10, 448.0, 8};
    case wire_format::e5m2: return {0x1p-3, 0x1p-17, 57344.0, 8};
    case wire_format::int4: return {0, 0.5, 7.0, 4};
    default: return {0, 0, 0, 32};
  }
}

// Bytes of one encoded run of n elements in chunks of `chunk`.
inline std::size_t wire_bytes(wire_format f, std::size_t n, std::size_t chunk) {
  const std::size_t chunks = (n + chunk - 1) / chunk;
  return chunks * 4 + (n * wire_params_of(f).bits + 7) / 8;
}

// The scale of one chunk (what encode uses), exposed so tests can evaluate the bound.
inline float chunk_scale(wire_format f, const float* x, std::size_t n) {
  float amax = 0;
  for (std::size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0 || !std::isfinite(amax)) return 1.0f;
  // BF16 has FP32's exponent range: it needs no scale (one of amax / max(bf16) would be below
  // FP32's smallest subnormal, i.e. 0, for chunks under ~2.4e-7, and x / 0 is no code at all).
  if (f == wire_format::bf16) return 1.0f;
  // never below the smallest normal float, so that x / s and q * s stay finite and exact for tiny
  // chunks (their codes round towards 0 instead, within the bound's eta * s)
  constexpr float min_scale = 0x1p-126f;
  if (f == wire_format::int4) return std::max(amax / 7.0f, min_scale);
  // power of two >= amax / max: scaling is then exact
  const double want = static_cast<double>(amax) / wire_params_of(f).max;
  return std::max(static_cast<float>(std::exp2(std::ceil(std::log2(want)))), min_scale);
}

template <class T>
struct is_wire_float : std::bool_constant<std::is_same_v<T, tessel::bf16> || std::is_same_v<T, tessel::e4m3> || std::is_same_v<T, tessel::e5m2>> {};
// The element type of a float wire format, as a dtype (for detail::visit_dtype_if).
inline dtype wire_dtype(wire_format f) {
  switch (f) {
    case wire_format::bf16: return dtype::bf16;
    case wire_format::e4m3: return dtype::e4m3;
    case wire_format::e5m2: return dtype::e5m2;
    default: throw comm_error(errc::invalid_argument, "wire format " + std::string(wire_format_name(f)) + " has no float element type");
  }
}

struct compression_impl {
  // Encodes n floats into out (wire_bytes(f, n, chunk) bytes); writes x - decoded into resid if given.
  static void encode(wire_format f, std::size_t chunk, const float* x, std::size_t n, std::byte* out, float* resid) {
    const std::size_t chunks = (n + chunk - 1) / chunk;
    std::byte* codes = out + chunks * 4;
    // per chunk: scale, then codes; the format is dispatched once, outside the element loop
    auto each_chunk = [&](auto&& code_one) {
      for (std::size_t k = 0; k < chunks; ++k) {
        const std::size_t lo = k * chunk, len = std::min(chunk, n - lo);
        const float s = chunk_scale(f, x + lo, len);
        std::memcpy(out + k * 4, &s, 4);
        for (std::size_t i = lo; i < lo + len; ++i) {
          const float dec = code_one(i, x[i] / s) * s;
          if (resid) resid[i] = x[i] - dec;
        }
      }
    };
    if (f == wire_format::int4) {  // two per byte, low nibble first
      return each_chunk([&](std::size_t i, float v) {
        const int q = static_cast<int>(std::clamp(std::nearbyint(v), -7.0f, 7.0f));
        auto& byte = reinterpret_cast<unsigned char&>(codes[i / 2]);
        if (i % 2 == 0)
          byte = static_cast<unsigned char>(q & 0xF);
        else
          byte = static_cast<unsigned char>(byte | ((q & 0xF) << 4));
        return static_cast<float>(q);
      });
    }
    detail::visit_dtype_if<is_wire_float, tessel::bf16>(wire_dtype(f), "is not a wire format", [&]<class Q>(std::type_identity<Q>) {
      each_chunk([&](std::size_t i, float v) {
        const Q q(v);
        const auto b = q.bits();
        std::memcpy(codes + i * sizeof b, &b, sizeof b);
        return static_cast<float>(q);
      });
    });
  }
  static void decode(wire_format f, std::size_t chunk, const std::byte* in, std::size_t n, float* out) {
    const std::size_t chunks = (n + chunk - 1) / chunk;
    const std::byte* codes = in + chunks * 4;
    auto each_chunk = [&](auto&& value_of) {
      for (std::size_t k = 0; k < chunks; ++k) {
        const std::size_t lo = k * chunk, len = std::min(chunk, n - lo);
        float s;
        std::memcpy(&s, in + k * 4, 4);
        for (std::size_t i = lo; i < lo + len; ++i) out[i] = value_of(i) * s;
      }
    };
    if (f == wire_format::int4) {
      return each_chunk([&](std::size_t i) {
        const unsigned byte = static_cast<unsigned char>(codes[i / 2]);
        int q = static_cast<int>(i % 2 == 0 ? (byte & 0xF) : (byte >> 4));
        if (q >= 8) q -= 16;
        return static_cast<float>(q);
      });
    }
    detail::visit_dtype_if<is_wire_float, tessel::bf16>(wire_dtype(f), "is not a wire format", [&]<class Q>(std::type_identity<Q>) {
      each_chunk([&](std::size_t i) {
        decltype(Q{}.bits()) b;
        std::memcpy(&b, codes + i * sizeof b, sizeof b);
        return static_cast<float>(Q::from_bits(b));
      });
    });
  }
  static std::vector<float>& send_res(error_feedback& e) { return e.send_; }
  static std::vector<float>& recv_res(error_feedback& e) { return e.recv_; }
  static void shape(error_feedback& e, std::size_t count, int n, std::size_t block) {
    if (e.count_ == 0 && e.ranks_ == 0) {
      e.count_ = count;
      e.ranks_ = n;
      e.send_.assign(count, 0.0f);
      e.recv_.assign(block, 0.0f);
    } else if (e.count_ != count || e.ranks_ != n || e.recv_.size() != block) {
      throw comm_error(errc::invalid_argument, "all_reduce_compressed: error_feedback state belongs to another shape");
    }
  }
};

// all_reduce (sum or avg) of f32 data with compressed traffic. Deterministic (rank-order FP32 sums).
// In place when send.data() == recv.data(). `ef` (optional) carries residuals between calls.
inline compression_stats all_reduce_compressed(communicator& comm, std::span<const float> send, std::span<float> recv, reduce_op op,
                                               compression_options opt = {}, error_feedback* ef = nullptr) {
  if (send.size() != recv.size()) throw comm_error(errc::invalid_argument, "all_reduce_compressed: send and recv sizes differ");
  if (op != reduce_op::sum && op != reduce_op::avg) throw comm_error(errc::invalid_argument, "all_reduce_compressed: only sum and avg are supported");
  if (opt.chunk == 0) throw comm_error(errc::invalid_argument, "all_reduce_compressed: chunk must be positive");
  if (opt.format == wire_format::none) {
    comm.all_reduce(send.data(), recv.data(), send.size(), dtype::f32, op);
    return {2 * send.size() * 4 * static_cast<std::size_t>(comm.size() - 1) / static_cast<std::size_t>(comm.size()),
            8.0 * (comm.size() - 1) / comm.size()};
  }
  if (opt.format > wire_format::int4) throw comm_error(errc::invalid_argument, "all_reduce_compressed: invalid wire format");
  if (send.data() != recv.data() && detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
    throw comm_error(errc::invalid_argument, "all_reduce_compressed: send and recv overlap but are not in place");
  compression_stats st;
  const std::size_t count = send.size();
  comm.run_collective(
      [&](detail::coll_ctx& c) {
        const int n = c.n, r = c.rank;
        const auto off = detail::even_blocks(count, n);
        const std::size_t m = off[r + 1] - off[r];
        if (ef) compression_impl::shape(*ef, count, n, m);
        // x' = x + residual (error feedback)
        std::vector<float> x(send.begin(), send.end());
        if (ef)
          for (std::size_t i = 0; i < count; ++i) x[i] += compression_impl::send_res(*ef)[i];
        // phase 1: encode block q for its owner q (our own block too, so every contribution is alike)
        std::vector<std::vector<std::byte>> enc(static_cast<std::size_t>(n));
        for (int q = 0; q < n; ++q) {
          const std::size_t len = off[q + 1] - off[q];
          enc[q].resize(wire_bytes(opt.format, len, opt.chunk));
          compression_impl::encode(opt.format, opt.chunk, x.data() + off[q], len, enc[q].data(),
                                   ef ? compression_impl::send_res(*ef).data() + off[q] : nullptr);
          if (q != r) {
            c.send(q, c.tag + 1, enc[q].data(), enc[q].size());
            st.bytes_sent += enc[q].size();
          }
        }
        // owner: decode every contribution, sum in rank order in FP32
        std::vector<float> acc(m), dec(m);
        const std::size_t eb = wire_bytes(opt.format, m, opt.chunk);
        for (int q = 0; q < n; ++q) {
          if (q == r)
            compression_impl::decode(opt.format, opt.chunk, enc[r].data(), m, dec.data());
          else {
            std::vector<std::byte> in(eb);
            c.tp.recv_into(q, c.tag + 1, in);
            compression_impl::decode(opt.format, opt.chunk, in.data(), m, dec.data());
          }
          if (q == 0)
            acc = dec;
          else
            for (std::size_t i = 0; i < m; ++i) acc[i] += dec[i];
        }
        if (op == reduce_op::avg)
          for (auto& v : acc) v /= static_cast<float>(n);
        c.wait_all();
        // phase 2: encode the result block once, send it to everyone, everyone (owner too) decodes it
        if (ef)
          for (std::size_t i = 0; i < m; ++i) acc[i] += compression_impl::recv_res(*ef)[i];
        std::vector<std::byte> res(eb);
        compression_impl::encode(opt.format, opt.chunk, acc.data(), m, res.data(), ef ? compression_impl::recv_res(*ef).data() : nullptr);
        for (int q = 0; q < n; ++q)
          if (q != r) {
            c.send(q, c.tag + 2, res.data(), res.size());
            st.bytes_sent += res.size();
          }
        compression_impl::decode(opt.format, opt.chunk, res.data(), m, recv.data() + off[r]);
        for (int q = 0; q < n; ++q)
          if (q != r) {
            const std::size_t len = off[q + 1] - off[q];
            std::vector<std::byte> in(wire_bytes(opt.format, len, opt.chunk));
            c.tp.recv_into(q, c.tag + 2, in);
            compression_impl::decode(opt.format, opt.chunk, in.data(), len, recv.data() + off[q]);
          }
        c.wait_all();
      },
      "all_reduce_compressed", static_cast<double>(count) * sizeof(float));
  st.wire_bytes_per_element = count ? static_cast<double>(st.bytes_sent) / static_cast<double>(count) : 0;
  return st;
}

}  // namespace v0
}  // namespace tessel
