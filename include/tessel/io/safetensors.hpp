// safetensors files: a validating reader that maps the file and hands out zero-copy tensor views
// (copies when an element is misaligned), a writer that round-trips bit-exact, and sharded
// checkpoints through Hugging Face's model.safetensors.index.json.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/io/detail/file.hpp>
#include <tessel/io/errors.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {
namespace io {

// The format stores every number little-endian; views hand out the bytes as they are.
static_assert(std::endian::native == std::endian::little, "tessel::io reads safetensors on little-endian hosts only");

// Element types a safetensors file may name (the format's spelling in st_dtype_name).
enum class st_dtype : std::uint8_t { f64, f32, f16, bf16, f8_e4m3, f8_e5m2, i64, i32, i16, i8, u64, u32, u16, u8, boolean };

inline constexpr st_dtype all_st_dtypes[] = {st_dtype::f64,     st_dtype::f32, st_dtype::f16, st_dtype::bf16, st_dtype::f8_e4m3,
                                             st_dtype::f8_e5m2, st_dtype::i64, st_dtype::i32, st_dtype::i16,  st_dtype::i8,
                                             st_dtype::u64,     st_dtype::u32, st_dtype::u16, st_dtype::u8,   st_dtype::boolean};

constexpr std::string_view st_dtype_name(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::f64: return "F64";
    case st_dtype::f32: return "F32";
    case st_dtype::f16: return "F16";
    case st_dtype::bf16: return "BF16";
    case st_dtype::f8_e4m3: return "F8_E4M3";
    case st_dtype::f8_e5m2: return "F8_E5M2";
    case st_dtype::i64: return "I64";
    case st_dtype::i32: return "I32";
    case st_dtype::i16: return "I16";
    case st_dtype::i8: return "I8";
    case st_dtype::u64: return "U64";
    case st_dtype::u32: return "U32";
    case st_dtype::u16: return "U16";
    case st_dtype::u8: return "U8";
    case st_dtype::boolean: return "BOOL";
  }
  return "?";
}

constexpr std::optional<st_dtype> st_dtype_from_name(std::string_view name) noexcept {
  for (st_dtype d : all_st_dtypes)
    if (st_dtype_name(d) == name) return d;
  return std::nullopt;
}

constexpr std::size_t st_dtype_size(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::f64:
    case st_dtype::i64:
    case st_dtype::u64: return 8;
    case st_dtype::f32:
    case st_dtype::i32:
    case st_dtype::u32: return 4;
    case st_dtype::f16:
    case st_dtype::bf16:
    case st_dtype::i16:
    case st_dtype::u16: return 2;
    default: return 1;
  }
}

// tessel's runtime dtype of a file's element type; BOOL has none.
constexpr std::optional<dtype> to_dtype(st_dtype d) noexcept {
  switch (d) {
    case st_dtype::f64: return dtype::f64;
    case st_dtype::f32: return dtype::f32;
    case st_dtype::f16: return dtype::fp16;
    case st_dtype::bf16: return dtype::bf16;
    case st_dtype::f8_e4m3: return dtype::e4m3;
    case st_dtype::f8_e5m2: return dtype::e5m2;
    case st_dtype::i64: return dtype::i64;
    case st_dtype::i32: return dtype::i32;
    case st_dtype::i16: return dtype::i16;
    case st_dtype::i8: return dtype::i8;
    case st_dtype::u64: return dtype::u64;
    case st_dtype::u32: return dtype::u32;
    case st_dtype::u16: return dtype::u16;
    case st_dtype::u8: return dtype::u8;
    case st_dtype::boolean: return std::nullopt;
  }
  return std::nullopt;
}

// The file's element type for a tessel dtype; packed int4 has no safetensors spelling.
inline st_dtype to_st_dtype(dtype d) {
  for (st_dtype s : all_st_dtypes)
    if (to_dtype(s) == d) return s;
  throw io_error(errc::unsupported, "safetensors", "dtype " + std::string(dtype_name(d)) + " has no safetensors name");
}

// C++ element types with a safetensors spelling: tessel's dtype elements (but packed int4) and bool.
template <class T>
concept st_element = std::is_same_v<T, bool> ||(dtype_element<T> && !std::is_same_v<T, int4x2>);

template <st_element T>
inline constexpr st_dtype st_dtype_of = [] {
  if constexpr (std::is_same_v<T, bool>) {
    return st_dtype::boolean;
  } else {
    for (st_dtype s : all_st_dtypes)
      if (to_dtype(s) == dtype_of<T>) return s;
    return st_dtype::u8;  // unreachable: every st_element but bool has a dtype above
  }
}();

// The reference implementation's header limit; larger headers are refused before parsing.
inline constexpr std::size_t max_header_bytes = 100'000'000;

namespace detail {
struct tensor_entry {
  std::string name;
  st_dtype dtype{};
  std::vector<std::size_t> shape;
  std::size_t numel = 1;
  std::size_t begin = 0, end = 0;  // offsets into the data region
};

// What every view of one file shares: the bytes (and whoever owns them), the validated header.
struct file_state {
  std::shared_ptr<const void> owner;  // a mapped_file, a byte vector, or nothing (borrowed)
  std::span<const std::byte> bytes;   // the whole file
  std::string file;                   // path or label, for messages
  std::size_t header_size = 0;
  std::map<std::string, tensor_entry, std::less<>> tensors;
  std::map<std::string, std::string, std::less<>> metadata;
  std::span<const std::byte> data() const { return bytes.subspan(8 + header_size); }
};

inline std::string shape_string(std::span<const std::size_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline std::size_t json_size(const nlohmann::json& v, std::string_view file, const std::string& ctx, std::string_view what) {
  if (!v.is_number_unsigned()) throw io_error(errc::format, file, ctx + std::string(what) + " is not a non-negative integer: " + v.dump());
  const auto u = v.get<std::uint64_t>();
  if (u > SIZE_MAX) throw io_error(errc::overflow, file, ctx + std::string(what) + " does not fit in size_t");
  return static_cast<std::size_t>(u);
}

inline tensor_entry parse_entry(const std::string& name, const nlohmann::json& v, std::string_view file) {
  const std::string ctx = tensor_context(name);
  if (!v.is_object()) throw io_error(errc::format, file, ctx + "entry is not an object");
  for (const auto& [key, _] : v.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets") throw io_error(errc::format, file, ctx + "unknown key '" + key + "'");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) throw io_error(errc::format, file, ctx + "missing '" + key + "'");
  tensor_entry e;
  e.name = name;
  const auto& dt = v["dtype"];
  if (!dt.is_string()) throw io_error(errc::format, file, ctx + "dtype is not a string");
  const auto parsed = st_dtype_from_name(dt.get_ref<const std::string&>());
  if (!parsed) throw io_error(errc::format, file, ctx + "unknown dtype '" + dt.get<std::string>() + "'");
  e.dtype = *parsed;
  const auto& shape = v["shape"];
  if (!shape.is_array()) throw io_error(errc::format, file, ctx + "shape is not an array");
  for (const auto& d : shape) {
    e.shape.push_back(json_size(d, file, ctx, "shape dimension"));
    e.numel = mul_checked(e.numel, e.shape.back(), file, ctx + "element count: ");
  }
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2) throw io_error(errc::format, file, ctx + "data_offsets is not an array of two offsets");
  e.begin = json_size(off[0], file, ctx, "data_offsets[0]");
  e.end = json_size(off[1], file, ctx, "data_offsets[1]");
  if (e.begin > e.end)
    throw io_error(errc::format, file, ctx + "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") end before they begin");
  const std::size_t need = mul_checked(e.numel, st_dtype_size(e.dtype), file, ctx + "byte size: ");
  if (e.end - e.begin != need)
    throw io_error(errc::format, file,
                   ctx + "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") hold " + std::to_string(e.end - e.begin) +
                       " bytes but shape " + shape_string(e.shape) + " of " + std::string(st_dtype_name(e.dtype)) + " needs " + std::to_string(need));
  return e;
}

// Every rule of the format, in the order the reference implementation checks them.
inline std::shared_ptr<file_state> validate(std::shared_ptr<const void> owner, std::span<const std::byte> bytes, std::string file) {
  auto st = std::make_shared<file_state>();
  st->owner = std::move(owner);
  st->bytes = bytes;
  st->file = std::move(file);
  const std::string_view f = st->file;
  if (bytes.size() < 8)
    throw io_error(errc::format, f, "file of " + std::to_string(bytes.size()) + " bytes is shorter than the 8-byte header length");
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > max_header_bytes)
    throw io_error(errc::format, f, "header length " + std::to_string(n) + " exceeds the " + std::to_string(max_header_bytes) + "-byte limit");
  if (n > bytes.size() - 8)
    throw io_error(errc::format, f,
                   "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(bytes.size()) + " bytes)");
  st->header_size = static_cast<std::size_t>(n);
  const std::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8, st->header_size);
  if (header.empty() || header.front() != '{') throw io_error(errc::format, f, "header does not start with '{'");
  // Depth 3 holds name -> entry -> shape; anything deeper is not a safetensors header.
  const nlohmann::json j = parse_json(header, f, 3);
  if (!j.is_object()) throw io_error(errc::format, f, "header is not a JSON object");

  std::vector<const tensor_entry*> by_offset;
  for (const auto& [key, value] : j.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) throw io_error(errc::format, f, "__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) throw io_error(errc::format, f, "__metadata__: value of '" + mk + "' is not a string");
        st->metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    auto [it, _] = st->tensors.emplace(key, parse_entry(key, value, f));
    by_offset.push_back(&it->second);
  }
  // Contiguous from 0, without gaps or overlaps, ending exactly at the end of the file.
  std::sort(by_offset.begin(), by_offset.end(),
            [](const tensor_entry* a, const tensor_entry* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  std::size_t at = 0;
  for (const tensor_entry* e : by_offset) {
    if (e->begin < at)
      throw io_error(errc::format, f,
                     tensor_context(e->name) + "data_offsets begin at " + std::to_string(e->begin) + ", inside the previous tensor (which ends at " +
                         std::to_string(at) + ")");
    if (e->begin > at)
      throw io_error(
          errc::format, f,
          tensor_context(e->name) + "data_offsets begin at " + std::to_string(e->begin) + ", leaving a gap after offset " + std::to_string(at));
    at = e->end;
  }
  const std::size_t data_size = bytes.size() - 8 - st->header_size;
  if (at > data_size)
    throw io_error(errc::format, f,
                   tensor_context(by_offset.back()->name) + "data ends at " + std::to_string(at) + ", past the " + std::to_string(data_size) +
                       " data bytes in the file (truncated?)");
  if (at < data_size)
    throw io_error(errc::format, f,
                   std::to_string(data_size - at) + " bytes follow the last tensor's data (file length " + std::to_string(bytes.size()) + ")");
  return st;
}
}  // namespace detail

// A tensor's elements as T: a view into the file when the bytes are aligned for T (zero_copy()),
// an owned copy otherwise. Keeps the file mapped while it lives.
template <st_element T>
class tensor_data {
 public:
  std::span<const T> span() const noexcept { return copy_ ? std::span<const T>(copy_.get(), size_) : view_; }
  std::size_t size() const noexcept { return size_; }
  bool zero_copy() const noexcept { return !copy_; }

 private:
  friend class tensor_view;
  std::shared_ptr<const void> keep_;
  std::span<const T> view_;
  std::unique_ptr<T[]> copy_;  // not a vector: vector<bool> has no contiguous elements
  std::size_t size_ = 0;
};

// One tensor of a validated file: name, element type, shape and its bytes in place.
class tensor_view {
 public:
  const std::string& name() const noexcept { return entry_->name; }
  st_dtype dtype() const noexcept { return entry_->dtype; }
  std::span<const std::size_t> shape() const noexcept { return entry_->shape; }
  std::size_t numel() const noexcept { return entry_->numel; }
  std::span<const std::byte> bytes() const noexcept { return state_->data().subspan(entry_->begin, entry_->end - entry_->begin); }
  const std::string& file() const noexcept { return state_->file; }

  // True when span<T>() can view the bytes in place.
  template <st_element T>
  bool aligned() const noexcept {
    return reinterpret_cast<std::uintptr_t>(bytes().data()) % alignof(T) == 0;
  }

  // The elements in place; throws errc::invalid_argument when T is not the file's element type or
  // the bytes are misaligned for T (data<T>() copies instead), errc::format for a BOOL byte other
  // than 0 or 1 (reading one as bool would be undefined).
  template <st_element T>
  std::span<const T> span() const {
    check_type<T>();
    if (!aligned<T>())
      throw io_error(errc::invalid_argument, file(),
                     detail::tensor_context(name()) + "bytes are not aligned to " + std::to_string(alignof(T)) + " (use data<T>(), which copies)");
    check_bools<T>();
    return {reinterpret_cast<const T*>(bytes().data()), numel()};
  }

  // The elements, in place when aligned, copied otherwise.
  template <st_element T>
  tensor_data<T> data() const {
    check_type<T>();
    check_bools<T>();
    tensor_data<T> d;
    d.size_ = numel();
    if (aligned<T>()) {
      d.keep_ = state_;
      d.view_ = {reinterpret_cast<const T*>(bytes().data()), numel()};
    } else {
      d.copy_ = std::make_unique<T[]>(numel());
      if (numel() > 0) std::memcpy(static_cast<void*>(d.copy_.get()), bytes().data(), bytes().size());
    }
    return d;
  }

 private:
  friend class safetensors_reader;
  tensor_view(std::shared_ptr<const detail::file_state> s, const detail::tensor_entry* e) : state_(std::move(s)), entry_(e) {}

  template <class T>
  void check_type() const {
    if (st_dtype_of<T> != dtype())
      throw io_error(
          errc::invalid_argument, file(),
          detail::tensor_context(name()) + "holds " + std::string(st_dtype_name(dtype())) + ", not " + std::string(st_dtype_name(st_dtype_of<T>)));
  }
  template <class T>
  void check_bools() const {
    if constexpr (std::is_same_v<T, bool>) {
      const auto b = bytes();
      const auto bad = std::find_if(b.begin(), b.end(), [](std::byte x) { return x > std::byte{1}; });
      if (bad != b.end())
        throw io_error(errc::format, file(),
                       detail::tensor_context(name()) + "BOOL element " + std::to_string(bad - b.begin()) + " is byte " +
                           std::to_string(static_cast<int>(*bad)) + ", not 0 or 1");
    }
  }

  std::shared_ptr<const detail::file_state> state_;
  const detail::tensor_entry* entry_;
};

// A validated safetensors file. Construction checks every rule of the format; lookups never fail
// on a file that opened. Copies share the mapping.
class safetensors_reader {
 public:
  // Maps the file read-only. The file must not be truncated while mapped (the OS would signal).
  static safetensors_reader open(const std::filesystem::path& path) {
    auto mapped = std::make_shared<const detail::mapped_file>(path);
    const auto bytes = mapped->bytes();
    return safetensors_reader(detail::validate(std::move(mapped), bytes, path.string()));
  }
  // Takes ownership of a file's bytes (a vector's buffer is aligned for every element type).
  static safetensors_reader from_bytes(std::vector<std::byte> bytes, std::string label = "<memory>") {
    auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
    const std::span<const std::byte> view(*owned);
    return safetensors_reader(detail::validate(std::move(owned), view, std::move(label)));
  }
  // Views bytes the caller keeps alive as long as this reader and its views.
  static safetensors_reader from_memory(std::span<const std::byte> bytes, std::string label = "<memory>") {
    return safetensors_reader(detail::validate(nullptr, bytes, std::move(label)));
  }

  const std::string& file() const noexcept { return state_->file; }
  std::size_t size() const noexcept { return state_->tensors.size(); }
  bool contains(std::string_view name) const { return state_->tensors.find(name) != state_->tensors.end(); }

  // Throws errc::out_of_range for a name the file does not hold.
  tensor_view tensor(std::string_view name) const {
    const auto it = state_->tensors.find(name);
    if (it == state_->tensors.end()) throw io_error(errc::out_of_range, file(), detail::tensor_context(name) + "not in this file");
    return tensor_view(state_, &it->second);
  }

  // Names in lexicographic order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, _] : state_->tensors) out.push_back(n);
    return out;
  }
  // Every tensor, in the order of their bytes in the file.
  std::vector<tensor_view> tensors() const {
    std::vector<tensor_view> out;
    for (const auto& [_, e] : state_->tensors) out.push_back(tensor_view(state_, &e));
    std::sort(out.begin(), out.end(), [](const tensor_view& a, const tensor_view& b) {
      return a.bytes().data() != b.bytes().data() ? a.bytes().data() < b.bytes().data() : a.name() < b.name();
    });
    return out;
  }
  const std::map<std::string, std::string, std::less<>>& metadata() const noexcept { return state_->metadata; }
  std::size_t header_size() const noexcept { return state_->header_size; }

 private:
  explicit safetensors_reader(std::shared_ptr<const detail::file_state> s) : state_(std::move(s)) {}
  std::shared_ptr<const detail::file_state> state_;
};

// Collects tensors and writes one safetensors file. Tensors are borrowed: their bytes must stay
// alive until the write. The file's order is by element size, largest first, then by name: it is
// deterministic whatever the insertion order, and with the 8-byte-padded header it leaves every
// tensor aligned for its element type, so readers get zero-copy views.
class safetensors_writer {
 public:
  struct entry {
    std::string name;
    st_dtype dtype;
    std::vector<std::size_t> shape;
    std::span<const std::byte> bytes;
  };

  // Throws errc::invalid_argument for a reserved or repeated name or a byte count that does not
  // match the shape, errc::overflow when the shape's size wraps.
  void add(std::string name, st_dtype dt, std::vector<std::size_t> shape, std::span<const std::byte> bytes) {
    const std::string ctx = detail::tensor_context(name);
    if (name == "__metadata__") throw io_error(errc::invalid_argument, label, ctx + "the name is reserved");
    if (names_.count(name) != 0) throw io_error(errc::invalid_argument, label, ctx + "added twice");
    std::size_t n = 1;
    for (std::size_t d : shape) n = detail::mul_checked(n, d, label, ctx + "element count: ");
    const std::size_t need = detail::mul_checked(n, st_dtype_size(dt), label, ctx + "byte size: ");
    if (bytes.size() != need)
      throw io_error(errc::invalid_argument, label,
                     ctx + std::to_string(bytes.size()) + " bytes given but shape " + detail::shape_string(shape) + " of " +
                         std::string(st_dtype_name(dt)) + " needs " + std::to_string(need));
    data_bytes_ = detail::add_checked(data_bytes_, need, label, ctx + "file size: ");
    names_.insert(name);  // a set, not a scan: checkpoints of MoE models hold ~10^5 tensors
    entries_.push_back({std::move(name), dt, std::move(shape), bytes});
  }
  template <st_element T>
  void add(std::string name, std::vector<std::size_t> shape, std::span<const T> values) {
    add(std::move(name), st_dtype_of<T>, std::move(shape), std::as_bytes(values));
  }
  // Re-emits a tensor of another file (its bytes stay in that file's mapping).
  void add(const tensor_view& t) { add(t.name(), t.dtype(), std::vector<std::size_t>(t.shape().begin(), t.shape().end()), t.bytes()); }
  void add_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

  const std::vector<entry>& entries() const noexcept { return entries_; }  // insertion order
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  std::size_t data_bytes() const noexcept { return data_bytes_; }

  // The JSON header padded with spaces to a multiple of 8 bytes.
  std::string header() const {
    nlohmann::json j = nlohmann::json::object();
    if (!metadata_.empty()) j["__metadata__"] = metadata_;
    std::size_t at = 0;
    for (const entry* e : file_order()) {
      j[e->name] = {{"dtype", st_dtype_name(e->dtype)}, {"shape", e->shape}, {"data_offsets", {at, at + e->bytes.size()}}};
      at += e->bytes.size();
    }
    std::string h;
    try {
      h = j.dump();
    } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not UTF-8
      throw io_error(errc::invalid_argument, label, std::string("cannot write the header: ") + e.what());
    }
    h.resize((h.size() + 7) / 8 * 8, ' ');
    return h;
  }

  std::vector<std::byte> to_bytes() const {
    std::vector<std::byte> out;
    emit([&](std::span<const std::byte> b) { out.insert(out.end(), b.begin(), b.end()); });
    return out;
  }
  // Writes atomically: to "<path>.tmp", then renamed over path.
  void write(const std::filesystem::path& path) const {
    write(path, [](std::span<const std::byte>) {});
  }
  // The same, passing every byte written, in file order, to observe (a running hash, a byte count).
  template <class Observe>
  void write(const std::filesystem::path& path, Observe&& observe) const {
    detail::atomic_file f(path);
    emit([&](std::span<const std::byte> b) {
      observe(b);
      f.write(b);
    });
    f.commit();
  }

  std::string label = "safetensors writer";  // names this writer in its errors

 private:
  std::vector<const entry*> file_order() const {
    std::vector<const entry*> order;
    for (const entry& e : entries_) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const entry* a, const entry* b) {
      const std::size_t sa = st_dtype_size(a->dtype), sb = st_dtype_size(b->dtype);
      return sa != sb ? sa > sb : a->name < b->name;
    });
    return order;
  }
  template <class Sink>
  void emit(Sink&& sink) const {
    const std::string h = header();
    if (h.size() > max_header_bytes)
      throw io_error(errc::invalid_argument, label, "header of " + std::to_string(h.size()) + " bytes exceeds the format's limit");
    const std::uint64_t n = h.size();
    std::byte len[8];
    std::memcpy(len, &n, 8);
    sink(std::span<const std::byte>(len));
    sink(detail::as_bytes(h));
    for (const entry* e : file_order()) sink(e->bytes);
  }

  std::vector<entry> entries_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  std::size_t data_bytes_ = 0;
};

// ---- sharded checkpoints ----------------------------------------------------------------------

inline constexpr std::string_view index_file_name = "model.safetensors.index.json";

// A checkpoint of one or more safetensors files: a directory (with model.safetensors.index.json,
// or a single model.safetensors), an index file, or one .safetensors file. The index is checked
// against its shards: every listed tensor is in the shard it names, and every tensor of a shard
// is listed under that shard.
class safetensors_checkpoint {
 public:
  static safetensors_checkpoint open(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      if (fs::exists(path / index_file_name, ec)) return open_index(path / index_file_name);
      return single(path / "model.safetensors");
    }
    if (path.extension() == ".json") return open_index(path);
    return single(path);
  }

  std::size_t size() const noexcept { return where_.size(); }
  bool contains(std::string_view name) const { return where_.find(name) != where_.end(); }
  tensor_view tensor(std::string_view name) const {
    const auto it = where_.find(name);
    if (it == where_.end()) throw io_error(errc::out_of_range, file_, detail::tensor_context(name) + "not in this checkpoint");
    return shards_[it->second].tensor(name);
  }
  // The shard file that holds `name`.
  const std::string& shard_of(std::string_view name) const { return tensor(name).file(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, _] : where_) out.push_back(n);
    return out;
  }
  const std::vector<safetensors_reader>& shards() const noexcept { return shards_; }
  const std::string& file() const noexcept { return file_; }

 private:
  static safetensors_checkpoint single(const std::filesystem::path& p) {
    safetensors_checkpoint c;
    c.file_ = p.string();
    c.shards_.push_back(safetensors_reader::open(p));
    for (const auto& n : c.shards_[0].names()) c.where_.emplace(n, 0);
    return c;
  }

  static safetensors_checkpoint open_index(const std::filesystem::path& index) {
    safetensors_checkpoint c;
    c.file_ = index.string();
    const std::string_view f = c.file_;
    const nlohmann::json j = detail::parse_json(detail::read_file(index, max_header_bytes), f, 8);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) throw io_error(errc::format, f, "no weight_map object");
    std::map<std::string, std::size_t> shard_index;  // file name -> position in shards_
    for (const auto& [name, v] : j["weight_map"].items()) {
      if (!v.is_string()) throw io_error(errc::format, f, detail::tensor_context(name) + "shard is not a string");
      const auto& shard = v.get_ref<const std::string&>();
      // Plain file names only: an index must not reach outside its directory.
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos || shard.find('\0') != std::string::npos)
        throw io_error(errc::format, f, detail::tensor_context(name) + "shard '" + shard + "' is not a file name");
      auto [it, added] = shard_index.emplace(shard, shard_index.size());
      if (added) c.shards_.push_back(safetensors_reader::open(index.parent_path() / shard));
      const safetensors_reader& r = c.shards_[it->second];
      if (!r.contains(name)) throw io_error(errc::format, f, detail::tensor_context(name) + "listed in shard " + shard + ", which does not hold it");
      c.where_.emplace(name, it->second);
    }
    for (const auto& [shard, i] : shard_index)
      for (const auto& n : c.shards_[i].names()) {
        const auto w = c.where_.find(n);
        if (w == c.where_.end() || w->second != i)
          throw io_error(errc::format, f, detail::tensor_context(n) + "held by shard " + shard + " but not listed under it");
      }
    return c;
  }

  std::string file_;
  std::vector<safetensors_reader> shards_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor name -> shard
};

// Writes `tensors` as Hugging Face does: one "<stem>.safetensors" when it fits in max_shard_bytes
// of tensor data, otherwise "<stem>-00001-of-0000N.safetensors"... filled in insertion order (a
// tensor larger than the limit gets a shard of its own) plus "<stem>.safetensors.index.json".
// Every shard carries the writer's metadata. Returns the files written, index last.
inline std::vector<std::filesystem::path> write_sharded(const safetensors_writer& tensors, const std::filesystem::path& dir,
                                                        std::size_t max_shard_bytes, std::string_view stem = "model") {
  std::vector<std::vector<const safetensors_writer::entry*>> groups(1);
  std::size_t in_group = 0;
  for (const auto& e : tensors.entries()) {
    if (!groups.back().empty() && e.bytes.size() > max_shard_bytes - std::min(in_group, max_shard_bytes)) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(&e);
    in_group += e.bytes.size();
  }
  std::vector<std::filesystem::path> written;
  const auto shard_writer = [&](const std::vector<const safetensors_writer::entry*>& g) {
    safetensors_writer w;
    for (const auto& [k, v] : tensors.metadata()) w.add_metadata(k, v);
    for (const auto* e : g) w.add(e->name, e->dtype, e->shape, e->bytes);
    return w;
  };
  if (groups.size() == 1) {
    written.push_back(dir / (std::string(stem) + ".safetensors"));
    shard_writer(groups[0]).write(written.back());
    return written;
  }
  const auto num = [](std::size_t i) {
    std::string s = std::to_string(i);
    return std::string(s.size() < 5 ? 5 - s.size() : 0, '0') + s;
  };
  nlohmann::json index = {{"metadata", {{"total_size", tensors.data_bytes()}}}, {"weight_map", nlohmann::json::object()}};
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const std::string name = std::string(stem) + "-" + num(i + 1) + "-of-" + num(groups.size()) + ".safetensors";
    for (const auto* e : groups[i]) index["weight_map"][e->name] = name;
    written.push_back(dir / name);
    shard_writer(groups[i]).write(written.back());
  }
  written.push_back(dir / (std::string(stem) + ".safetensors.index.json"));
  const std::string text = index.dump(2) + "\n";
  detail::atomic_file f(written.back());
  f.write(detail::as_bytes(text));
  f.commit();
  return written;
}

}  // namespace io
}  // namespace v0
}  // namespace tessel
