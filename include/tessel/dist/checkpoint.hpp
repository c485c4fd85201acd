// Sharded training checkpoints with resharding load (PyTorch DCP's model: every rank writes what
// it holds, any layout reads back what it needs).
//
// A checkpoint is a directory:
//   rank-<w>.safetensors  one file per world rank, its pieces of the training state: 1-D F32
//                         tensors, each a contiguous run [first, last) of one parameter's local
//                         shard, of one kind ("value": the f32 master; "adamw.m", "adamw.v": the
//                         moments). The file's metadata maps each tensor name to the piece's place:
//                         parameter, kind, global shape, shard (dim, offset, length), first, last.
//   checkpoint.json       the manifest (written last, by world rank 0, once every file is on
//                         disk): format, step, the caller's metadata (data-loader position, RNG
//                         state, ...), the saving layout, and each file's size and content hash
//                         (ckpt::content_hash: four FNV-1a 64 lanes over 8-byte words).
// Replicas are not written twice: a parameter's values (and its moments at ZeRO stage 0) come from
// dp rank 0 only (an expert's from its expert_dp rank 0); at ZeRO stage 1 every dp rank writes its
// shard of the moments.
//
// Loading maps every element to its place in the global tensor (g = o·G·inner + offset·inner + r
// for the r-th element of outer row o of a shard along a dimension of size G), so a checkpoint
// saved on any (dp, tp, pp, ep, ZeRO) layout loads onto any other: each rank takes, for each of its
// parameters, the elements it holds, and its moments (the whole local shard at stage 0, its flat
// range at stage 1). An element no piece covers, a file whose size or hash differs from the
// manifest, or a piece that does not fit its parameter is a typed error naming them. Every rank
// maps every file (read-only; only the pieces it needs are read) and checks the hashes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/collectives/communicator.hpp>
#include <tessel/detail/checked.hpp>
#include <tessel/dist/data_parallel.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/io/safetensors.hpp>
#include <tessel/nn/parameters.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

// What a checkpoint records besides the tensors.
struct checkpoint_state {
  std::uint64_t step = 0;                     // optimizer steps taken (AdamW's bias correction)
  std::map<std::string, std::string> extra = {};  // the caller's: data-loader position, RNG state, ...
};

inline constexpr const char* checkpoint_manifest = "checkpoint.json";
inline constexpr const char* checkpoint_format = "tessel.checkpoint.v1";

namespace ckpt {

// A file's content hash, fed in pieces: lane i (0..3) runs FNV-1a 64 over the little-endian 8-byte
// words 4k + i of the bytes; the result is FNV-1a 64 over the four lane states, the tail bytes (the
// last length % 32) and the length. Four independent multiply chains hash ~8x faster than FNV-1a
// byte by byte; any single flipped bit changes it.
class content_hash {
 public:
  void add(std::span<const std::byte> b) {
    std::size_t i = 0;
    if (have_ > 0) {  // complete the carried block
      const std::size_t take = std::min(b.size(), 32 - have_);
      std::memcpy(carry_ + have_, b.data(), take);
      have_ += take, i = take;
      if (have_ < 32) return;
      block(carry_);
      have_ = 0;
    }
    for (; i + 32 <= b.size(); i += 32) block(b.data() + i);
    have_ = b.size() - i;
    std::memcpy(carry_, b.data() + i, have_);
  }
  std::uint64_t value() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&](std::uint64_t w) {
      for (int k = 0; k < 8; ++k) h = (h ^ ((w >> (8 * k)) & 0xff)) * 0x100000001b3ull;
    };
    for (std::uint64_t l : lane_) mix(l);
    for (std::size_t k = 0; k < have_; ++k) h = (h ^ std::uint64_t(carry_[k])) * 0x100000001b3ull;
    mix(bytes_ + have_);
    return h;
  }

 private:
  void block(const std::byte* p) {
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + 8 * l, 8);
      lane_[l] = (lane_[l] ^ w) * 0x100000001b3ull;
    }
    bytes_ += 32;
  }
  std::uint64_t lane_[4] = {0xcbf29ce484222325ull, 0xcbf29ce484222325ull ^ 1, 0xcbf29ce484222325ull ^ 2, 0xcbf29ce484222325ull ^ 3};
  std::byte carry_[32] = {};
  std::size_t have_ = 0;
  std::uint64_t bytes_ = 0;
};
inline std::string hex(std::uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}
inline std::string rank_file(int w) {
  char s[32];
  std::snprintf(s, sizeof s, "rank-%05d.safetensors", w);
  return s;
}

// A parameter's local shard inside its global tensor: outer rows of `length` of the G indices of
// the sharded dimension, times `inner` elements (an unsharded tensor: one row of all of it).
struct shard_geometry {
  std::size_t outer = 1, G = 1, inner = 1, offset = 0, length = 1;
  std::size_t run() const { return length * inner; }
  std::size_t row() const { return G * inner; }
  std::size_t numel() const { return outer * run(); }
  // global flat index of local element i
  std::size_t global(std::size_t i) const { return (i / run()) * row() + offset * inner + i % run(); }
};
inline shard_geometry geometry(const std::vector<std::size_t>& global_shape, std::size_t dim, std::size_t offset, std::size_t length, const std::string& who) {
  if (global_shape.empty()) return {};
  if (dim >= global_shape.size() || offset > global_shape[dim] || length > global_shape[dim] - offset)
    throw dist_error(errc::format, who + ": shard [" + std::to_string(offset) + ", " + std::to_string(offset + length) + ") along dim " + std::to_string(dim) +
                                       " does not fit the shape " + io::detail::shape_string(global_shape));
  shard_geometry g;
  for (std::size_t i = 0; i < dim; ++i) g.outer = tessel::detail::mul_checked(g.outer, global_shape[i], "checkpoint: shape");
  for (std::size_t i = dim + 1; i < global_shape.size(); ++i) g.inner = tessel::detail::mul_checked(g.inner, global_shape[i], "checkpoint: shape");
  g.G = global_shape[dim], g.offset = offset, g.length = length;
  tessel::detail::mul_checked(g.outer, g.row(), "checkpoint: shape");
  return g;
}
template <device Dev>
shard_geometry geometry_of(const nn::parameter<Dev>& p) {
  if (p.shard.sharded()) return geometry(p.shard.global_shape, p.shard.dim, p.shard.offset, p.shard.length, p.name);
  return geometry(p.shape, 0, 0, p.shape.empty() ? 1 : p.shape[0], p.name);
}
template <device Dev>
const std::vector<std::size_t>& global_shape_of(const nn::parameter<Dev>& p) {
  return p.shard.sharded() ? p.shard.global_shape : p.shape;
}

// A piece to write: [first, last) of parameter p's local shard, of one kind, from `data`.
template <device Dev>
struct out_piece {
  const nn::parameter<Dev>* p;
  std::string kind;
  std::size_t first, last;
  const float* data;  // element `first`
};

// A piece found in a checkpoint.
struct in_piece {
  std::string kind;
  std::vector<std::size_t> shape;
  shard_geometry geo;
  std::size_t first = 0, last = 0;
  const float* data = nullptr;
};

// Each rank's file, then the manifest from world rank 0.
template <device Dev>
void write(const std::filesystem::path& dir, communicator& world, const std::vector<out_piece<Dev>>& pieces, const checkpoint_state& st,
           const nlohmann::json& layout) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw dist_error(errc::io, "checkpoint: cannot create " + dir.string() + ": " + ec.message());
  io::safetensors_writer w;
  for (const auto& pc : pieces) {
    const std::string name = pc.kind + "/" + pc.p->name + "/" + std::to_string(pc.first);
    const shard_geometry g = geometry_of(*pc.p);
    nlohmann::json m = {{"param", pc.p->name}, {"kind", pc.kind},           {"shape", global_shape_of(*pc.p)}, {"offset", g.offset},
                        {"length", g.length},  {"dim", pc.p->shard.dim},    {"first", pc.first},                {"last", pc.last}};
    w.add_metadata(name, m.dump());
    w.add<float>(name, {pc.last - pc.first}, std::span<const float>(pc.data, pc.last - pc.first));
  }
  const std::string file = rank_file(world.rank());
  content_hash hash;
  std::uint64_t size = 0;
  w.write(dir / file, [&](std::span<const std::byte> b) {
    hash.add(b);
    size += b.size();
  });
  const std::uint64_t mine[2] = {size, hash.value()};
  std::vector<std::uint64_t> all(2 * std::size_t(world.size()));
  world.all_gather(std::span<const std::uint64_t>(mine, 2), std::span<std::uint64_t>(all));
  if (world.rank() == 0) {
    nlohmann::json j;
    j["format"] = checkpoint_format;
    j["step"] = st.step;
    j["extra"] = st.extra;
    j["layout"] = layout;
    j["files"] = nlohmann::json::array();
    for (int r = 0; r < world.size(); ++r)
      j["files"].push_back({{"name", rank_file(r)}, {"bytes", all[2 * std::size_t(r)]}, {"hash", hex(all[2 * std::size_t(r) + 1])}});
    const auto tmp = dir / (std::string(checkpoint_manifest) + ".tmp");
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << j.dump(1) << "\n";
      if (!f) throw dist_error(errc::io, "checkpoint: cannot write " + tmp.string());
    }
    std::filesystem::rename(tmp, dir / checkpoint_manifest, ec);  // the manifest appears whole or not at all
    if (ec) throw dist_error(errc::io, "checkpoint: cannot write " + (dir / checkpoint_manifest).string() + ": " + ec.message());
  }
  world.barrier();
}

// The manifest and every file's pieces, by parameter (readers keep the mappings alive).
struct index {
  checkpoint_state state;
  nlohmann::json layout;
  std::vector<io::safetensors_reader> files;
  std::map<std::string, std::vector<in_piece>> pieces;
};

inline index read(const std::filesystem::path& dir) {
  const auto mpath = dir / checkpoint_manifest;
  std::ifstream f(mpath);
  if (!f) throw dist_error(errc::io, "checkpoint: no manifest " + mpath.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw dist_error(errc::format, "checkpoint: " + mpath.string() + " is not JSON: " + e.what());
  }
  auto bad = [&](const std::string& what) { return dist_error(errc::format, "checkpoint: " + mpath.string() + ": " + what); };
  if (!j.is_object() || j.value("format", std::string()) != checkpoint_format) throw bad("not a " + std::string(checkpoint_format) + " manifest");
  if (!j.contains("step") || !j["step"].is_number_unsigned()) throw bad("no step count");
  if (!j.contains("files") || !j["files"].is_array() || j["files"].empty()) throw bad("no files");
  index ix;
  ix.state.step = j["step"].get<std::uint64_t>();
  if (j.contains("extra") && j["extra"].is_object())
    for (const auto& [k, v] : j["extra"].items()) {
      if (!v.is_string()) throw bad("extra '" + k + "' is not a string");
      ix.state.extra[k] = v.get<std::string>();
    }
  ix.layout = j.value("layout", nlohmann::json::object());
  for (const auto& e : j["files"]) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("bytes") || !e["bytes"].is_number_unsigned() || !e.contains("hash") ||
        !e["hash"].is_string())
      throw bad("a file entry without name, bytes and hash");
    const std::string name = e["name"].get<std::string>();
    if (name.find('/') != std::string::npos || name.find("..") != std::string::npos) throw bad("file name '" + name + "' leaves the directory");
    const auto path = dir / name;
    auto r = io::safetensors_reader::open(path);
    // the mapping's bytes: the header plus the tensors
    std::uint64_t size = std::filesystem::file_size(path);
    if (size != e["bytes"].get<std::uint64_t>())
      throw dist_error(errc::format, "checkpoint: " + path.string() + " holds " + std::to_string(size) + " bytes, the manifest says " +
                                         std::to_string(e["bytes"].get<std::uint64_t>()));
    {
      std::ifstream in(path, std::ios::binary);
      std::vector<std::byte> buf(std::size_t(1) << 20);
      content_hash h;
      while (in) {
        in.read(reinterpret_cast<char*>(buf.data()), std::streamsize(buf.size()));
        h.add(std::span<const std::byte>(buf.data(), std::size_t(in.gcount())));
      }
      if (hex(h.value()) != e["hash"].get<std::string>())
        throw dist_error(errc::format, "checkpoint: " + path.string() + " has hash " + hex(h.value()) + ", the manifest says " + e["hash"].get<std::string>());
    }
    for (const auto& entry : r.metadata()) {
      const std::string& tname = entry.first;  // (not a structured binding: Clang 14 cannot capture one in the lambda below)
      const std::string& meta = entry.second;
      nlohmann::json m;
      try {
        m = nlohmann::json::parse(meta);
      } catch (const nlohmann::json::exception&) {
        throw dist_error(errc::format, "checkpoint: " + path.string() + ": the place of '" + tname + "' is not JSON");
      }
      auto field = [&](const char* k) {
        if (!m.contains(k) || !m[k].is_number_unsigned())
          throw dist_error(errc::format, "checkpoint: " + path.string() + ": the place of '" + tname + "' has no '" + k + "'");
        return m[k].get<std::size_t>();
      };
      if (!m.contains("param") || !m["param"].is_string() || !m.contains("kind") || !m["kind"].is_string() || !m.contains("shape") || !m["shape"].is_array())
        throw dist_error(errc::format, "checkpoint: " + path.string() + ": the place of '" + tname + "' lacks param, kind or shape");
      in_piece pc;
      pc.kind = m["kind"].get<std::string>();
      for (const auto& d : m["shape"]) {
        if (!d.is_number_unsigned()) throw dist_error(errc::format, "checkpoint: " + path.string() + ": '" + tname + "' has a bad shape");
        pc.shape.push_back(d.get<std::size_t>());
      }
      const std::string param = m["param"].get<std::string>();
      pc.geo = geometry(pc.shape, field("dim"), field("offset"), field("length"), path.string() + ": '" + tname + "'");
      pc.first = field("first"), pc.last = field("last");
      const auto t = r.tensor(tname);
      if (pc.first > pc.last || pc.last > pc.geo.numel() || t.dtype() != io::st_dtype::f32 || t.numel() != pc.last - pc.first)
        throw dist_error(errc::format, "checkpoint: " + path.string() + ": '" + tname + "' does not fit its place [" + std::to_string(pc.first) + ", " +
                                           std::to_string(pc.last) + ") of " + param);
      pc.data = t.data<float>().span().data();  // the file is written aligned: a view into the mapping
      ix.pieces[param].push_back(std::move(pc));
    }
    ix.files.push_back(std::move(r));
  }
  return ix;
}

// dst = elements [first, last) of a local shard with geometry `to` of `param`'s `kind`, from the
// checkpoint's pieces (the first piece covering an element wins: replicas hold the same bits).
inline void assemble(const index& ix, const std::string& param, const std::vector<std::size_t>& shape, const std::string& kind, const shard_geometry& to,
                     std::size_t first, std::size_t last, float* dst) {
  const auto it = ix.pieces.find(param);
  if (it == ix.pieces.end()) throw dist_error(errc::out_of_range, "checkpoint: no tensor '" + param + "' in the checkpoint");
  std::vector<char> done(last - first, 0);
  std::size_t filled = 0;
  for (const in_piece& s : it->second) {
    if (s.kind != kind) continue;
    if (s.shape != shape)
      throw dist_error(errc::format, "checkpoint: '" + param + "' has shape " + io::detail::shape_string(s.shape) + " in the checkpoint, " +
                                         io::detail::shape_string(shape) + " in the model");
    // the source's runs: local [a, b) inside one outer row is the global [g, g + b - a)
    for (std::size_t a = s.first; a < s.last;) {
      const std::size_t b = std::min(s.last, (a / s.geo.run() + 1) * s.geo.run());
      const std::size_t g0 = s.geo.global(a), g1 = g0 + (b - a);
      // the target's rows that meet [g0, g1)
      for (std::size_t o = g0 / to.row(); o <= (g1 - 1) / to.row(); ++o) {
        const std::size_t base = o * to.row() + to.offset * to.inner;  // global index of the row's local element 0
        const std::size_t lo = std::max(g0, base), hi = std::min(g1, base + to.run());
        if (lo >= hi) continue;
        // local [l0, l1) of the target, clipped to [first, last)
        const std::size_t l0 = std::max(o * to.run() + (lo - base), first), l1 = std::min(o * to.run() + (hi - base), last);
        if (l0 >= l1) continue;
        const float* src = s.data + (a - s.first) + (l0 - o * to.run() + base - g0);
        char* d = done.data() + (l0 - first);
        if (std::find(d, d + (l1 - l0), char(1)) == d + (l1 - l0)) {  // the usual case: none taken yet
          std::copy(src, src + (l1 - l0), dst + (l0 - first));
          std::fill(d, d + (l1 - l0), char(1));
          filled += l1 - l0;
        } else {
          for (std::size_t k = 0; k < l1 - l0; ++k)
            if (!d[k]) dst[l0 - first + k] = src[k], d[k] = 1, ++filled;
        }
      }
      a = b;
    }
  }
  if (filled != last - first) {
    std::size_t miss = 0;
    while (done[miss]) ++miss;
    throw dist_error(errc::out_of_range, "checkpoint: " + kind + " of '" + param + "': element " + std::to_string(first + miss) + " of this rank's shard (and " +
                                             std::to_string(last - first - filled - 1) + " more) is in no piece of the checkpoint");
  }
}
inline bool has_kind(const index& ix, const std::string& param, const std::string& kind) {
  const auto it = ix.pieces.find(param);
  if (it == ix.pieces.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(), [&](const in_piece& p) { return p.kind == kind; });
}

template <device Dev>
void load_values(const index& ix, nn::parameters<Dev>& reg) {
  for (auto& p : reg) assemble(ix, p.name, global_shape_of(p), "value", geometry_of(p), 0, p.numel, p.value.data());
  reg.refresh_bf16();
}
// Stage-0 moments (the whole local shard), when the checkpoint has them.
template <device Dev>
void load_moments(const index& ix, nn::parameters<Dev>& reg) {
  for (auto& p : reg) {
    if (!has_kind(ix, p.name, "adamw.m")) continue;
    if (p.m.size() != p.numel) {
      p.m = device_buffer<float, Dev>::zeros(reg.device(), p.numel);
      p.v = device_buffer<float, Dev>::zeros(reg.device(), p.numel);
    }
    assemble(ix, p.name, global_shape_of(p), "adamw.m", geometry_of(p), 0, p.numel, p.m.data());
    assemble(ix, p.name, global_shape_of(p), "adamw.v", geometry_of(p), 0, p.numel, p.v.data());
  }
}
template <device Dev>
void add_values(std::vector<out_piece<Dev>>& out, nn::parameters<Dev>& reg, bool moments, auto&& writes) {
  for (auto& p : reg) {
    if (!writes(p)) continue;
    out.push_back({&p, "value", 0, p.numel, p.value.data()});
    if (moments && p.m.size() == p.numel) {
      out.push_back({&p, "adamw.m", 0, p.numel, p.m.data()});
      out.push_back({&p, "adamw.v", 0, p.numel, p.v.data()});
    }
  }
}

}  // namespace ckpt

// A model on one rank (or one replica's rank without data parallelism): every rank writes its
// parameters and stage-0 moments. `world`: every rank of the job.
template <class Model>
void save_checkpoint(const std::filesystem::path& dir, Model& model, communicator& world, const checkpoint_state& st = {}) {
  using Dev = typename Model::device_type;
  std::vector<ckpt::out_piece<Dev>> pieces;
  ckpt::add_values(pieces, model.params(), true, [](const nn::parameter<Dev>&) { return true; });
  ckpt::write(dir, world, pieces, st, nlohmann::json::object());
}

// A data-parallel job: values (and stage-0 moments) from dp rank 0 (experts: expert_dp rank 0),
// stage-1 moments from every dp rank's shard.
template <class Model>
void save_checkpoint(const std::filesystem::path& dir, data_parallel<Model>& dp, communicator& world, const checkpoint_state& st = {}) {
  using Dev = typename Model::device_type;
  auto& reg = dp.model().params();
  std::vector<ckpt::out_piece<Dev>> pieces;
  const bool first_dp = dp.dp().rank() == 0, first_edp = dp.options().expert_dp ? dp.options().expert_dp->rank() == 0 : first_dp;
  ckpt::add_values(pieces, reg, dp.zero_stage() == 0, [&](const nn::parameter<Dev>& p) { return dp.expert(p) ? first_edp : first_dp; });
  if (dp.zero_stage() == 1 && dp.has_shard_moments()) {
    const auto moments = dp.shard_moments();  // (no structured binding: Clang 14 cannot capture one)
    const std::span<float> m = moments.first, v = moments.second;
    dp.for_owned([&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
      pieces.push_back({&p, "adamw.m", off, off + cnt, m.data() + at});
      pieces.push_back({&p, "adamw.v", off, off + cnt, v.data() + at});
    });
  }
  const nlohmann::json layout = {{"dp", dp.dp().size()}, {"zero_stage", dp.zero_stage()}};
  ckpt::write(dir, world, pieces, st, layout);
}

// Loads what this rank needs of a checkpoint saved on any layout; returns its state (step, extra).
template <class Model>
checkpoint_state load_checkpoint(const std::filesystem::path& dir, Model& model) {
  const ckpt::index ix = ckpt::read(dir);
  ckpt::load_values(ix, model.params());
  ckpt::load_moments(ix, model.params());
  return ix.state;
}
template <class Model>
checkpoint_state load_checkpoint(const std::filesystem::path& dir, data_parallel<Model>& dp) {
  using Dev = typename Model::device_type;
  const ckpt::index ix = ckpt::read(dir);
  auto& reg = dp.model().params();
  ckpt::load_values(ix, reg);
  if (dp.zero_stage() == 0) {
    ckpt::load_moments(ix, reg);
  } else {
    bool any = false;
    for (auto& p : reg) any = any || ckpt::has_kind(ix, p.name, "adamw.m");
    if (any) {
      const auto moments = dp.shard_moments();  // (no structured binding: Clang 14 cannot capture one)
      const std::span<float> m = moments.first, v = moments.second;
      dp.for_owned([&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
        const auto g = ckpt::geometry_of(p);
        ckpt::assemble(ix, p.name, ckpt::global_shape_of(p), "adamw.m", g, off, off + cnt, m.data() + at);
        ckpt::assemble(ix, p.name, ckpt::global_shape_of(p), "adamw.v", g, off, off + cnt, v.data() + at);
      });
    }
  }
  return ix.state;
}

}  // namespace dist
}  // namespace v0
}  // namespace tessel
