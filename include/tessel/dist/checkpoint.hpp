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
//                         state, ...), the saving layout, each file's size and content hash
//                         (ckpt::content_hash: four FNV-1a 64 lanes over 8-byte words), and for a
//                         delta its "base": the checkpoint it changes, relative to this one, and
//                         "base_hash", the content hash of the base's manifest (a base rewritten
//                         since is refused at load).
// A delta's files hold only the runs of blocks whose bytes changed since its base; loading reads
// the delta's pieces before its base's (the newest piece covering an element wins), down the chain
// to a full checkpoint.
// Saves are synchronous (save_checkpoint) or asynchronous and optionally incremental
// (checkpointer): the state is copied to host memory, the call returns, and a thread writes it.
// Either way each rank writes its file and then a marker with the file's size and hash; world rank
// 0 collects the markers into the manifest. The only collective is before the writing starts; a
// rank whose write fails leaves a failure marker, so the others fail at once instead of waiting.
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
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
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
  std::uint64_t step = 0;                         // optimizer steps taken (AdamW's bias correction)
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
inline shard_geometry geometry(const std::vector<std::size_t>& global_shape, std::size_t dim, std::size_t offset, std::size_t length,
                               const std::string& who) {
  if (global_shape.empty()) return {};
  if (dim >= global_shape.size() || offset > global_shape[dim] || length > global_shape[dim] - offset)
    throw dist_error(errc::format, who + ": shard [" + std::to_string(offset) + ", " + std::to_string(offset + length) + ") along dim " +
                                       std::to_string(dim) + " does not fit the shape " + io::detail::shape_string(global_shape));
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

// A piece found in a checkpoint.
struct in_piece {
  std::string kind;
  std::vector<std::size_t> shape;
  shard_geometry geo;
  std::size_t first = 0, last = 0;
  const float* data = nullptr;
};

// A piece to write: [first, last) of a parameter's local shard, of one kind. Its place is copied
// out of the parameter (a background write must not read a model that may be gone by then);
// `data` points at element `first`, in the live model or in a staged copy.
struct out_piece {
  std::string param, kind;
  std::vector<std::size_t> shape;  // the global shape
  std::size_t dim = 0, offset = 0, length = 1;
  std::size_t first = 0, last = 0;
  const float* data = nullptr;
  std::string key() const { return kind + "/" + param + "/" + std::to_string(first); }
};
template <device Dev>
out_piece piece(const nn::parameter<Dev>& p, std::string kind, std::size_t first, std::size_t last, const float* data) {
  const shard_geometry g = geometry_of(p);
  return {p.name, std::move(kind), global_shape_of(p), p.shard.dim, g.offset, g.length, first, last, data};
}

// A rank's pieces with their data: borrowed from the model (a synchronous save) or copied into
// `store` (staged: the model trains on while the copy is written).
struct snapshot {
  std::vector<out_piece> pieces;
  std::unique_ptr<float[]> store;
  std::size_t elements = 0, capacity = 0;  // in use; in store
};
// `reuse`: an earlier snapshot nobody else holds, whose store is taken when it is large enough (a
// fresh allocation costs a page fault per 4 KiB on first touch: half the copy's time).
inline std::shared_ptr<snapshot> stage(std::vector<out_piece> pieces, bool copy, std::shared_ptr<snapshot> reuse = nullptr) {
  auto s = std::make_shared<snapshot>();
  for (const auto& p : pieces) s->elements = tessel::detail::add_checked(s->elements, p.last - p.first, "checkpoint: staged elements");
  s->pieces = std::move(pieces);
  if (!copy) return s;
  const std::size_t bytes = tessel::detail::mul_checked(s->elements, sizeof(float), "checkpoint: staged bytes");
  if (reuse && reuse.use_count() == 1 && reuse->capacity >= s->elements) {
    s->store = std::move(reuse->store), s->capacity = reuse->capacity;
  } else {
    s->store.reset(new float[s->elements]);  // not zeroed: every element is copied below
    s->capacity = s->elements;
  }
  std::vector<std::size_t> at(s->pieces.size() + 1, 0);  // each piece's place in the store
  for (std::size_t i = 0; i < s->pieces.size(); ++i) at[i + 1] = at[i] + (s->pieces[i].last - s->pieces[i].first);
  // store[lo, hi) from the pieces; large states copy on up to 4 threads (one copy does not fill
  // the memory bandwidth, and the copy is what the training waits for)
  auto copy_range = [&](std::size_t lo, std::size_t hi) {
    std::size_t i = std::size_t(std::upper_bound(at.begin(), at.end(), lo) - at.begin()) - 1;
    for (; lo < hi; ++i) {
      const std::size_t end = std::min(hi, at[i + 1]);
      if (end > lo) std::memcpy(s->store.get() + lo, s->pieces[i].data + (lo - at[i]), (end - lo) * sizeof(float));
      lo = std::max(lo, end);
    }
  };
  const std::size_t n = bytes >= (std::size_t(32) << 20) ? std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 4) : 1;
  std::vector<std::thread> helpers;
  for (std::size_t t = 1; t < n; ++t) helpers.emplace_back(copy_range, s->elements * t / n, s->elements * (t + 1) / n);
  copy_range(0, s->elements / n);
  for (auto& h : helpers) h.join();
  for (std::size_t i = 0; i < s->pieces.size(); ++i) s->pieces[i].data = s->store.get() + at[i];
  return s;
}

// What `cur` must write as a delta on `prev` (the same rank's previous snapshot): of each piece,
// the blocks of `block` elements whose bytes differ, merged into runs; a piece `prev` does not hold
// at the same place, whole. The comparison is of bytes, exact: an unchanged block is skipped only
// when every bit of it is the same.
inline std::vector<out_piece> changed(const snapshot& cur, const snapshot& prev, std::size_t block) {
  std::unordered_map<std::string, const out_piece*> old;
  for (const auto& p : prev.pieces) old.emplace(p.key(), &p);
  std::vector<out_piece> out;
  auto sub = [&](const out_piece& c, std::size_t a, std::size_t b) {
    out_piece x = c;
    x.first = c.first + a, x.last = c.first + b, x.data = c.data + a;
    out.push_back(std::move(x));
  };
  for (const auto& c : cur.pieces) {
    const auto it = old.find(c.key());
    const out_piece* o = it == old.end() ? nullptr : it->second;
    if (!o || o->last != c.last || o->shape != c.shape || o->dim != c.dim || o->offset != c.offset || o->length != c.length) {
      out.push_back(c);
      continue;
    }
    const std::size_t n = c.last - c.first;
    std::size_t run = n;  // n: no open run
    for (std::size_t i = 0; i < n; i += block) {
      const std::size_t len = std::min(block, n - i);
      const bool diff = std::memcmp(c.data + i, o->data + i, len * sizeof(float)) != 0;
      if (diff && run == n) run = i;
      if (!diff && run != n) sub(c, run, i), run = n;
    }
    if (run != n) sub(c, run, n);
  }
  return out;
}

inline constexpr std::size_t max_manifest_bytes = std::size_t(64) << 20;

// A manifest's bytes (at most max_manifest_bytes) and their content hash.
inline std::pair<std::string, std::string> manifest_text(const std::filesystem::path& mpath) {
  std::ifstream f(mpath, std::ios::binary);
  if (!f) throw dist_error(errc::io, "checkpoint: no manifest " + mpath.string());
  std::string text;
  char buf[1 << 16];
  while (f) {
    f.read(buf, sizeof buf);
    text.append(buf, std::size_t(f.gcount()));
    if (text.size() > max_manifest_bytes)
      throw dist_error(errc::format, "checkpoint: " + mpath.string() + " is larger than " + std::to_string(max_manifest_bytes) + " bytes");
  }
  content_hash h;
  h.add(std::as_bytes(std::span<const char>(text.data(), text.size())));
  return {std::move(text), hex(h.value())};
}

inline std::string done_file(int w) { return rank_file(w) + ".done"; }

// Polls for `f` (written by another rank or thread through a rename: it appears whole).
inline std::string failed_file(int w) { return rank_file(w) + ".failed"; }
inline constexpr const char* checkpoint_failed = "checkpoint.failed";

// Polls until one of `files` appears (each written by another rank or thread through a rename: it
// appears whole); returns its index.
inline std::size_t wait_for_any(const std::vector<std::filesystem::path>& files, std::chrono::steady_clock::time_point deadline,
                                const std::string& what) {
  auto nap = std::chrono::microseconds(50);
  for (;;) {
    for (std::size_t i = 0; i < files.size(); ++i) {
      std::error_code ec;
      if (std::filesystem::exists(files[i], ec)) return i;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw dist_error(errc::timeout, "checkpoint: " + what + ": " + files[0].string() + " did not appear in time");
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(20000));
  }
}
inline std::string small_file_text(const std::filesystem::path& f) {
  std::ifstream in(f);
  std::string t;
  std::getline(in, t);
  return t.substr(0, 1000);
}
inline void write_small_file(const std::filesystem::path& f, const std::string& text) {
  tessel::io::detail::atomic_file out(f);
  out.write(std::as_bytes(std::span<const char>(text.data(), text.size())));
  out.commit();
}

// One rank's part of a save after its state is staged: its file (tmp, fsync, rename), then a
// marker with the file's size and hash. World rank 0 waits for every marker, writes the manifest
// (the checkpoint exists once it does: written last, whole or not at all) and removes the markers;
// the other ranks wait for the manifest. No collective runs here, so it can run on a thread of its
// own beside the training's collectives.
struct save_job {
  std::filesystem::path dir;
  int rank = 0, ranks = 1;
  std::shared_ptr<const snapshot> snap;  // what to write (keeps a staged copy alive)
  std::shared_ptr<const snapshot> base;  // a delta: the base's snapshot (only changed(snap, base) is written)
  std::size_t block = 0;                 // a delta's block
  nlohmann::json manifest;               // world rank 0: the manifest but its "files"
  std::chrono::milliseconds timeout{};
};
inline std::uint64_t run_save_steps(const save_job& j) {
  const auto deadline = std::chrono::steady_clock::now() + j.timeout;
  const std::vector<out_piece> write = j.base ? changed(*j.snap, *j.base, j.block) : j.snap->pieces;
  io::safetensors_writer w;
  for (const auto& pc : write) {
    const std::string name = pc.key();
    nlohmann::json m = {{"param", pc.param},   {"kind", pc.kind}, {"shape", pc.shape}, {"offset", pc.offset},
                        {"length", pc.length}, {"dim", pc.dim},   {"first", pc.first}, {"last", pc.last}};
    w.add_metadata(name, m.dump());
    w.add<float>(name, {pc.last - pc.first}, std::span<const float>(pc.data, pc.last - pc.first));
  }
  content_hash hash;
  std::uint64_t size = 0;
  w.write(j.dir / rank_file(j.rank), [&](std::span<const std::byte> b) {
    hash.add(b);
    size += b.size();
  });
  write_small_file(j.dir / done_file(j.rank), nlohmann::json{{"bytes", size}, {"hash", hex(hash.value())}}.dump());
  if (j.rank != 0) {
    if (wait_for_any({j.dir / checkpoint_manifest, j.dir / checkpoint_failed}, deadline,
                     "rank " + std::to_string(j.rank) + " waits for the manifest") == 1)
      throw dist_error(errc::fault,
                       "checkpoint: " + j.dir.string() + ": the save failed on another rank: " + small_file_text(j.dir / checkpoint_failed));
    return size;
  }
  nlohmann::json man = j.manifest;
  if (man.contains("base"))  // the base as it is now: a load refuses it once it is rewritten
    man["base_hash"] = manifest_text((j.dir / man["base"].get<std::string>()) / checkpoint_manifest).second;
  man["files"] = nlohmann::json::array();
  for (int r = 0; r < j.ranks; ++r) {
    const auto f = j.dir / done_file(r);
    if (wait_for_any({f, j.dir / failed_file(r)}, deadline, "rank 0 waits for rank " + std::to_string(r) + "'s file") == 1)
      throw dist_error(errc::fault,
                       "checkpoint: rank " + std::to_string(r) + " could not write its file: " + small_file_text(j.dir / failed_file(r)));
    std::ifstream in(f);
    nlohmann::json d = nlohmann::json::parse(in, nullptr, false);
    if (d.is_discarded() || !d.is_object() || !d.contains("bytes") || !d["bytes"].is_number_unsigned() || !d.contains("hash") ||
        !d["hash"].is_string())
      throw dist_error(errc::format, "checkpoint: " + f.string() + " is not a rank's size and hash");
    man["files"].push_back({{"name", rank_file(r)}, {"bytes", d["bytes"]}, {"hash", d["hash"]}});
  }
  write_small_file(j.dir / checkpoint_manifest, man.dump(1) + "\n");
  for (int r = 0; r < j.ranks; ++r) {
    std::error_code ec;
    std::filesystem::remove(j.dir / done_file(r), ec);
  }
  return size;
}
// A failing rank says so at once (best effort): rank 0 stops waiting for its file, and a failing
// rank 0 tells every rank (checkpoint.failed) instead of leaving them to wait for the manifest.
inline std::uint64_t run_save(const save_job& j) {
  try {
    return run_save_steps(j);
  } catch (const std::exception& e) {
    try {
      const std::string why = std::string(e.what()).substr(0, 1000) + "\n";
      write_small_file(j.dir / failed_file(j.rank), why);
      if (j.rank == 0) write_small_file(j.dir / checkpoint_failed, why);
    } catch (...) {}
    throw;
  }
}

// Before a save's collective: the directory exists, and this rank's marker (and, on world rank 0,
// the manifest) of an earlier save into it are gone, so no rank mistakes them for this save's.
inline void clear_for_save(const std::filesystem::path& dir, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw dist_error(errc::io, "checkpoint: cannot create " + dir.string() + ": " + ec.message());
  std::filesystem::remove(dir / done_file(rank), ec);
  std::filesystem::remove(dir / failed_file(rank), ec);
  if (rank == 0) std::filesystem::remove(dir / checkpoint_manifest, ec), std::filesystem::remove(dir / checkpoint_failed, ec);
}
// A save's one collective: every rank clears (clear_for_save) and shares `words`; returns every
// rank's words. A rank that could not clear throws its error, and the others a dist_error naming
// it, so that no rank goes on to wait for a file that never comes.
inline std::vector<std::uint64_t> prepare(const std::filesystem::path& dir, communicator& world, std::vector<std::uint64_t> words) {
  std::exception_ptr err;
  try {
    clear_for_save(dir, world.rank());
  } catch (...) { err = std::current_exception(); }
  words.push_back(err ? 0 : 1);
  std::vector<std::uint64_t> all(words.size() * std::size_t(world.size()));
  world.all_gather(std::span<const std::uint64_t>(words), std::span<std::uint64_t>(all));
  if (err) std::rethrow_exception(err);
  for (int r = 0; r < world.size(); ++r)
    if (all[(std::size_t(r) + 1) * words.size() - 1] == 0)
      throw dist_error(errc::io, "checkpoint: rank " + std::to_string(r) + " cannot prepare " + dir.string() + ": nothing was saved");
  return all;
}
inline nlohmann::json manifest_head(const checkpoint_state& st, const nlohmann::json& layout) {
  nlohmann::json j;
  j["format"] = checkpoint_format;
  j["step"] = st.step;
  j["extra"] = st.extra;
  j["layout"] = layout;
  return j;
}

// A synchronous save: the model's own memory is written (no staged copy).
inline void write(const std::filesystem::path& dir, communicator& world, std::vector<out_piece> pieces, const checkpoint_state& st,
                  const nlohmann::json& layout, std::chrono::milliseconds timeout) {
  prepare(dir, world, {});  // every rank has cleared its marker, rank 0 the manifest
  save_job j;
  j.dir = dir, j.rank = world.rank(), j.ranks = world.size(), j.timeout = timeout;
  j.snap = stage(std::move(pieces), false);
  if (j.rank == 0) j.manifest = manifest_head(st, layout);
  const auto idle = world.host_wait();  // waits for the other ranks' files
  run_save(j);
}

// The manifest and every file's pieces, by parameter (readers keep the mappings alive).
struct index {
  checkpoint_state state;
  nlohmann::json layout;
  std::vector<io::safetensors_reader> files;
  std::map<std::string, std::vector<in_piece>> pieces;
};

// The deepest chain of deltas a load follows (a base named in a manifest is read like any input).
inline constexpr std::size_t max_chain = 64;

// One checkpoint of a chain: its pieces go after those of the newer checkpoints already in `ix`
// (the first piece covering an element wins), then its base's, if it names one.
// `expect`: the manifest's content hash a delta on it recorded (empty: the newest of the chain).
inline void read_level(index& ix, const std::filesystem::path& dir, std::vector<std::filesystem::path>& seen, const std::string& expect = {}) {
  const auto mpath = dir / checkpoint_manifest;
  const auto [text, text_hash] = manifest_text(mpath);
  if (!expect.empty() && text_hash != expect)
    throw dist_error(errc::format, "checkpoint: " + mpath.string() + " was rewritten after a delta was saved on it (hash " + text_hash +
                                       ", the delta's base_hash " + expect + ")");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) { throw dist_error(errc::format, "checkpoint: " + mpath.string() + " is not JSON: " + e.what()); }
  auto bad = [&](const std::string& what) { return dist_error(errc::format, "checkpoint: " + mpath.string() + ": " + what); };
  if (!j.is_object() || !j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != checkpoint_format)
    throw bad("not a " + std::string(checkpoint_format) + " manifest");
  if (!j.contains("step") || !j["step"].is_number_unsigned()) throw bad("no step count");
  if (!j.contains("files") || !j["files"].is_array() || j["files"].empty()) throw bad("no files");
  const bool newest = seen.empty();
  std::error_code ec;
  seen.push_back(std::filesystem::weakly_canonical(dir, ec));
  if (newest) {
    ix.state.step = j["step"].get<std::uint64_t>();
    if (j.contains("extra") && j["extra"].is_object())
      for (const auto& [k, v] : j["extra"].items()) {
        if (!v.is_string()) throw bad("extra '" + k + "' is not a string");
        ix.state.extra[k] = v.get<std::string>();
      }
    ix.layout = j.value("layout", nlohmann::json::object());
  }
  std::filesystem::path base;
  std::string base_hash;
  if (j.contains("base")) {
    if (!j["base"].is_string() || j["base"].get<std::string>().empty()) throw bad("'base' is not a directory name");
    if (!j.contains("base_hash") || !j["base_hash"].is_string() || j["base_hash"].get<std::string>().empty())
      throw bad("a 'base' without its 'base_hash'");
    base_hash = j["base_hash"].get<std::string>();
    base = (dir / j["base"].get<std::string>()).lexically_normal();
    if (seen.size() >= max_chain) throw bad("a chain of more than " + std::to_string(max_chain) + " deltas");
    const auto canon = std::filesystem::weakly_canonical(base, ec);
    if (std::find(seen.begin(), seen.end(), canon) != seen.end()) throw bad("its chain of bases returns to " + base.string());
  }
  for (const auto& e : j["files"]) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("bytes") || !e["bytes"].is_number_unsigned() ||
        !e.contains("hash") || !e["hash"].is_string())
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
        throw dist_error(errc::format,
                         "checkpoint: " + path.string() + " has hash " + hex(h.value()) + ", the manifest says " + e["hash"].get<std::string>());
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
      if (!m.contains("param") || !m["param"].is_string() || !m.contains("kind") || !m["kind"].is_string() || !m.contains("shape") ||
          !m["shape"].is_array())
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
        throw dist_error(errc::format, "checkpoint: " + path.string() + ": '" + tname + "' does not fit its place [" + std::to_string(pc.first) +
                                           ", " + std::to_string(pc.last) + ") of " + param);
      pc.data = t.data<float>().span().data();  // the file is written aligned: a view into the mapping
      ix.pieces[param].push_back(std::move(pc));
    }
    ix.files.push_back(std::move(r));
  }
  if (!base.empty()) read_level(ix, base, seen, base_hash);
}

// A checkpoint and, for a delta, its chain of bases.
inline index read(const std::filesystem::path& dir) {
  index ix;
  std::vector<std::filesystem::path> seen;
  try {
    read_level(ix, dir, seen);
  } catch (const nlohmann::json::exception& e) {  // a field of an unexpected type the checks above missed: still a typed refusal
    throw dist_error(errc::format, "checkpoint: " + dir.string() + ": a manifest or piece field of the wrong type: " + e.what());
  } catch (const std::filesystem::filesystem_error& e) { throw dist_error(errc::io, "checkpoint: " + dir.string() + ": " + e.what()); }
  return ix;
}

// dst = elements [first, last) of a local shard with geometry `to` of `param`'s `kind`, from the
// checkpoint's pieces (the first piece covering an element wins: replicas hold the same bits).
inline void assemble(const index& ix, const std::string& param, const std::vector<std::size_t>& shape, const std::string& kind,
                     const shard_geometry& to, std::size_t first, std::size_t last, float* dst) {
  const auto it = ix.pieces.find(param);
  if (it == ix.pieces.end()) throw dist_error(errc::out_of_range, "checkpoint: no tensor '" + param + "' in the checkpoint");
  if (first >= last) return;  // nothing to fill (and an empty target has no rows to divide by)
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
    throw dist_error(errc::out_of_range, "checkpoint: " + kind + " of '" + param + "': element " + std::to_string(first + miss) +
                                             " of this rank's shard (and " + std::to_string(last - first - filled - 1) +
                                             " more) is in no piece of the checkpoint");
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
void add_values(std::vector<out_piece>& out, nn::parameters<Dev>& reg, bool moments, auto&& writes) {
  for (auto& p : reg) {
    if (!writes(p)) continue;
    out.push_back(piece(p, "value", 0, p.numel, p.value.data()));
    if (moments && p.m.size() == p.numel) {
      out.push_back(piece(p, "adamw.m", 0, p.numel, p.m.data()));
      out.push_back(piece(p, "adamw.v", 0, p.numel, p.v.data()));
    }
  }
}

// What a rank writes of a model, and the layout the manifest records.
// A model on one rank (or one replica's rank without data parallelism): its parameters and
// stage-0 moments.
template <class Model>
std::pair<std::vector<out_piece>, nlohmann::json> collect(Model& model) {
  using Dev = typename Model::device_type;
  std::vector<out_piece> pieces;
  add_values(pieces, model.params(), true, [](const nn::parameter<Dev>&) { return true; });
  return {std::move(pieces), nlohmann::json::object()};
}
// A data-parallel job: values (and stage-0 moments) from dp rank 0 (experts: expert_dp rank 0),
// stage-1 moments from every dp rank's shard.
template <class Model>
std::pair<std::vector<out_piece>, nlohmann::json> collect(data_parallel<Model>& dp) {
  using Dev = typename Model::device_type;
  auto& reg = dp.model().params();
  std::vector<out_piece> pieces;
  const bool first_dp = dp.dp().rank() == 0, first_edp = dp.options().expert_dp ? dp.options().expert_dp->rank() == 0 : first_dp;
  add_values(pieces, reg, dp.zero_stage() == 0, [&](const nn::parameter<Dev>& p) { return dp.expert(p) ? first_edp : first_dp; });
  if (dp.zero_stage() == 1 && dp.has_shard_moments()) {
    const auto moments = dp.shard_moments();  // (no structured binding: Clang 14 cannot capture one)
    const std::span<float> m = moments.first, v = moments.second;
    dp.for_owned([&](nn::parameter<Dev>& p, std::size_t off, std::size_t cnt, std::size_t at) {
      pieces.push_back(piece(p, "adamw.m", off, off + cnt, m.data() + at));
      pieces.push_back(piece(p, "adamw.v", off, off + cnt, v.data() + at));
    });
  }
  return {std::move(pieces), nlohmann::json{{"dp", dp.dp().size()}, {"zero_stage", dp.zero_stage()}}};
}

}  // namespace ckpt

// Saves a checkpoint and returns once it is on disk, on every rank. `model`: a model (every rank
// writes its parameters and stage-0 moments) or a data_parallel job (ckpt::collect). `world`: every
// rank of the job; every rank calls it.
template <class Model>
void save_checkpoint(const std::filesystem::path& dir, Model& model, communicator& world, const checkpoint_state& st = {},
                     std::chrono::milliseconds timeout = std::chrono::minutes(10)) {
  auto plan = ckpt::collect(model);
  ckpt::write(dir, world, std::move(plan.first), st, plan.second, timeout);
}

// ---- asynchronous and incremental saves ---------------------------------------------------------

struct checkpointer_options {
  // A save is a delta on this checkpointer's previous one (its base, named in the manifest) when
  // every rank has a previous save that became durable and the directory is not one of the chain's
  // (that would overwrite what the delta reads): only the blocks whose bytes changed are written,
  // and loading reads the chain back to its full checkpoint. The chain's directories must be kept
  // as long as a delta on them is.
  bool incremental = false;
  std::size_t delta_block = 1024;                                // elements per compared block
  std::size_t max_deltas = 16;                                   // deltas in a row before the next full checkpoint (bounds a load's chain)
  std::chrono::milliseconds timeout = std::chrono::minutes(10);  // how long a save waits for the other ranks' files
};

// What one save did on this rank.
struct save_report {
  bool delta = false;               // written as a delta on the previous save
  std::uint64_t staged_bytes = 0;   // this rank's state, copied before save() returned
  std::uint64_t written_bytes = 0;  // this rank's file (once durable)
  double stage_seconds = 0;         // save()'s own time (the copy): the training's stall
  double write_seconds = 0;         // from staged to durable
};

// A save in flight. Every rank's durable() turns true once the whole checkpoint is on disk (its
// manifest written); wait() blocks until then and rethrows the save's error on this rank.
class checkpoint_future {
 public:
  checkpoint_future() = default;
  bool valid() const { return st_ != nullptr; }
  bool durable() const {
    if (!st_) return false;
    std::lock_guard lk(st_->mu);
    return st_->done && !st_->err;
  }
  // The save has ended, durable or failed.
  bool finished() const {
    if (!st_) return false;
    std::lock_guard lk(st_->mu);
    return st_->done;
  }
  save_report wait() const {
    if (!st_) throw dist_error(errc::invalid_argument, "checkpoint_future: no save");
    std::unique_lock lk(st_->mu);
    st_->cv.wait(lk, [&] { return st_->done; });
    if (st_->err) std::rethrow_exception(st_->err);
    return st_->report;
  }

 private:
  friend class checkpointer;
  friend class tiered_checkpointer;
  struct state {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr err;
    save_report report;
  };
  std::shared_ptr<state> st_;
};

// Asynchronous, optionally incremental, saves (PyTorch DCP's async_save with a delta on top): one
// per rank, kept across the training. save() copies this rank's state into host memory (the stage;
// the model may step on as soon as it returns), agrees with the other ranks whether this save is a
// delta (one small all_gather: the only collective), and writes on a thread of its own. One save is
// in flight at a time: the next save() first waits for the previous one. A save that failed is
// never a delta's base: the next save is full.
class checkpointer {
 public:
  explicit checkpointer(checkpointer_options o = {}) : o_(o) {
    if (o_.delta_block == 0) throw dist_error(errc::invalid_argument, "checkpointer: delta_block must be > 0");
  }
  checkpointer(const checkpointer&) = delete;
  checkpointer& operator=(const checkpointer&) = delete;
  checkpointer(checkpointer&&) noexcept = default;  // (the writing thread holds no pointer to it)
  checkpointer& operator=(checkpointer&&) = delete;
  ~checkpointer() {
    if (worker_.joinable()) worker_.join();  // its error stays in its future
  }

  template <class Model>
  checkpoint_future save(const std::filesystem::path& dir, Model& model, communicator& world, const checkpoint_state& st = {}) {
    auto plan = ckpt::collect(model);
    return start(dir, std::move(plan.first), world, st, plan.second);
  }
  // The previous save's future (invalid before the first save).
  const checkpoint_future& last() const { return last_; }
  // The directories the previous save needs to load: its chain's full checkpoint, then its deltas,
  // itself last.
  const std::vector<std::filesystem::path>& chain() const { return chain_; }

 private:
  checkpoint_future start(const std::filesystem::path& dir, std::vector<ckpt::out_piece> pieces, communicator& world, const checkpoint_state& st,
                          const nlohmann::json& layout) {
    if (worker_.joinable()) {
      const auto idle = world.host_wait();
      worker_.join();
    }
    if (last_.valid()) {
      std::lock_guard lk(last_.st_->mu);
      if (last_.st_->err) prev_.reset();
    }
    // the store to reuse: the previous save's (written), or with deltas the one before it (the
    // previous save is this one's base)
    std::shared_ptr<ckpt::snapshot> recycle = std::move(o_.incremental ? spare_ : last_snap_);
    const auto t0 = std::chrono::steady_clock::now();
    const std::filesystem::path here = std::filesystem::absolute(dir).lexically_normal();
    // may this rank write a delta, and on which base? Not into a directory of the current chain:
    // that would overwrite what the delta reads.
    const bool can = o_.incremental && prev_ && deltas_ < o_.max_deltas && std::find(chain_.begin(), chain_.end(), here) == chain_.end();
    const std::uint64_t base_id = std::hash<std::string>{}(prev_dir_.string());
    const auto all = ckpt::prepare(dir, world, {can ? 1u : 0u, base_id});  // (3 words a rank: can, base, prepared)
    bool delta = true;
    for (int r = 0; r < world.size(); ++r) delta = delta && all[3 * std::size_t(r)] == 1 && all[3 * std::size_t(r) + 1] == base_id;

    ckpt::save_job j;
    j.dir = dir, j.rank = world.rank(), j.ranks = world.size(), j.timeout = o_.timeout;
    auto snap = ckpt::stage(std::move(pieces), true, std::move(recycle));
    if (delta) j.base = prev_, j.block = o_.delta_block;  // compared on the writing thread: both snapshots are immutable
    if (j.rank == 0) {
      j.manifest = ckpt::manifest_head(st, layout);
      if (delta) {
        std::filesystem::path rel = prev_dir_.lexically_relative(here);
        j.manifest["base"] = (rel.empty() ? prev_dir_ : rel).generic_string();
      }
    }
    j.snap = snap;
    if (o_.incremental) spare_ = std::move(prev_);
    prev_ = o_.incremental ? snap : nullptr;
    last_snap_ = snap;
    prev_dir_ = here;
    deltas_ = delta ? deltas_ + 1 : 0;
    if (!delta) chain_.clear();
    chain_.push_back(here);

    checkpoint_future f;
    f.st_ = std::make_shared<checkpoint_future::state>();
    f.st_->report.delta = delta;
    f.st_->report.staged_bytes = snap->elements * sizeof(float);
    const auto t1 = std::chrono::steady_clock::now();
    f.st_->report.stage_seconds = std::chrono::duration<double>(t1 - t0).count();
    last_ = f;
    worker_ = std::thread([st = f.st_, j = std::move(j), t1]() {
      std::exception_ptr err;
      std::uint64_t bytes = 0;
      try {
        bytes = ckpt::run_save(j);
      } catch (...) { err = std::current_exception(); }
      std::lock_guard lk(st->mu);
      st->err = err;
      st->report.written_bytes = bytes;
      st->report.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      st->done = true;
      st->cv.notify_all();
    });
    return f;
  }

  checkpointer_options o_;
  std::thread worker_;
  checkpoint_future last_;
  std::shared_ptr<ckpt::snapshot> prev_;       // the base of the next delta
  std::shared_ptr<ckpt::snapshot> spare_;      // with deltas: the base before it (its store is reused)
  std::shared_ptr<ckpt::snapshot> last_snap_;  // the last save's (its store is reused)
  std::filesystem::path prev_dir_;
  std::vector<std::filesystem::path> chain_;  // the directories of the current chain: its full save, then its deltas
  std::size_t deltas_ = 0;
};

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

// ---- tiers ------------------------------------------------------------------------------------

// A tier of checkpoints: a directory with its own interval and retention. Tiers are how a job keeps
// frequent cheap copies and rare durable ones, e.g. a tmpfs directory every step keeping 10, a local
// disk every 100 steps keeping 3, a remote mount every 1000 steps keeping all.
struct checkpoint_tier {
  std::filesystem::path dir;          // each checkpoint in dir/step-<12 digits>
  std::uint64_t every = 1;            // saves at the steps that are multiples of it
  std::size_t keep = 1;               // the newest durable checkpoints kept (0: all)
  checkpointer_options options = {};  // incremental or not, its blocks and chain length, the timeout
};

inline std::filesystem::path tier_checkpoint_dir(const checkpoint_tier& t, std::uint64_t step) {
  char s[32];
  std::snprintf(s, sizeof s, "step-%012llu", static_cast<unsigned long long>(step));
  return t.dir / s;
}

// The checkpoints the tiers hold on disk (every step-* directory with a manifest) as (tier, step),
// newest step first (for a step in several tiers, the earlier tier's first): what a restart tries
// in order.
inline std::vector<std::pair<std::size_t, std::uint64_t>> restorable(const std::vector<checkpoint_tier>& tiers) {
  std::vector<std::pair<std::size_t, std::uint64_t>> found;
  for (std::size_t i = 0; i < tiers.size(); ++i) {
    std::error_code ec;
    for (std::filesystem::directory_iterator it(tiers[i].dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() != 17 || name.rfind("step-", 0) != 0 || name.find_first_not_of("0123456789", 5) != std::string::npos) continue;
      if (!std::filesystem::exists(it->path() / checkpoint_manifest)) continue;
      found.push_back({i, std::stoull(name.substr(5))});
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
  return found;
}
// World rank 0's `words` (a list of any length) on every rank: its length, then the list.
inline void broadcast_from_rank0(communicator& world, std::vector<std::uint64_t>& words) {
  std::uint64_t n = words.size();
  world.broadcast(std::span<std::uint64_t>(&n, 1), 0);
  words.resize(n);
  if (n > 0) world.broadcast(std::span<std::uint64_t>(words), 0);
}
// Saves to every tier due at a step (asynchronously, each tier through its own checkpointer) and
// applies the tiers' retention: once a tier has `keep` durable checkpoints newer than an older one,
// world rank 0 removes the older one, unless a kept delta (or a save in flight) reads it. Nothing
// is removed before a newer checkpoint of its tier is on disk, and a failed save is removed with
// its error kept for wait(). The checkpoints the tiers hold before its first save (a restarted
// job's) are kept under the same rules.
class tiered_checkpointer {
 public:
  explicit tiered_checkpointer(std::vector<checkpoint_tier> tiers) {
    if (tiers.empty()) throw dist_error(errc::invalid_argument, "tiered_checkpointer: no tiers");
    for (std::size_t i = 0; i < tiers.size(); ++i) {
      const auto& t = tiers[i];
      if (t.dir.empty() || t.every == 0)
        throw dist_error(errc::invalid_argument, "tiered_checkpointer: tier " + std::to_string(i) + " needs a directory and an interval > 0");
      for (std::size_t k = 0; k < i; ++k)
        if (std::filesystem::absolute(tiers[k].dir).lexically_normal() == std::filesystem::absolute(t.dir).lexically_normal())
          throw dist_error(errc::invalid_argument,
                           "tiered_checkpointer: tiers " + std::to_string(k) + " and " + std::to_string(i) + " share " + t.dir.string());
      tiers_.push_back({t, checkpointer(t.options), {}});
    }
  }

  // Every rank calls it at every step (a tier not due does nothing); returns how many tiers saved.
  template <class Model>
  std::size_t save(std::uint64_t step, Model& model, communicator& world, checkpoint_state st = {}) {
    st.step = step;
    adopt(world);
    std::size_t saved = 0;
    for (auto& t : tiers_) {
      if (step % t.spec.every != 0) continue;
      const auto dir = tier_checkpoint_dir(t.spec, step);
      std::erase_if(t.saves, [&](const save_entry& e) { return e.dir == dir; });  // rewritten (a restarted job's step again)
      auto f = t.ck.save(dir, model, world, st);
      t.saves.push_back({step, dir, t.ck.chain(), std::move(f)});
      ++saved;
      prune(t, world.rank() == 0);
    }
    return saved;
  }
  // Waits for every save in flight, applies retention, and rethrows the first failed save's error.
  void wait(communicator& world) {
    adopt(world);
    std::exception_ptr first;
    for (auto& t : tiers_) {
      for (auto& s : t.saves) try {
          const auto idle = world.host_wait();
          s.f.wait();
        } catch (...) {
          if (!first) first = std::current_exception();
        }
      prune(t, world.rank() == 0);
    }
    if (first) std::rethrow_exception(first);
  }
  // What each tier holds on this rank's view: its checkpoints' directories, oldest first.
  std::vector<std::filesystem::path> held(std::size_t tier) const {
    if (tier >= tiers_.size()) throw dist_error(errc::out_of_range, "tiered_checkpointer: no tier " + std::to_string(tier));
    std::vector<std::filesystem::path> out;
    for (const auto& s : tiers_[tier].saves) out.push_back(s.dir);
    return out;
  }

 private:
  struct save_entry {
    std::uint64_t step;
    std::filesystem::path dir;
    std::vector<std::filesystem::path> chain;  // what it needs to load, itself included
    checkpoint_future f;
  };
  struct tier_state {
    checkpoint_tier spec;
    checkpointer ck;
    std::vector<save_entry> saves;  // oldest first
  };
  // Drops failed saves, then the checkpoints older than the tier's newest `keep` durable ones that
  // no newer save needs; world rank 0 removes their directories.
  static void prune(tier_state& t, bool remover) {
    auto gone = [&](const std::filesystem::path& d) {
      if (!remover) return;
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    };
    // a failed save goes once a newer save of the tier has started: every rank had ended the failed
    // one's writing by then (a checkpointer's next save waits for its previous one), so nobody
    // still writes into the directory removed
    std::vector<save_entry> kept;
    for (std::size_t i = 0; i < t.saves.size(); ++i) {
      auto& s = t.saves[i];
      if (s.f.finished() && !s.f.durable() && i + 1 < t.saves.size()) {
        gone(s.dir);
        continue;
      }
      kept.push_back(std::move(s));
    }
    t.saves = std::move(kept);
    if (t.spec.keep == 0) return;
    // the oldest of the newest `keep` durable ones: everything before it is a candidate
    std::size_t durable = 0, cut = 0;
    for (std::size_t i = t.saves.size(); i-- > 0;)
      if (t.saves[i].f.durable() && ++durable == t.spec.keep) {
        cut = i;
        break;
      }
    if (durable < t.spec.keep) return;
    std::vector<std::filesystem::path> needed;
    for (std::size_t i = cut; i < t.saves.size(); ++i) needed.insert(needed.end(), t.saves[i].chain.begin(), t.saves[i].chain.end());
    std::vector<save_entry> rest;
    for (std::size_t i = 0; i < t.saves.size(); ++i) {
      const bool need =
          i >= cut || std::find(needed.begin(), needed.end(), std::filesystem::absolute(t.saves[i].dir).lexically_normal()) != needed.end();
      if (need)
        rest.push_back(std::move(t.saves[i]));
      else
        gone(t.saves[i].dir);
    }
    t.saves = std::move(rest);
  }

  // A restarted job's tiers already hold checkpoints: at the first save (or wait) they are kept
  // under the same retention, as durable saves with the chains their manifests name (the next save
  // is full: no snapshot of them is in memory). World rank 0 reads the tiers and sends what it
  // found to every rank (before any rank's save can change them), so all ranks hold the same list.
  void adopt(communicator& world) {
    if (adopted_) return;
    adopted_ = true;
    std::vector<std::uint64_t> words;  // per checkpoint: tier, step, chain length, the chain's steps (its full one first)
    if (world.rank() == 0) {
      std::vector<checkpoint_tier> specs;
      for (const auto& t : tiers_) specs.push_back(t.spec);
      auto found = restorable(specs);
      std::reverse(found.begin(), found.end());  // oldest first
      for (const auto& [tier, step] : found) {
        std::vector<std::uint64_t> chain{step};
        auto at = tier_checkpoint_dir(specs[tier], step);
        while (chain.size() < ckpt::max_chain) {  // its bases: checkpoints of the same tier
          nlohmann::json j;
          try {
            j = nlohmann::json::parse(ckpt::manifest_text(at / checkpoint_manifest).first);
          } catch (const std::exception&) {
            break;  // unreadable: it keeps itself only (a load refuses it)
          }
          if (!j.is_object() || !j.contains("base") || !j["base"].is_string()) break;
          const auto base = (at / j["base"].get<std::string>()).lexically_normal();
          const std::string name = base.filename().string();
          if (base.parent_path() != at.parent_path() || name.size() != 17 || name.rfind("step-", 0) != 0 ||
              name.find_first_not_of("0123456789", 5) != std::string::npos)
            break;  // a base outside the tier is not the tier's to keep
          chain.insert(chain.begin(), std::stoull(name.substr(5)));
          at = base;
        }
        words.push_back(tier), words.push_back(step), words.push_back(chain.size());
        words.insert(words.end(), chain.begin(), chain.end());
      }
    }
    broadcast_from_rank0(world, words);
    for (std::size_t i = 0; i + 3 <= words.size();) {
      const std::size_t tier = words[i], len = words[i + 2];
      if (tier >= tiers_.size() || len > words.size() - i - 3) throw dist_error(errc::format, "tiered_checkpointer: rank 0 sent a bad list");
      auto& t = tiers_[tier];
      std::vector<std::filesystem::path> chain;
      for (std::size_t k = 0; k < len; ++k)
        chain.push_back(std::filesystem::absolute(tier_checkpoint_dir(t.spec, words[i + 3 + k])).lexically_normal());
      checkpoint_future f;
      f.st_ = std::make_shared<checkpoint_future::state>();
      f.st_->done = true;
      t.saves.push_back({words[i + 1], tier_checkpoint_dir(t.spec, words[i + 1]), std::move(chain), std::move(f)});
      i += 3 + len;
    }
  }

  bool adopted_ = false;
  std::vector<tier_state> tiers_;
};

inline std::vector<std::filesystem::path> restorable_checkpoints(const std::vector<checkpoint_tier>& tiers) {
  std::vector<std::filesystem::path> out;
  for (const auto& [tier, step] : restorable(tiers)) out.push_back(tier_checkpoint_dir(tiers[tier], step));
  return out;
}

// Restarts from the tiers (recovery by restart: after a crash, or under MPI, which has no way to
// shrink a job, relaunched by tools/mpirun-resume): loads the newest checkpoint the tiers hold that
// loads on every rank. World rank 0 lists the candidates and sends their steps; a candidate that
// fails on any rank (incomplete, corrupted, a base gone) is passed over by all, agreed through one
// all_reduce. Returns its state, or nullopt when none loads (a fresh start); `from`, if given, is
// set to the directory loaded. Every rank calls it.
template <class Model>
std::optional<checkpoint_state> resume(const std::vector<checkpoint_tier>& tiers, Model& model, communicator& world,
                                       std::filesystem::path* from = nullptr) {
  std::vector<std::uint64_t> cand;  // (tier, step) pairs, newest first, as world rank 0 sees them
  if (world.rank() == 0)
    for (const auto& [tier, step] : restorable(tiers)) cand.push_back(tier), cand.push_back(step);
  broadcast_from_rank0(world, cand);
  for (std::size_t c = 0; c + 1 < cand.size(); c += 2) {
    if (cand[c] >= tiers.size()) throw dist_error(errc::out_of_range, "resume: rank 0 named tier " + std::to_string(cand[c]));
    const auto dir = tier_checkpoint_dir(tiers[cand[c]], cand[c + 1]);
    std::optional<checkpoint_state> st;
    try {
      st = load_checkpoint(dir, model);
    } catch (const tessel::error&) {}
    std::uint64_t ok = st ? 1 : 0;
    world.all_reduce(std::span<std::uint64_t>(&ok, 1), reduce_op::min);
    if (ok == 1) {
      if (from) *from = dir;
      return st;
    }
  }
  return std::nullopt;
}

}  // namespace dist
}  // namespace v0
}  // namespace tessel
