// tessel::io safetensors: every rule of the format gives a typed error naming the tensor, every
// dtype round-trips bit-exact, zero-copy vs copied views, sharded checkpoints through the index.
#include "io_test_util.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>

#include <tessel/io/safetensors.hpp>

namespace tessel_test_io_safetensors {

using io_test::require_io_error;
using io_test::temp_dir;
using tessel::errc;
namespace io = tessel::io;
using io::st_dtype;

namespace {

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}

// A file from a raw header (no padding added) and `data` bytes of zeros after it.
std::vector<std::byte> craft(std::string_view header, std::size_t data = 0, std::uint64_t declared = UINT64_MAX) {
  const std::uint64_t n = declared == UINT64_MAX ? header.size() : declared;
  std::vector<std::byte> out(8);
  std::memcpy(out.data(), &n, 8);
  const auto h = bytes_of(header);
  out.insert(out.end(), h.begin(), h.end());
  out.resize(out.size() + data, std::byte{0});
  return out;
}

std::vector<std::byte> random_bytes(std::mt19937_64& rng, st_dtype dt, std::size_t n) {
  std::vector<std::byte> v(n * io::st_dtype_size(dt));
  for (auto& b : v) b = std::byte(rng() & (dt == st_dtype::boolean ? 1 : 0xFF));
  return v;
}

void write_file(const std::filesystem::path& p, const std::vector<std::byte>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("safetensors dtype names, sizes and tessel dtypes", "[io][safetensors]") {
  for (st_dtype d : io::all_st_dtypes) {
    INFO(io::st_dtype_name(d));
    CHECK(io::st_dtype_from_name(io::st_dtype_name(d)) == d);
    if (auto t = io::to_dtype(d)) {
      CHECK(io::to_st_dtype(*t) == d);
      CHECK(tessel::dtype_size(*t) == io::st_dtype_size(d));
    } else {
      CHECK(d == st_dtype::boolean);
    }
  }
  static_assert(io::st_dtype_of<tessel::bf16> == st_dtype::bf16);
  static_assert(io::st_dtype_of<tessel::e4m3> == st_dtype::f8_e4m3);
  static_assert(io::st_dtype_of<bool> == st_dtype::boolean);
  CHECK(std::string(io::st_dtype_name(st_dtype::f8_e5m2)) == "F8_E5M2");
  CHECK_FALSE(io::st_dtype_from_name("bf16"));  // the format's names are upper case
  require_io_error([] { (void)io::to_st_dtype(tessel::dtype::i4x2); }, errc::unsupported, "i4x2");
}

TEST_CASE("safetensors every dtype round-trips bit-exact", "[io][safetensors]") {
  std::mt19937_64 rng(17);
  const std::vector<std::vector<std::size_t>> shapes = {{}, {0}, {1}, {7}, {3, 5}, {2, 0, 4}, {2, 3, 4}};
  std::vector<std::vector<std::byte>> keep;
  io::safetensors_writer w;
  for (st_dtype d : io::all_st_dtypes)
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      std::size_t n = 1;
      for (auto x : shapes[s]) n *= x;
      keep.push_back(random_bytes(rng, d, n));
      w.add(std::string(io::st_dtype_name(d)) + "." + std::to_string(s), d, shapes[s], keep.back());
    }
  w.add_metadata("format", "pt");
  w.add_metadata("note", "ünïcode ✓");
  const auto file = w.to_bytes();

  const auto r = io::safetensors_reader::from_memory(file, "roundtrip");
  REQUIRE(r.size() == keep.size());
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.metadata().at("note") == "ünïcode ✓");
  for (const auto& e : w.entries()) {
    INFO(e.name);
    const auto t = r.tensor(e.name);
    CHECK(t.dtype() == e.dtype);
    CHECK(std::equal(t.shape().begin(), t.shape().end(), e.shape.begin(), e.shape.end()));
    CHECK(std::equal(t.bytes().begin(), t.bytes().end(), e.bytes.begin(), e.bytes.end()));
  }
  // Reading back and writing again gives the same bytes, from memory and from a mapped file.
  io::safetensors_writer again;
  for (const auto& t : r.tensors()) again.add(t);
  for (const auto& [k, v] : r.metadata()) again.add_metadata(k, v);
  CHECK((again.to_bytes() == file));

  temp_dir dir;
  w.write(dir / "a.safetensors");
  CHECK_FALSE(std::filesystem::exists(dir / "a.safetensors.tmp"));
  const auto mapped = io::safetensors_reader::open(dir / "a.safetensors");
  io::safetensors_writer third;
  for (const auto& t : mapped.tensors()) third.add(t);
  for (const auto& [k, v] : mapped.metadata()) third.add_metadata(k, v);
  CHECK((third.to_bytes() == file));
  CHECK(std::filesystem::file_size(dir / "a.safetensors") == file.size());
}

TEST_CASE("safetensors header is padded to 8 bytes and the order is deterministic", "[io][safetensors]") {
  std::mt19937_64 rng(5);
  std::vector<std::vector<std::byte>> data;
  std::vector<std::pair<std::string, st_dtype>> items = {{"u8", st_dtype::u8},       {"f64", st_dtype::f64},   {"bf16", st_dtype::bf16},
                                                         {"f32", st_dtype::f32},     {"b", st_dtype::boolean}, {"i16", st_dtype::i16},
                                                         {"e4m3", st_dtype::f8_e4m3}};
  for (const auto& [n, d] : items) data.push_back(random_bytes(rng, d, 3));
  std::vector<std::size_t> order(items.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<std::byte> first;
  for (int trial = 0; trial < 6; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    io::safetensors_writer w;
    for (auto i : order) w.add(items[i].first, items[i].second, {3}, data[i]);
    const std::string h = w.header();
    CHECK(h.size() % 8 == 0);
    CHECK(h.find_last_not_of(' ') + 1 > h.size() - 8);  // at most 7 spaces of padding
    const auto bytes = w.to_bytes();
    if (trial == 0) first = bytes;
    CHECK((bytes == first));
  }
  // Largest elements first: every tensor is aligned for its type, so every typed view is in place.
  std::vector<std::byte> owned = first;
  const auto r = io::safetensors_reader::from_bytes(std::move(owned));
  CHECK(r.header_size() % 8 == 0);
  CHECK(r.tensor("f64").data<double>().zero_copy());
  CHECK(r.tensor("f32").data<float>().zero_copy());
  CHECK(r.tensor("bf16").data<tessel::bf16>().zero_copy());
  CHECK(r.tensor("i16").data<std::int16_t>().zero_copy());
  const auto order_in_file = r.tensors();
  for (std::size_t i = 1; i < order_in_file.size(); ++i)
    CHECK(io::st_dtype_size(order_in_file[i - 1].dtype()) >= io::st_dtype_size(order_in_file[i].dtype()));
}

TEST_CASE("safetensors typed views: in place, type checked, BOOL validated", "[io][safetensors]") {
  const std::vector<tessel::bf16> w = {tessel::bf16(1.0f), tessel::bf16(-2.5f), tessel::bf16(0.125f)};
  const std::vector<std::int64_t> ids = {-1, 0, 1LL << 40};
  const bool flags[] = {true, false, true};
  io::safetensors_writer wr;
  wr.add<tessel::bf16>("w", {3}, w);
  wr.add<std::int64_t>("ids", {1, 3}, ids);
  wr.add<bool>("mask", {3}, flags);
  const auto file = wr.to_bytes();
  const auto r = io::safetensors_reader::from_memory(file);

  const auto span = r.tensor("w").span<tessel::bf16>();
  REQUIRE(span.size() == 3);
  CHECK(span.data() == reinterpret_cast<const tessel::bf16*>(r.tensor("w").bytes().data()));  // no copy
  for (int i = 0; i < 3; ++i) CHECK(span[i].bits() == w[i].bits());
  const auto id = r.tensor("ids").data<std::int64_t>();
  CHECK(id.zero_copy());
  CHECK(std::equal(id.span().begin(), id.span().end(), ids.begin(), ids.end()));
  const auto m = r.tensor("mask").span<bool>();
  CHECK((m[0] && !m[1] && m[2]));

  require_io_error([&] { (void)r.tensor("w").span<float>(); }, errc::invalid_argument, "tessel::io: <memory>: tensor 'w': holds BF16, not F32");
  require_io_error([&] { (void)r.tensor("ids").data<std::uint64_t>(); }, errc::invalid_argument, "holds I64, not U64");
  require_io_error([&] { (void)r.tensor("nope"); }, errc::out_of_range, "tessel::io: <memory>: tensor 'nope': not in this file");
  CHECK_FALSE(r.contains("nope"));
  CHECK(r.contains("mask"));

  // A BOOL byte other than 0/1 would be undefined as bool: refused by both paths.
  auto bad = file;
  const auto mask_at = static_cast<std::size_t>(r.tensor("mask").bytes().data() - file.data());
  bad[mask_at + 1] = std::byte{2};
  const auto rb = io::safetensors_reader::from_memory(bad);
  require_io_error([&] { (void)rb.tensor("mask").span<bool>(); }, errc::format, "tensor 'mask': BOOL element 1 is byte 2");
  require_io_error([&] { (void)rb.tensor("mask").data<bool>(); }, errc::format, "BOOL element 1");
}

TEST_CASE("safetensors misaligned tensors are copied, aligned ones viewed", "[io][safetensors]") {
  // A 1-byte U8 tensor first puts the F32 tensor at data offset 1: misaligned for float.
  const std::string h = R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  const std::string header = h + std::string((8 - h.size() % 8) % 8, ' ');
  auto file = craft(header, 9);
  const float vals[2] = {3.5f, -0.25f};
  std::memcpy(file.data() + 8 + header.size() + 1, vals, sizeof vals);
  const auto r = io::safetensors_reader::from_bytes(file, "mis.safetensors");
  const auto f = r.tensor("f");
  CHECK_FALSE(f.aligned<float>());
  const auto d = f.data<float>();
  CHECK_FALSE(d.zero_copy());
  REQUIRE(d.size() == 2);
  CHECK(d.span()[0] == 3.5f);
  CHECK(d.span()[1] == -0.25f);
  require_io_error([&] { (void)f.span<float>(); }, errc::invalid_argument, "tessel::io: mis.safetensors: tensor 'f': bytes are not aligned to 4");
  CHECK(r.tensor("b").data<std::uint8_t>().zero_copy());  // bytes are always aligned
  // The copy outlives the reader; a view keeps the file alive.
  tessel::io::tensor_data<std::uint8_t> kept;
  {
    const auto r2 = io::safetensors_reader::from_bytes(file);
    kept = r2.tensor("b").data<std::uint8_t>();
  }
  CHECK(kept.span()[0] == std::uint8_t{0});
}

TEST_CASE("safetensors bad files give typed errors naming the tensor", "[io][safetensors]") {
  const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct bad_case {
    const char* what;
    std::vector<std::byte> file;
    errc code;
    std::string text;
  };
  const auto one = [&](const std::string& entry, std::size_t data = 8) { return craft(R"({"w":)" + entry + "}", data); };
  std::string deep = "{\"w\":";
  for (int i = 0; i < 50; ++i) deep += "[";
  for (int i = 0; i < 50; ++i) deep += "]";
  deep += "}";
  const std::vector<bad_case> cases = {
      {"shorter than 8 bytes", bytes_of("abc"), errc::format, "file of 3 bytes is shorter than the 8-byte header length"},
      {"empty file", {}, errc::format, "file of 0 bytes"},
      {"header above the limit", craft("{}", 0, 100'000'001), errc::format, "header length 100000001 exceeds the 100000000-byte limit"},
      {"header length 2^64-1", craft("{}", 0, UINT64_MAX - 1), errc::format, "exceeds the 100000000-byte limit"},
      {"header past the end", craft("{}", 0, 40), errc::format, "header length 40 runs past the end of the file (10 bytes)"},
      {"empty header", craft(""), errc::format, "header does not start with '{'"},
      {"header is an array", craft("[1]"), errc::format, "header does not start with '{'"},
      {"leading space", craft(" {}"), errc::format, "header does not start with '{'"},
      {"truncated JSON", craft(R"({"w":)"), errc::format, "invalid JSON"},
      {"trailing garbage", craft("{} x"), errc::format, "invalid JSON"},
      {"NUL after the object", craft(std::string("{}\0 x", 5)), errc::format, "NUL byte at offset 2"},
      {"NUL inside a name", craft(std::string("{\"a\0\":1}", 8)), errc::format, "NUL byte at offset 3"},
      {"invalid UTF-8 in a name", craft("{\"\xff\xfe\":1}"), errc::format, "invalid JSON"},
      {"overlong UTF-8", craft("{\"\xc0\xaf\":1}"), errc::format, "invalid JSON"},
      {"duplicate tensor name", craft(R"({"w":)" + ok_entry + R"(,"w":)" + ok_entry + "}", 8), errc::format, "duplicate key 'w'"},
      {"duplicate key in an entry", one(R"({"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]})"), errc::format, "duplicate key 'dtype'"},
      {"nested too deep", craft(deep), errc::format, "nested deeper than"},
      {"__metadata__ not an object", craft(R"({"__metadata__":[]})"), errc::format, "__metadata__ is not an object"},
      {"__metadata__ value not a string", craft(R"({"__metadata__":{"k":1}})"), errc::format, "__metadata__: value of 'k' is not a string"},
      {"entry not an object", one("[]"), errc::format, "tessel::io: <memory>: tensor 'w': entry is not an object"},
      {"unknown key", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})"), errc::format, "tensor 'w': unknown key 'x'"},
      {"missing dtype", one(R"({"shape":[2],"data_offsets":[0,8]})"), errc::format, "tensor 'w': missing 'dtype'"},
      {"missing shape", one(R"({"dtype":"F32","data_offsets":[0,8]})"), errc::format, "tensor 'w': missing 'shape'"},
      {"missing offsets", one(R"({"dtype":"F32","shape":[2]})"), errc::format, "tensor 'w': missing 'data_offsets'"},
      {"unknown dtype", one(R"({"dtype":"F128","shape":[2],"data_offsets":[0,8]})"), errc::format, "tensor 'w': unknown dtype 'F128'"},
      {"lower-case dtype", one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"), errc::format, "unknown dtype 'f32'"},
      {"dtype not a string", one(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), errc::format, "tensor 'w': dtype is not a string"},
      {"shape not an array", one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"), errc::format, "tensor 'w': shape is not an array"},
      {"negative dimension", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), errc::format,
       "tensor 'w': shape dimension is not a non-negative integer: -2"},
      {"fractional dimension", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), errc::format,
       "shape dimension is not a non-negative integer"},
      {"offsets not a pair", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,9]})"), errc::format,
       "tensor 'w': data_offsets is not an array of two offsets"},
      {"negative offset", one(R"({"dtype":"F32","shape":[2],"data_offsets":[-1,8]})"), errc::format, "data_offsets[0] is not a non-negative integer"},
      {"offsets reversed", one(R"({"dtype":"F32","shape":[0],"data_offsets":[8,0]})"), errc::format,
       "tensor 'w': data_offsets [8, 0) end before they begin"},
      {"size mismatch", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), errc::format,
       "tensor 'w': data_offsets [0, 8) hold 8 bytes but shape [3] of F32 needs 12"},
      {"element count overflows", one(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]})"), errc::overflow,
       "tensor 'w': element count: "},
      {"byte size overflows", one(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})"), errc::overflow,
       "tensor 'w': byte size: "},
      {"gap at the start", one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"), errc::format,
       "tensor 'w': data_offsets begin at 4, leaving a gap after offset 0"},
      {"gap between tensors",
       craft(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})", 5), errc::format,
       "tensor 'b': data_offsets begin at 3, leaving a gap after offset 2"},
      {"overlap", craft(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
       errc::format, "tensor 'b': data_offsets begin at 2, inside the previous tensor (which ends at 4)"},
      {"same bytes twice", craft(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4),
       errc::format, "inside the previous tensor"},
      {"truncated data", one(ok_entry, 7), errc::format, "tensor 'w': data ends at 8, past the 7 data bytes in the file"},
      {"bytes after the data", one(ok_entry, 9), errc::format, "1 bytes follow the last tensor's data"},
      {"data but no tensors", craft("{}", 3), errc::format, "3 bytes follow the last tensor's data"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    require_io_error([&] { (void)io::safetensors_reader::from_memory(c.file); }, c.code, c.text);
  }
  // The same rules hold for a file on disk.
  temp_dir dir;
  const auto size_mismatch = std::find_if(cases.begin(), cases.end(), [](const bad_case& c) { return c.what == std::string("size mismatch"); });
  write_file(dir / "bad.safetensors", size_mismatch->file);
  require_io_error([&] { (void)io::safetensors_reader::open(dir / "bad.safetensors"); }, errc::format,
                   "bad.safetensors: tensor 'w': data_offsets [0, 8) hold 8 bytes");
  // Valid edge cases: no tensors at all, only metadata, trailing space padding, zero-size tensors.
  CHECK(io::safetensors_reader::from_memory(craft("{}")).size() == 0);
  CHECK(io::safetensors_reader::from_memory(craft(R"({"__metadata__":{}})")).metadata().empty());
  CHECK(io::safetensors_reader::from_memory(craft("{}      ")).size() == 0);
  const auto z = io::safetensors_reader::from_memory(
      craft(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[1,0],"data_offsets":[0,0]}})"));
  CHECK(z.tensor("b").numel() == 0);
  CHECK(z.tensor("a").data<float>().span().empty());
}

TEST_CASE("safetensors corrupted files never crash", "[io][safetensors]") {
  std::mt19937_64 rng(2024);
  std::vector<float> a(37), b(5);
  for (auto& x : a) x = float(rng() % 100);
  io::safetensors_writer w;
  w.add<float>("model.layers.0.weight", {37}, a);
  w.add<float>("b", {5}, b);
  w.add_metadata("format", "pt");
  const auto good = w.to_bytes();
  int parsed = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    auto f = good;
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const auto op = rng() % 3;
      if (op == 0 && !f.empty()) {
        f[rng() % f.size()] = std::byte(rng());  // any byte
      } else if (op == 1 && f.size() > 8) {
        f[8 + rng() % std::min<std::size_t>(f.size() - 8, 200)] = std::byte("{}[],:\"0 9-"[rng() % 11]);  // JSON syntax
      } else {
        f.resize(rng() % (f.size() + 16));  // truncate or extend
      }
    }
    try {
      const auto r = io::safetensors_reader::from_memory(f);
      for (const auto& t : r.tensors()) (void)t.bytes();
      ++parsed;
    } catch (const io::io_error&) { ++refused; }
  }
  CHECK(parsed + refused == 3000);
  CHECK(refused > 2000);
}

TEST_CASE("safetensors open reports OS errors with the path", "[io][safetensors]") {
  temp_dir dir;
  const auto missing = (dir / "missing.safetensors").string();
  require_io_error([&] { (void)io::safetensors_reader::open(missing); }, errc::io,
                   "tessel::io: " + missing + ": cannot open: No such file or directory");
  require_io_error([&] { (void)io::safetensors_reader::open(dir.path()); }, errc::io, "not a regular file");
  write_file(dir / "empty.safetensors", {});
  require_io_error([&] { (void)io::safetensors_reader::open(dir / "empty.safetensors"); }, errc::format, "file of 0 bytes");
  io::safetensors_writer w;
  require_io_error([&] { w.write(dir / "no" / "such" / "dir.safetensors"); }, errc::io, "cannot create");
}

TEST_CASE("safetensors writer refuses bad tensors", "[io][safetensors]") {
  const std::vector<float> v(6);
  io::safetensors_writer w;
  w.add<float>("x", {2, 3}, v);
  require_io_error([&] { w.add<float>("x", {6}, v); }, errc::invalid_argument, "tensor 'x': added twice");
  require_io_error([&] { w.add<float>("__metadata__", {6}, v); }, errc::invalid_argument, "the name is reserved");
  require_io_error([&] { w.add<float>("y", {4}, v); }, errc::invalid_argument, "tensor 'y': 24 bytes given but shape [4] of F32 needs 16");
  require_io_error([&] { w.add<float>("z", {1ULL << 62, 8}, v); }, errc::overflow, "tensor 'z': element count: ");
  CHECK(w.entries().size() == 1);
  // Names must be UTF-8 to go into the JSON header.
  w.add<float>("bad\xff", {6}, v);
  require_io_error([&] { (void)w.to_bytes(); }, errc::invalid_argument, "safetensors writer: cannot write the header");
}

TEST_CASE("safetensors sharded checkpoints through the index", "[io][safetensors]") {
  std::mt19937_64 rng(99);
  std::vector<std::vector<float>> data;
  io::safetensors_writer w;
  const std::size_t sizes[] = {64, 16, 100, 8, 8, 40};  // floats
  for (std::size_t i = 0; i < 6; ++i) data.emplace_back(sizes[i]);
  for (std::size_t i = 0; i < 6; ++i) {
    for (auto& x : data[i]) x = float(rng() % 1000) / 8;
    w.add<float>("model.layers." + std::to_string(i) + ".weight", {sizes[i]}, data[i]);
  }
  w.add_metadata("format", "pt");
  temp_dir dir;
  const auto files = io::write_sharded(w, dir.path(), 256);  // 256 bytes: 64 floats per shard
  // Bytes in insertion order: 256 | 64 (400 does not fit) | 400 (alone, above the limit) | 32+32+160
  REQUIRE(files.size() == 5);
  CHECK(files[0].filename() == "model-00001-of-00004.safetensors");
  CHECK(files[3].filename() == "model-00004-of-00004.safetensors");
  CHECK(files.back().filename() == "model.safetensors.index.json");

  const auto ck = io::safetensors_checkpoint::open(dir.path());
  CHECK(ck.size() == 6);
  CHECK(ck.shards().size() == 4);
  for (std::size_t i = 0; i < 6; ++i) {
    const std::string n = "model.layers." + std::to_string(i) + ".weight";
    INFO(n);
    const auto t = ck.tensor(n).data<float>();
    CHECK(t.zero_copy());
    CHECK(std::equal(t.span().begin(), t.span().end(), data[i].begin(), data[i].end()));
  }
  CHECK_THAT(ck.shard_of("model.layers.2.weight"), Catch::EndsWith("model-00003-of-00004.safetensors"));
  CHECK_THAT(ck.shard_of("model.layers.4.weight"), Catch::EndsWith("model-00004-of-00004.safetensors"));
  CHECK(ck.shards()[0].metadata().at("format") == "pt");
  require_io_error([&] { (void)ck.tensor("lm_head.weight"); }, errc::out_of_range, "tensor 'lm_head.weight': not in this checkpoint");
  // The index file itself opens the same checkpoint, and records the total size.
  CHECK(io::safetensors_checkpoint::open(files.back()).names() == ck.names());
  {
    std::ifstream in(files.back());
    const auto j = nlohmann::json::parse(in);
    CHECK(j["metadata"]["total_size"] == (64 + 16 + 100 + 8 + 8 + 40) * 4);
  }

  // Everything fits: one model.safetensors, no index; the directory opens the same way.
  temp_dir one;
  CHECK(io::write_sharded(w, one.path(), 1 << 20).size() == 1);
  CHECK(std::filesystem::exists(one / "model.safetensors"));
  CHECK(io::safetensors_checkpoint::open(one.path()).size() == 6);
  temp_dir none;
  require_io_error([&] { (void)io::safetensors_checkpoint::open(none.path()); }, errc::io, "model.safetensors: cannot open");
}

TEST_CASE("safetensors sharded index inconsistencies are refused", "[io][safetensors]") {
  const std::vector<float> v(4, 1.0f);
  temp_dir dir;
  for (const char* n : {"a", "b"}) {
    io::safetensors_writer w;
    w.add<float>(std::string(n) + ".weight", {4}, v);
    w.write(dir / (std::string("s_") + n + ".safetensors"));
  }
  const auto with_index = [&](const std::string& text) {
    std::ofstream(dir / "model.safetensors.index.json") << text;
    return [&] { (void)io::safetensors_checkpoint::open(dir.path()); };
  };
  std::ofstream(dir / "ok.json") << R"({"weight_map":{"a.weight":"s_a.safetensors","b.weight":"s_b.safetensors"}})";
  CHECK(io::safetensors_checkpoint::open(dir / "ok.json").size() == 2);
  // An index may leave a shard of the directory out entirely.
  std::ofstream(dir / "only_a.json") << R"({"weight_map":{"a.weight":"s_a.safetensors"}})";
  CHECK(io::safetensors_checkpoint::open(dir / "only_a.json").names() == std::vector<std::string>{"a.weight"});
  require_io_error(with_index(R"({"metadata":{}})"), errc::format, "no weight_map object");
  require_io_error(with_index(R"({"weight_map":[]})"), errc::format, "no weight_map object");
  require_io_error(with_index(R"({"weight_map":{"a.weight":7}})"), errc::format, "tensor 'a.weight': shard is not a string");
  require_io_error(with_index(R"({"weight_map":{"a.weight":"s_b.safetensors","b.weight":"s_b.safetensors"}})"), errc::format,
                   "tensor 'a.weight': listed in shard s_b.safetensors, which does not hold it");
  require_io_error(with_index(R"({"weight_map":{"a.weight":"s_a.safetensors","a.weight":"s_a.safetensors"}})"), errc::format,
                   "duplicate key 'a.weight'");
  require_io_error(with_index(R"({"weight_map":{"a.weight":"../s_a.safetensors"}})"), errc::format, "shard '../s_a.safetensors' is not a file name");
  require_io_error(with_index(R"({"weight_map":{"a.weight":".."}})"), errc::format, "is not a file name");
  require_io_error(with_index(R"({"weight_map":{"x.weight":"s_x.safetensors"}})"), errc::io,
                   "s_x.safetensors: cannot open: No such file or directory");
  require_io_error(with_index("{\"weight_map\":"), errc::format, "invalid JSON");
  // A tensor held by a shard but not listed under it.
  io::safetensors_writer two;
  two.add<float>("c.weight", {4}, v);
  two.add<float>("d.weight", {4}, v);
  two.write(dir / "s_cd.safetensors");
  require_io_error(with_index(R"({"weight_map":{"c.weight":"s_cd.safetensors"}})"), errc::format,
                   "tensor 'd.weight': held by shard s_cd.safetensors but not listed under it");
}

TEST_CASE("safetensors sharding respects the size limit for any tensor sizes", "[io][safetensors]") {
  std::mt19937_64 rng(7);
  const auto tname = [](std::size_t i) {  // not "t" + to_string(i): GCC 12 warns falsely (-Wrestrict)
    std::string s = "t";
    s += std::to_string(i);
    return s;
  };
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t count = 1 + rng() % 12, limit = 8 + rng() % 200;
    std::vector<std::vector<std::byte>> data;
    io::safetensors_writer w;
    for (std::size_t i = 0; i < count; ++i) data.push_back(random_bytes(rng, st_dtype::u8, rng() % 120));
    for (std::size_t i = 0; i < count; ++i) w.add(tname(i), st_dtype::u8, {data[i].size()}, data[i]);
    temp_dir dir;
    const auto files = io::write_sharded(w, dir.path(), limit);
    INFO("trial " << trial << ": " << count << " tensors, limit " << limit << ", " << files.size() << " files");
    const auto ck = io::safetensors_checkpoint::open(dir.path());
    REQUIRE(ck.size() == count);
    std::string previous_shard;
    for (std::size_t s = 0; s < ck.shards().size(); ++s) {
      const auto& shard = ck.shards()[s];
      std::size_t bytes = 0, non_empty = 0;
      for (const auto& t : shard.tensors()) {
        bytes += t.bytes().size();
        non_empty += !t.bytes().empty();
      }
      CHECK((bytes <= limit || non_empty == 1));  // over the limit only with one tensor (and empty ones)
    }
    for (std::size_t i = 0; i < count; ++i) {
      const std::string n = tname(i);
      const auto t = ck.tensor(n);
      CHECK(std::equal(t.bytes().begin(), t.bytes().end(), data[i].begin(), data[i].end()));
      // Shards are filled in insertion order: a tensor's shard (model-0000k-of-...) never precedes
      // its predecessor's.
      CHECK(ck.shard_of(n) >= previous_shard);
      previous_shard = ck.shard_of(n);
    }
  }
}
}  // namespace tessel_test_io_safetensors
