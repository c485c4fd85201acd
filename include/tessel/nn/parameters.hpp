// A model's parameters as one registry (DESIGN.md, "Parameters"): each tensor has its Hugging Face
// name, its shape, an f32 master in device memory, its f32 gradient, the AdamW moments once a step
// has run, and, for models that compute in bf16, a bf16 copy of the master that the GEMMs read.
// Checkpoints load and save by name; the optimizer steps the whole registry in one fused launch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/io/safetensors.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

// The slice of a larger tensor a parameter holds (DESIGN.md, "Parameters"): along dimension `dim`,
// indices [offset, offset + length) of `global_shape`, every other dimension whole. dist/ fills it
// for tensor-parallel shards; on one device it is empty and the parameter is the whole tensor.
struct shard_spec {
  std::size_t dim = 0, offset = 0, length = 0;
  std::vector<std::size_t> global_shape;  // empty: not sharded
  bool sharded() const noexcept { return !global_shape.empty(); }
};

template <device Dev>
struct parameter {
  std::string name;
  std::vector<std::size_t> shape;  // what this rank holds (the shard's shape when sharded)
  shard_spec shard;
  std::size_t numel = 0;
  device_buffer<float, Dev> value;      // the f32 master
  device_buffer<float, Dev> grad;       // d loss / d value, accumulated by backward passes
  device_buffer<bf16, Dev> value_bf16;  // what bf16 GEMMs read (empty for f32 models)
  device_buffer<float, Dev> m, v;       // AdamW moments (empty until the first step)
  std::size_t sparse_row = 0;           // > 0: rows of this length that a step may leave untouched (an embedding table)

  std::string shape_string() const { return io::detail::shape_string(shape); }
};

// Deterministic normal samples (splitmix64 + Box-Muller in double): the same init on every machine.
class normal_rng {
 public:
  explicit normal_rng(std::uint64_t seed) : s_(seed) {}
  double operator()() {
    if (have_) {
      have_ = false;
      return spare_;
    }
    double u1 = 0.0;
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform(), r = std::sqrt(-2.0 * std::log(u1)), a = 6.283185307179586 * u2;
    spare_ = r * std::sin(a);
    have_ = true;
    return r * std::cos(a);
  }

 private:
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t s_;
  double spare_ = 0.0;
  bool have_ = false;
};

// What load() may find in a checkpoint besides the registry's tensors.
struct load_options {
  // Names the registry does not hold that are skipped rather than rejected: buffers Hugging Face
  // writes (rotary inv_freq, GPT-2's attention masks) and a tied lm_head.
  std::vector<std::string> ignore_suffixes = {"rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"};
  std::vector<std::string> ignore_names;
  bool allow_unexpected = false;  // true: skip every name the registry does not hold
};

template <device Dev>
class parameters {
 public:
  explicit parameters(Dev& dev) : dev_(&dev) {}
  parameters(parameters&&) noexcept = default;
  parameters& operator=(parameters&&) noexcept = default;

  // A new parameter, zero-initialised, with a zero gradient. Names are unique.
  parameter<Dev>& add(std::string name, std::vector<std::size_t> shape, bool with_bf16 = false) {
    if (index_.count(name)) throw nn_error(errc::invalid_argument, "parameters: '" + name + "' added twice");
    std::size_t n = 1;
    for (std::size_t d : shape) n = detail::mul_checked(n, d, "parameter size");
    parameter<Dev>& p = list_.emplace_back();
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = n;
    p.value = device_buffer<float, Dev>::zeros(*dev_, n);
    p.grad = device_buffer<float, Dev>::zeros(*dev_, n);
    if (with_bf16) p.value_bf16 = device_buffer<bf16, Dev>::zeros(*dev_, n);
    index_.emplace(p.name, list_.size() - 1);
    total_ = detail::add_checked(total_, n, "parameter count");
    return p;
  }

  // A shard of the tensor `name` of shape `global_shape`: indices [offset, offset + length) along
  // `dim`. load() slices it out of a full checkpoint.
  parameter<Dev>& add_shard(std::string name, std::vector<std::size_t> global_shape, std::size_t dim, std::size_t offset, std::size_t length,
                            bool with_bf16 = false) {
    if (dim >= global_shape.size() || offset > global_shape[dim] || length > global_shape[dim] - offset || length == 0)
      throw nn_error(errc::invalid_argument, "parameters: shard [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                                                 ") along dim " + std::to_string(dim) + " does not fit '" + name + "' of shape " +
                                                 io::detail::shape_string(global_shape));
    std::vector<std::size_t> local = global_shape;
    local[dim] = length;
    parameter<Dev>& p = add(std::move(name), std::move(local), with_bf16);
    p.shard = shard_spec{dim, offset, length, std::move(global_shape)};
    return p;
  }

  std::size_t size() const noexcept { return list_.size(); }
  std::size_t numel() const noexcept { return total_; }
  parameter<Dev>* find(std::string_view name) {
    const auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : &list_[it->second];
  }
  parameter<Dev>& at(std::string_view name) {
    if (parameter<Dev>* p = find(name)) return *p;
    throw nn_error(errc::out_of_range, "parameters: no parameter named '" + std::string(name) + "'");
  }
  auto begin() { return list_.begin(); }
  auto end() { return list_.end(); }
  auto begin() const { return list_.begin(); }
  auto end() const { return list_.end(); }
  Dev& device() const { return *dev_; }

  void zero_grad() {
    for (auto& p : list_) p.grad.fill(0.0f);
  }
  // bf16 copies <- masters (after a load or an f32 update).
  void refresh_bf16() {
    for (auto& p : list_)
      if (!p.value_bf16.empty()) convert(*dev_, p.value.cspan(), p.value_bf16.span());
  }

  // Every parameter from a checkpoint, by name: shapes must match exactly; F32, BF16 and F16
  // tensors are widened to the f32 masters. A missing tensor, a wrong shape or element type, and
  // (unless `o` allows it) a tensor the registry does not hold are nn_error(errc::format) naming it.
  void load(const io::safetensors_checkpoint& ck, const load_options& o = {}) {
    std::vector<std::string> missing;
    for (auto& p : list_)
      if (!ck.contains(p.name)) missing.push_back(p.name);
    if (!missing.empty()) throw nn_error(errc::format, ck.file() + ": missing " + list_names(missing));
    std::vector<std::string> unexpected;
    for (const auto& n : ck.names())
      if (!index_.count(n) && !ignorable(n, o)) unexpected.push_back(n);
    if (!unexpected.empty() && !o.allow_unexpected) throw nn_error(errc::format, ck.file() + ": unexpected " + list_names(unexpected));
    for (auto& p : list_) {
      const io::tensor_view t = ck.tensor(p.name);
      const std::vector<std::size_t> shape(t.shape().begin(), t.shape().end());
      const std::vector<std::size_t>& want = p.shard.sharded() ? p.shard.global_shape : p.shape;
      if (shape != want)
        throw nn_error(errc::format, t.file() + ": tensor '" + p.name + "' has shape " + io::detail::shape_string(shape) + ", the model needs " +
                                         io::detail::shape_string(want));
      if (p.shard.sharded()) {
        load_slice(t, p);
        continue;
      }
      switch (t.dtype()) {
        case io::st_dtype::f32: {
          const auto d = t.data<float>();
          p.value.copy_from(d.span());
          break;
        }
        case io::st_dtype::bf16: {
          const auto d = t.data<bf16>();
          convert(*dev_, d.span(), p.value.span());
          break;
        }
        case io::st_dtype::f16: {
          const auto d = t.data<fp16>();
          convert(*dev_, d.span(), p.value.span());
          break;
        }
        default:
          throw nn_error(errc::format, t.file() + ": tensor '" + p.name + "' holds " + std::string(io::st_dtype_name(t.dtype())) +
                                           "; parameters load from F32, BF16 or F16");
      }
    }
    refresh_bf16();
  }
  void load(const std::filesystem::path& path, const load_options& o = {}) { load(io::safetensors_checkpoint::open(path), o); }

  // Every parameter's master into one safetensors file (F32), in registration order.
  void save(const std::filesystem::path& file, const std::map<std::string, std::string>& metadata = {}) const {
    io::safetensors_writer w;
    for (const auto& [k, v] : metadata) w.add_metadata(k, v);
    for (const auto& p : list_) w.add<float>(p.name, p.shape, p.value.cspan());
    w.write(file);
  }

  // A training checkpoint: the masters plus the AdamW moments ("adamw.m.<name>", "adamw.v.<name>")
  // and the step count (metadata "step"), so training resumes with the same bits.
  void save_training_state(const std::filesystem::path& file, std::uint64_t step) const {
    io::safetensors_writer w;
    w.add_metadata("step", std::to_string(step));
    for (const auto& p : list_) w.add<float>(p.name, p.shape, p.value.cspan());
    for (const auto& p : list_) {
      if (p.m.empty()) continue;
      w.add<float>("adamw.m." + p.name, p.shape, p.m.cspan());
      w.add<float>("adamw.v." + p.name, p.shape, p.v.cspan());
    }
    w.write(file);
  }
  // Loads what save_training_state wrote; returns the step count.
  std::uint64_t load_training_state(const std::filesystem::path& file) {
    const auto ck = io::safetensors_checkpoint::open(file);
    load_options o;
    o.allow_unexpected = true;  // the moments
    load(ck, o);
    for (auto& p : list_) {
      if (!ck.contains("adamw.m." + p.name)) continue;
      if (p.m.empty()) {
        p.m = device_buffer<float, Dev>(*dev_, p.numel);
        p.v = device_buffer<float, Dev>(*dev_, p.numel);
      }
      for (auto [key, buf] : {std::pair{"adamw.m.", &p.m}, std::pair{"adamw.v.", &p.v}}) {
        const auto t = ck.tensor(key + p.name);
        if (t.dtype() != io::st_dtype::f32 || t.numel() != p.numel)
          throw nn_error(errc::format, t.file() + ": tensor '" + t.name() + "' does not match parameter '" + p.name + "'");
        buf->copy_from(t.template data<float>().span());
      }
    }
    const auto& meta = ck.shards().front().metadata();
    const auto it = meta.find("step");
    if (it == meta.end()) throw nn_error(errc::format, ck.file() + ": no 'step' in the metadata of a training checkpoint");
    try {
      return std::stoull(it->second);
    } catch (const std::exception&) { throw nn_error(errc::format, ck.file() + ": metadata 'step' is '" + it->second + "', not a count"); }
  }

  // Normal(0, std) for matrices and embeddings, 1 for norm weights, 0 for biases (names ending in
  // "bias" or holding "norm"/"ln_" with one dimension), from one seed in registration order.
  void init_normal(std::uint64_t seed, double std = 0.02) {
    normal_rng rng(seed);
    for (auto& p : list_) {
      const bool vec = p.shape.size() == 1;
      const bool is_bias = p.name.size() >= 4 && p.name.compare(p.name.size() - 4, 4, "bias") == 0;
      std::span<float> v = p.value.span();
      if (vec && is_bias)
        std::fill(v.begin(), v.end(), 0.0f);
      else if (vec)
        std::fill(v.begin(), v.end(), 1.0f);
      else
        for (float& x : v) x = float(rng() * std);
    }
    refresh_bf16();
  }

 private:
  // p's shard of the full tensor t (widened to f32 exactly, element by element).
  static void load_slice(const io::tensor_view& t, parameter<Dev>& p) {
    const shard_spec& sh = p.shard;
    std::size_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < sh.dim; ++i) outer *= sh.global_shape[i];
    for (std::size_t i = sh.dim + 1; i < sh.global_shape.size(); ++i) inner *= sh.global_shape[i];
    const std::size_t full = sh.global_shape[sh.dim] * inner, run = sh.length * inner;
    float* dst = p.value.data();
    auto copy = [&](const auto* src) {
      for (std::size_t o = 0; o < outer; ++o)
        for (std::size_t i = 0; i < run; ++i) dst[o * run + i] = static_cast<float>(src[o * full + sh.offset * inner + i]);
    };
    switch (t.dtype()) {
      case io::st_dtype::f32: copy(t.data<float>().span().data()); break;
      case io::st_dtype::bf16: copy(t.data<bf16>().span().data()); break;
      case io::st_dtype::f16: copy(t.data<fp16>().span().data()); break;
      default:
        throw nn_error(errc::format, t.file() + ": tensor '" + p.name + "' holds " + std::string(io::st_dtype_name(t.dtype())) +
                                         "; parameters load from F32, BF16 or F16");
    }
  }
  static std::string list_names(const std::vector<std::string>& names) {
    std::string s = std::to_string(names.size()) + (names.size() == 1 ? " tensor: " : " tensors: ");
    for (std::size_t i = 0; i < names.size() && i < 8; ++i) s += (i ? ", '" : "'") + names[i] + "'";
    if (names.size() > 8) s += ", ...";
    return s;
  }
  static bool ignorable(const std::string& n, const load_options& o) {
    for (const auto& s : o.ignore_suffixes)
      if (n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0) return true;
    return std::find(o.ignore_names.begin(), o.ignore_names.end(), n) != o.ignore_names.end();
  }

  Dev* dev_;
  std::deque<parameter<Dev>> list_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::size_t total_ = 0;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
