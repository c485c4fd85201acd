// Fused optimizer steps as streaming tile programs: AdamW (bias correction, AMSGrad), SGD
// (momentum, Nesterov) and Lion over a list of parameter tensors of mixed sizes in one launch.
// Parameters in f32, bf16, bf16 + f32 master, or bf16 + 16-bit remainders that rebuild the f32
// master exactly; state in f32 or bf16; optional seeded stochastic rounding of bf16 parameters.
// Gradient unscaling, the inf/NaN check (a bad step is skipped and reported), global-norm clipping
// and adaptive gradient clipping are fused in. Every element is touched once by the update pass;
// the inf/NaN check and the global norm need the whole gradient first, so they run as one read-only
// pre-pass over the gradients (only when asked for). Everything is validated before the first
// launch, so a typed error never leaves a half-written parameter.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/ops/errors.hpp>
#include <tessel/arch/stream.hpp>
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/ranges.hpp>
#include <tessel/types/bf16.hpp>

namespace tessel {
inline namespace v0 {

enum class param_storage : std::uint8_t {
  f32,             // `param` holds f32 parameters
  bf16,            // `param_bf16` only (the update is computed in f32 and rounded back)
  bf16_master,     // `param_bf16` plus an f32 `master`; the master is updated, bf16 is its rounding
  bf16_remainder,  // `param_bf16` plus 16-bit `remainder`: (bf16, remainder) is the f32 master exactly
};
enum class rounding : std::uint8_t { nearest, stochastic };

// One parameter tensor and its state. Unused spans stay empty. State may be f32 or bf16, the
// gradient f32 or bf16.
template <class State = float, class Grad = float>
struct optim_tensor {
  std::span<float> param;              // param_storage::f32
  std::span<bf16> param_bf16;          // the bf16 storages
  std::span<float> master;             // bf16_master
  std::span<std::uint16_t> remainder;  // bf16_remainder
  std::span<const Grad> grad;
  std::span<State> m;      // AdamW first moment, SGD momentum buffer, Lion momentum
  std::span<State> v;      // AdamW second moment
  std::span<State> v_max;  // AdamW with AMSGrad
  std::size_t unit = 0;    // adaptive clipping: unit (row) length; 0 = whole tensor
};

struct adamw_params {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 1e-2f;
  bool amsgrad = false;
};
struct sgd_params {
  float lr = 1e-2f, momentum = 0.0f, dampening = 0.0f, weight_decay = 0.0f;
  bool nesterov = false;
};
struct lion_params {
  float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.99f, weight_decay = 0.0f;
};

// What is fused around the update.
struct step_options {
  param_storage storage = param_storage::f32;
  float loss_scale = 1.0f;             // gradients are multiplied by 1/loss_scale
  bool check_finite = true;            // skip the step (write nothing) if any gradient is Inf/NaN
  float max_grad_norm = 0.0f;          // > 0: clip the global L2 norm of the unscaled gradient
  float agc_clip = 0.0f;               // > 0: adaptive gradient clipping factor lambda (Brock et al. 2021)
  float agc_eps = 1e-3f;               // AGC: parameter norms are at least this
  rounding round = rounding::nearest;  // for bf16 parameters
  std::uint64_t seed = 0;              // stochastic rounding seed (the step number is mixed in)
  std::size_t chunk = default_stream_chunk;
};

struct step_result {
  bool skipped = false;  // true: a non-finite gradient was found, nothing was written
  bool found_inf = false;
  double grad_norm = -1.0;       // global L2 norm of the unscaled gradient (-1 when not computed)
  float grad_multiplier = 1.0f;  // what every gradient was multiplied by (1/scale * clip coefficient)
};

// Dynamic loss scaling for fp16 training: an overflow halves the scale (backoff) and the step is
// skipped; `growth_interval` clean steps in a row double it (growth).
class loss_scaler {
 public:
  explicit loss_scaler(float init_scale = 65536.0f, float growth_factor = 2.0f, float backoff_factor = 0.5f, std::uint32_t growth_interval = 2000)
      : scale_(init_scale), growth_(growth_factor), backoff_(backoff_factor), interval_(growth_interval) {
    if (!(init_scale > 0.0f) || !std::isfinite(init_scale)) throw optim_error("loss_scaler: initial scale must be positive and finite");
    if (!(growth_factor > 1.0f) || !std::isfinite(growth_factor)) throw optim_error("loss_scaler: growth factor must be > 1");
    if (!(backoff_factor > 0.0f && backoff_factor < 1.0f)) throw optim_error("loss_scaler: backoff factor must be in (0, 1)");
    if (growth_interval == 0) throw optim_error("loss_scaler: growth interval must be positive");
  }
  float scale() const { return scale_; }
  std::uint32_t clean_steps() const { return good_; }
  // Feed the outcome of a step; returns the scale for the next one.
  float update(bool found_inf) {
    if (found_inf) {
      scale_ = std::max(scale_ * backoff_, std::numeric_limits<float>::min());
      good_ = 0;
    } else if (++good_ >= interval_) {
      const float next = scale_ * growth_;
      if (std::isfinite(next)) scale_ = next;
      good_ = 0;
    }
    return scale_;
  }
  void update(const step_result& r) { update(r.found_inf); }

 private:
  float scale_, growth_, backoff_;
  std::uint32_t interval_, good_ = 0;
};

}  // namespace v0

namespace detail::optim {

namespace st = tessel::arch::stream;

// The three update rules, written once for a scalar float and a vector batch. `p` is the f32
// parameter (master), `g` the final gradient; returns the new parameter.
struct adamw_rule {
  static constexpr const char* profile_name = "adamw_step";  // the update pass, in profiles
  float decay, b1, omb1, b2, omb2, inv_sqrt_bc2, eps, neg_step;
  bool amsgrad;
  static constexpr bool uses_m = true, uses_v = true;
  template <class V>
  V operator()(V p, V g, V& m, V& v, V& vmax) const {
    const V pd = p * V(decay);
    m = st::fma(V(b1), m, V(omb1) * g);
    v = st::fma(V(b2), v, (V(omb2) * g) * g);
    V vh = v;
    if (amsgrad) vh = vmax = st::max(vmax, v);
    const V denom = st::fma(st::sqrt(vh), V(inv_sqrt_bc2), V(eps));
    return st::fma(V(neg_step), m / denom, pd);
  }
};
struct sgd_rule {
  static constexpr const char* profile_name = "sgd_step";  // the update pass, in profiles
  float wd, mom, omd, neg_lr;
  bool nesterov, first, has_momentum;
  static constexpr bool uses_m = true, uses_v = false;
  template <class V>
  V operator()(V p, V g, V& m, V&, V&) const {
    if (wd != 0.0f) g = st::fma(V(wd), p, g);
    if (has_momentum) {
      m = first ? g : st::fma(V(mom), m, V(omd) * g);
      g = nesterov ? st::fma(V(mom), m, g) : m;
    }
    return st::fma(V(neg_lr), g, p);
  }
};
struct lion_rule {
  static constexpr const char* profile_name = "lion_step";  // the update pass, in profiles
  float decay, b1, omb1, b2, omb2, neg_lr;
  static constexpr bool uses_m = true, uses_v = false;
  template <class V>
  V operator()(V p, V g, V& m, V&, V&) const {
    const V c = st::fma(V(b1), m, V(omb1) * g);
    const V pd = p * V(decay);
    m = st::fma(V(b2), m, V(omb2) * g);
    return st::fma(V(neg_lr), st::sign(c), pd);
  }
};

template <class T>
inline const std::uint16_t* raw16(const T* p) {
  return reinterpret_cast<const std::uint16_t*>(p);
}
template <class T>
inline std::uint16_t* raw16(T* p) {
  return reinterpret_cast<std::uint16_t*>(p);
}

template <class T>
inline float load1(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<T, float>)
    return p[i];
  else
    return st::bf16_bits_to_f32(raw16(p)[i]);
}
template <class T>
inline st::vf loadv(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<T, float>)
    return st::load(p + i);
  else
    return st::load_bf16(raw16(p) + i);
}
template <class T>
inline void store1(T* p, std::size_t i, float x) {
  if constexpr (std::is_same_v<T, float>)
    p[i] = x;
  else
    raw16(p)[i] = st::f32_to_bf16_bits(x);
}
template <class T>
inline void storev(T* p, std::size_t i, st::vf x) {
  if constexpr (std::is_same_v<T, float>)
    st::store(x, p + i);
  else
    st::store_bf16(x, raw16(p) + i);
}

// The f32 master of the remainder storage: bf16 `hi` was rounded half-up on the bit pattern from
// the master, `lo` is the master's low half, so the master's upper half is hi - (lo >= 0x8000).
inline float remainder_join(std::uint16_t hi, std::uint16_t lo) {
  return std::bit_cast<float>(((std::uint32_t(hi) << 16) | lo) - (std::uint32_t(lo & 0x8000u) << 1));
}
inline void remainder_split(float x, std::uint16_t& hi, std::uint16_t& lo) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  hi = std::uint16_t((u + 0x8000u) >> 16);
  lo = std::uint16_t(u & 0xFFFFu);
}
inline st::vf remainder_join(const std::uint16_t* hi, const std::uint16_t* lo) {
  const st::vu h = st::bits(st::load_bf16(hi));        // hi << 16
  const st::vu l = st::bits(st::load_bf16(lo)) >> 16;  // lo
  return st::from_bits((h | l) - ((l & st::vu(0x8000u)) << 1));
}
inline void remainder_split(st::vf x, std::uint16_t* hi, std::uint16_t* lo) {
  const st::vu u = st::bits(x);
  st::store_u16((u + st::vu(0x8000u)) >> 16, hi);
  st::store_u16(u & st::vu(0xFFFFu), lo);
}

struct pass_args {
  float gmul = 1.0f;  // 1/scale * global clip coefficient
  float agc_clip = 0.0f, agc_eps = 0.0f;
  bool stochastic = false;
  std::uint64_t seed = 0, step = 0;
};

// Sum of squares of x[0..n) * mul in a fixed order: `width` lane accumulators (fma), the lanes
// combined pairwise (st::hsum), then the tail in index order. Same bits on every run.
template <class T>
inline float sum_sq(const T* x, std::size_t n, float mul) {
  std::size_t i = 0;
  float s = 0.0f;
  if (n >= st::width) {
    st::vf acc(0.0f);
    for (; i + st::width <= n; i += st::width) {
      const st::vf y = loadv(x, i) * st::vf(mul);
      acc = st::fma(y, y, acc);
    }
    s = st::hsum(acc);
  }
  for (; i < n; ++i) {
    const float y = load1(x, i) * mul;
    s = std::fma(y, y, s);
  }
  return s;
}

// Adaptive clipping coefficient of one unit (Brock et al. 2021): min(1, lambda * max(|w|, eps) / |g|).
inline float agc_coef(float wsq, float gsq, float lambda, float eps) {
  const float wn = std::max(std::sqrt(wsq), eps), gn = std::sqrt(gsq);
  const float lim = lambda * wn;
  return gn > lim ? lim / gn : 1.0f;
}

template <param_storage S, class State, class Grad>
struct param_io {
  const optim_tensor<State, Grad>& t;
  float load1(std::size_t i) const {
    if constexpr (S == param_storage::f32)
      return t.param[i];
    else if constexpr (S == param_storage::bf16)
      return st::bf16_bits_to_f32(raw16(t.param_bf16.data())[i]);
    else if constexpr (S == param_storage::bf16_master)
      return t.master[i];
    else
      return remainder_join(raw16(t.param_bf16.data())[i], t.remainder[i]);
  }
  st::vf loadv(std::size_t i) const {
    if constexpr (S == param_storage::f32)
      return st::load(t.param.data() + i);
    else if constexpr (S == param_storage::bf16)
      return st::load_bf16(raw16(t.param_bf16.data()) + i);
    else if constexpr (S == param_storage::bf16_master)
      return st::load(t.master.data() + i);
    else
      return remainder_join(raw16(t.param_bf16.data()) + i, t.remainder.data() + i);
  }
  void store1(std::size_t i, float x, std::uint32_t key, bool sr) const {
    if constexpr (S == param_storage::f32) {
      t.param[i] = x;
    } else if constexpr (S == param_storage::bf16_remainder) {
      remainder_split(x, raw16(t.param_bf16.data())[i], t.remainder[i]);
    } else {
      if constexpr (S == param_storage::bf16_master) t.master[i] = x;
      raw16(t.param_bf16.data())[i] = sr ? st::f32_to_bf16_bits_sr(x, st::random_bits(key, std::uint32_t(i))) : st::f32_to_bf16_bits(x);
    }
  }
  void storev(std::size_t i, st::vf x, std::uint32_t key, bool sr) const {
    if constexpr (S == param_storage::f32) {
      st::store(x, t.param.data() + i);
    } else if constexpr (S == param_storage::bf16_remainder) {
      remainder_split(x, raw16(t.param_bf16.data()) + i, t.remainder.data() + i);
    } else {
      if constexpr (S == param_storage::bf16_master) st::store(x, t.master.data() + i);
      std::uint16_t* dst = raw16(t.param_bf16.data()) + i;
      // In master mode the bf16 copy is write-only: stream it past the cache.
      constexpr bool nt = S == param_storage::bf16_master;
      if (sr)
        st::store_u16(st::bf16_sr_lanes(x, st::random_bits_v(key, std::uint32_t(i))), dst, nt);
      else
        st::store_bf16(x, dst, nt);
    }
  }
};

// Updates elements [b, e) of one tensor: the whole fused per-element pass.
template <class Rule, param_storage S, class State, class Grad>
void update_range(const Rule& rule, const optim_tensor<State, Grad>& t, std::size_t tensor_index, std::size_t b, std::size_t e, const pass_args& a) {
  const param_io<S, State, Grad> io{t};
  const Grad* g = t.grad.data();
  State* m = t.m.empty() ? nullptr : t.m.data();
  State* v = t.v.empty() ? nullptr : t.v.data();
  State* vm = t.v_max.empty() ? nullptr : t.v_max.data();
  const bool sr = a.stochastic && S != param_storage::f32 && S != param_storage::bf16_remainder;
  // Random stream of this (seed, step, tensor, 2^32-element page): a pure function of the position.
  const std::uint32_t key = sr ? st::rng_key(a.seed ^ (a.step * 0x9E3779B97F4A7C15ull), (std::uint64_t(tensor_index) << 32) | (b >> 32)) : 0;

  const std::size_t unit = a.agc_clip > 0.0f ? (t.unit ? t.unit : t.grad.size()) : e - b;
  for (std::size_t u0 = b; u0 < e; u0 += unit) {
    const std::size_t u1 = u0 + unit < e ? u0 + unit : e;
    float gmul = a.gmul;
    if (a.agc_clip > 0.0f) {
      float wsq = 0.0f;
      {  // parameter norm of the unit, same fixed order as sum_sq
        std::size_t i = u0;
        if (u1 - u0 >= st::width) {
          st::vf acc(0.0f);
          for (; i + st::width <= u1; i += st::width) {
            const st::vf w = io.loadv(i);
            acc = st::fma(w, w, acc);
          }
          wsq = st::hsum(acc);
        }
        for (; i < u1; ++i) {
          const float w = io.load1(i);
          wsq = std::fma(w, w, wsq);
        }
      }
      const float gsq = sum_sq(g + u0, u1 - u0, a.gmul);
      gmul = a.gmul * agc_coef(wsq, gsq, a.agc_clip, a.agc_eps);
    }
    std::size_t i = u0;
    for (; i + st::width <= u1; i += st::width) {
      st::vf mm(0.0f), vv(0.0f), vx(0.0f);
      if (m) mm = loadv(m, i);
      if (v) vv = loadv(v, i);
      if (vm) vx = loadv(vm, i);
      const st::vf p = rule(io.loadv(i), loadv(g, i) * st::vf(gmul), mm, vv, vx);
      io.storev(i, p, key, sr);
      if (m) storev(m, i, mm);
      if (v) storev(v, i, vv);
      if (vm) storev(vm, i, vx);
    }
    for (; i < u1; ++i) {
      float mm = m ? load1(m, i) : 0.0f, vv = v ? load1(v, i) : 0.0f, vx = vm ? load1(vm, i) : 0.0f;
      const float p = rule(io.load1(i), load1(g, i) * gmul, mm, vv, vx);
      io.store1(i, p, key, sr);
      if (m) store1(m, i, mm);
      if (v) store1(v, i, vv);
      if (vm) store1(vm, i, vx);
    }
  }
}

template <class Rule, param_storage S, class State, class Grad>
struct update_program {
  static constexpr const char* name = Rule::profile_name;
  std::span<const optim_tensor<State, Grad>> tensors;
  const chunk_range* chunks;
  Rule rule;
  pass_args args;
  void operator()(block_ctx& ctx) const {
    const chunk_range& c = chunks[ctx.block_linear()];
    update_range<Rule, S>(rule, tensors[c.tensor], c.tensor, c.begin, c.end, args);
    st::nt_fence();
  }
};

// Pre-pass: per chunk, the sum of squares of the unscaled gradient and a NaN sentinel
// (sum of g*0 is NaN iff some g is Inf or NaN).
template <class State, class Grad>
struct check_program {
  std::span<const optim_tensor<State, Grad>> tensors;
  const chunk_range* chunks;
  float inv_scale;
  bool want_norm;
  float* sumsq;  // per chunk
  unsigned char* bad;
  void operator()(block_ctx& ctx) const {
    const std::size_t id = ctx.block_linear();
    const chunk_range& c = chunks[id];
    const Grad* g = tensors[c.tensor].grad.data() + c.begin;
    const std::size_t n = c.size();
    std::size_t i = 0;
    st::vf z(0.0f), acc(0.0f);
    float zs = 0.0f, s = 0.0f;
    for (; i + st::width <= n; i += st::width) {
      const st::vf x = loadv(g, i);
      z = z + x * st::vf(0.0f);
      if (want_norm) {
        const st::vf y = x * st::vf(inv_scale);
        acc = st::fma(y, y, acc);
      }
    }
    s = st::hsum(acc);
    zs = st::hsum(z);
    for (; i < n; ++i) {
      const float x = load1(g, i);
      zs += x * 0.0f;
      const float y = x * inv_scale;
      s = std::fma(y, y, s);
    }
    sumsq[id] = s;
    bad[id] = zs != 0.0f;  // NaN != 0
  }
};

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw optim_error(msg);
}
inline bool finite_nonneg(float x) { return std::isfinite(x) && x >= 0.0f; }

template <class State, class Grad>
void validate(std::span<const optim_tensor<State, Grad>> ts, const step_options& o, bool need_m, bool need_v, bool need_vmax, const char* who) {
  const std::string w = who;
  require(std::isfinite(o.loss_scale) && o.loss_scale > 0.0f, w + ": loss scale must be positive and finite, got " + std::to_string(o.loss_scale));
  require(finite_nonneg(o.max_grad_norm), w + ": max_grad_norm must be finite and >= 0");
  require(finite_nonneg(o.agc_clip), w + ": agc_clip must be finite and >= 0");
  require(std::isfinite(o.agc_eps) && o.agc_eps > 0.0f, w + ": agc_eps must be positive and finite");
  require(o.chunk > 0, w + ": chunk must be positive");
  if (o.round == rounding::stochastic)
    require(o.storage == param_storage::bf16 || o.storage == param_storage::bf16_master,
            w + ": stochastic rounding needs bf16 or bf16_master parameter storage");
  for (std::size_t k = 0; k < ts.size(); ++k) {
    const auto& t = ts[k];
    const std::string at = w + ": tensor " + std::to_string(k) + ": ";
    std::size_t n = 0;
    switch (o.storage) {
      case param_storage::f32:
        n = t.param.size();
        require(t.param_bf16.empty() && t.master.empty() && t.remainder.empty(), at + "f32 storage takes only `param`");
        break;
      case param_storage::bf16:
        n = t.param_bf16.size();
        require(t.param.empty() && t.master.empty() && t.remainder.empty(), at + "bf16 storage takes only `param_bf16`");
        break;
      case param_storage::bf16_master:
        n = t.param_bf16.size();
        require(t.master.size() == n, at + "master has " + std::to_string(t.master.size()) + " elements, param_bf16 " + std::to_string(n));
        require(t.param.empty() && t.remainder.empty(), at + "bf16_master storage takes `param_bf16` and `master`");
        break;
      case param_storage::bf16_remainder:
        n = t.param_bf16.size();
        require(t.remainder.size() == n, at + "remainder has " + std::to_string(t.remainder.size()) + " elements, param_bf16 " + std::to_string(n));
        require(t.param.empty() && t.master.empty(), at + "bf16_remainder storage takes `param_bf16` and `remainder`");
        break;
    }
    auto same = [&](std::size_t got, const char* name, bool needed) {
      if (needed) require(got == n, at + name + " has " + std::to_string(got) + " elements, the parameter " + std::to_string(n));
    };
    same(t.grad.size(), "grad", true);
    same(t.m.size(), "m", need_m);
    same(t.v.size(), "v", need_v);
    same(t.v_max.size(), "v_max", need_vmax);
    if (n > 0) {
      require(t.grad.data() != nullptr, at + "null gradient");
      require(std::uint64_t(n) < (std::uint64_t(1) << 62), at + "too many elements");
    }
    if (o.agc_clip > 0.0f && t.unit != 0)
      require(n % t.unit == 0, at + "AGC unit " + std::to_string(t.unit) + " does not divide the size " + std::to_string(n));
  }
}

template <class Rule, class Dev, class State, class Grad>
step_result run_step(Dev& dev, std::span<const optim_tensor<State, Grad>> ts, const Rule& rule, std::uint64_t step, const step_options& o) {
  step_result res;
  std::vector<std::size_t> sizes(ts.size()), units(ts.size(), 0);
  for (std::size_t k = 0; k < ts.size(); ++k) {
    sizes[k] = ts[k].grad.size();
    if (o.agc_clip > 0.0f) units[k] = ts[k].unit ? ts[k].unit : sizes[k];
  }
  const float inv_scale = 1.0f / o.loss_scale;
  pass_args a;
  a.gmul = inv_scale;
  a.agc_clip = o.agc_clip;
  a.agc_eps = o.agc_eps;
  a.stochastic = o.round == rounding::stochastic;
  a.seed = o.seed;
  a.step = step;
  const bool want_norm = o.max_grad_norm > 0.0f;
  if (o.check_finite || want_norm) {
    // Pre-pass chunks never depend on AGC units: the norm is the same with or without AGC.
    const std::vector<chunk_range> pre = make_chunks(sizes, o.chunk);
    std::vector<float> sumsq(pre.size(), 0.0f);
    std::vector<unsigned char> bad(pre.size(), 0);
    if (!pre.empty()) dev.launch(grid{pre.size()}, check_program<State, Grad>{ts, pre.data(), inv_scale, want_norm, sumsq.data(), bad.data()});
    double total = 0.0;
    bool any_bad = false;
    for (std::size_t i = 0; i < pre.size(); ++i) {
      total += double(sumsq[i]);
      any_bad = any_bad || bad[i];
    }
    if (want_norm) res.grad_norm = std::sqrt(total);
    if (any_bad && o.check_finite) {
      res.found_inf = true;
      res.skipped = true;
      return res;
    }
    if (want_norm && std::isfinite(res.grad_norm)) {
      // PyTorch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6), never above 1.
      const double coef = double(o.max_grad_norm) / (res.grad_norm + 1e-6);
      if (coef < 1.0) a.gmul = inv_scale * float(coef);
    }
  }
  res.grad_multiplier = a.gmul;
  const std::vector<chunk_range> chunks = make_chunks(sizes, o.chunk, units);
  if (chunks.empty()) return res;
  auto go = [&]<param_storage S>() { dev.launch(grid{chunks.size()}, update_program<Rule, S, State, Grad>{ts, chunks.data(), rule, a}); };
  switch (o.storage) {
    case param_storage::f32: go.template operator()<param_storage::f32>(); break;
    case param_storage::bf16: go.template operator()<param_storage::bf16>(); break;
    case param_storage::bf16_master: go.template operator()<param_storage::bf16_master>(); break;
    case param_storage::bf16_remainder: go.template operator()<param_storage::bf16_remainder>(); break;
  }
  return res;
}

inline void check_lr(float lr, const char* who) {
  require(std::isfinite(lr) && lr >= 0.0f, std::string(who) + ": learning rate must be finite and >= 0, got " + std::to_string(lr));
}
inline void check_beta(float b, const char* name, const char* who) {
  require(std::isfinite(b) && b >= 0.0f && b < 1.0f, std::string(who) + ": " + name + " must be in [0, 1), got " + std::to_string(b));
}

}  // namespace detail::optim

inline namespace v0 {

// Host-side constants of one AdamW step (shared with the test reference so both round alike).
inline detail::optim::adamw_rule make_adamw_rule(const adamw_params& h, std::uint64_t step) {
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(step));
  return {1.0f - h.lr * h.weight_decay, h.beta1,  1.0f - h.beta1, h.beta2, 1.0f - h.beta2, float(1.0 / std::sqrt(bc2)), h.eps,
          float(-double(h.lr) / bc1),   h.amsgrad};
}
inline detail::optim::sgd_rule make_sgd_rule(const sgd_params& h, std::uint64_t step) {
  return {h.weight_decay, h.momentum, 1.0f - h.dampening, -h.lr, h.nesterov, step <= 1, h.momentum != 0.0f};
}
inline detail::optim::lion_rule make_lion_rule(const lion_params& h) {
  return {1.0f - h.lr * h.weight_decay, h.beta1, 1.0f - h.beta1, h.beta2, 1.0f - h.beta2, -h.lr};
}

// AdamW (Loshchilov & Hutter) as PyTorch computes it: p *= 1 - lr*wd; m, v moments;
// p -= lr/(1-b1^t) * m / (sqrt(v̂)/sqrt(1-b2^t) + eps), v̂ = v or max(v_max, v). `step` counts from 1.
template <class Dev, class State, class Grad>
step_result adamw_step(Dev& dev, std::span<const optim_tensor<State, Grad>> tensors, const adamw_params& h, std::uint64_t step,
                       const step_options& o = {}) {
  using namespace detail::optim;
  check_lr(h.lr, "adamw");
  check_beta(h.beta1, "beta1", "adamw");
  check_beta(h.beta2, "beta2", "adamw");
  require(std::isfinite(h.eps) && h.eps > 0.0f, "adamw: eps must be positive and finite");
  require(finite_nonneg(h.weight_decay), "adamw: weight decay must be finite and >= 0");
  require(step >= 1, "adamw: step counts from 1");
  validate(tensors, o, true, true, h.amsgrad, "adamw");
  return run_step(dev, tensors, make_adamw_rule(h, step), step, o);
}

// SGD with momentum (dampening, Nesterov) and L2 weight decay, as torch.optim.SGD.
template <class Dev, class State, class Grad>
step_result sgd_step(Dev& dev, std::span<const optim_tensor<State, Grad>> tensors, const sgd_params& h, std::uint64_t step,
                     const step_options& o = {}) {
  using namespace detail::optim;
  check_lr(h.lr, "sgd");
  require(finite_nonneg(h.momentum), "sgd: momentum must be finite and >= 0");
  require(std::isfinite(h.dampening) && h.dampening >= 0.0f && h.dampening <= 1.0f, "sgd: dampening must be in [0, 1]");
  require(finite_nonneg(h.weight_decay), "sgd: weight decay must be finite and >= 0");
  require(!h.nesterov || (h.momentum > 0.0f && h.dampening == 0.0f), "sgd: Nesterov needs momentum > 0 and zero dampening");
  require(step >= 1, "sgd: step counts from 1");
  validate(tensors, o, h.momentum != 0.0f, false, false, "sgd");
  return run_step(dev, tensors, make_sgd_rule(h, step), step, o);
}

// Lion (Chen et al. 2023): p = p(1 - lr*wd) - lr*sign(b1 m + (1-b1) g); m = b2 m + (1-b2) g.
template <class Dev, class State, class Grad>
step_result lion_step(Dev& dev, std::span<const optim_tensor<State, Grad>> tensors, const lion_params& h, std::uint64_t step,
                      const step_options& o = {}) {
  using namespace detail::optim;
  check_lr(h.lr, "lion");
  check_beta(h.beta1, "beta1", "lion");
  check_beta(h.beta2, "beta2", "lion");
  require(finite_nonneg(h.weight_decay), "lion: weight decay must be finite and >= 0");
  validate(tensors, o, true, false, false, "lion");
  return run_step(dev, tensors, make_lion_rule(h), step, o);
}

// Builds the tensor list from parallel lists (PyTorch's multi-tensor apply calling convention).
// Lists of different lengths are a std::length_error; empty `m`/`v` lists mean "not used".
template <class State, class Grad>
std::vector<optim_tensor<State, Grad>> zip_tensors(const std::vector<std::span<float>>& params, const std::vector<std::span<const Grad>>& grads,
                                                   const std::vector<std::span<State>>& m = {}, const std::vector<std::span<State>>& v = {}) {
  auto len = [&](std::size_t got, const char* name) {
    if (got != 0 && got != params.size())
      throw optim_error(errc::invalid_argument, "zip_tensors: " + std::string(name) + " list has " + std::to_string(got) + " tensors, params " +
                                                    std::to_string(params.size()));
  };
  len(grads.size(), "grads");
  if (grads.size() != params.size())
    throw optim_error(errc::invalid_argument,
                      "zip_tensors: grads list has " + std::to_string(grads.size()) + " tensors, params " + std::to_string(params.size()));
  len(m.size(), "m");
  len(v.size(), "v");
  std::vector<optim_tensor<State, Grad>> out(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    out[k].param = params[k];
    out[k].grad = grads[k];
    if (!m.empty()) out[k].m = m[k];
    if (!v.empty()) out[k].v = v[k];
  }
  return out;
}

}  // namespace v0
}  // namespace tessel
