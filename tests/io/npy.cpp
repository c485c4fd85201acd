// tessel::io .npy files: files numpy 1.24 wrote (fixtures/npy/, made with /usr/bin/python3's numpy:
// every dtype tessel reads, a scalar, an empty array, Fortran order, format 2.0) read back with the
// values numpy put in; the writer reproduces numpy's bytes exactly; every malformed header or data
// size is an io_error naming the file.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <tessel/io/npy.hpp>
#include <tessel/types.hpp>
#include "io/io_test_util.hpp"

namespace tessel_test_io_npy {

namespace io = tessel::io;
using tessel::dtype;
using tessel::errc;

const std::filesystem::path fixtures = std::filesystem::path(__FILE__).parent_path() / "fixtures" / "npy";

std::vector<std::byte> file_bytes(const std::filesystem::path& p) {
  const std::string s = io::detail::read_file(p, 1 << 20);
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

std::vector<std::byte> header_file(const std::string& dict, std::size_t data_bytes, int version = 1) {
  std::vector<std::byte> out;
  for (unsigned char c : std::initializer_list<unsigned char>{0x93, 'N', 'U', 'M', 'P', 'Y'}) out.push_back(std::byte{c});
  out.push_back(std::byte{static_cast<unsigned char>(version)});
  out.push_back(std::byte{0});
  const std::size_t len = dict.size();
  for (int k = 0; k < (version == 1 ? 2 : 4); ++k) out.push_back(std::byte{static_cast<unsigned char>(len >> (8 * k))});
  for (char c : dict) out.push_back(static_cast<std::byte>(c));
  out.resize(out.size() + data_bytes, std::byte{0});
  return out;
}

TEST_CASE("io npy: numpy's files read back with numpy's values", "[io][npy]") {
  const auto a = io::read_npy(fixtures / "f32_2x3.npy");
  CHECK(a.type == dtype::f32);
  CHECK(a.shape == std::vector<std::size_t>{2, 3});
  CHECK(a.values<float>() == std::vector<float>{-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f});

  const auto s = io::read_npy(fixtures / "f64_scalar.npy");
  CHECK(s.shape.empty());
  CHECK(s.numel() == 1);
  CHECK(s.values<double>() == std::vector<double>{3.25});

  const auto i = io::read_npy(fixtures / "i64_vec.npy");
  CHECK(i.values<std::int64_t>() == std::vector<std::int64_t>{-1, 0, std::int64_t{1} << 40, -(std::int64_t{1} << 62)});

  const auto b = io::read_npy(fixtures / "bool_2x2.npy");
  CHECK(b.boolean);
  CHECK(b.type == dtype::u8);
  CHECK(b.values<std::uint8_t>() == std::vector<std::uint8_t>{1, 0, 0, 1});

  const auto h = io::read_npy(fixtures / "f16_3.npy");
  REQUIRE(h.type == dtype::fp16);
  const auto hv = h.values<tessel::fp16>();
  CHECK(static_cast<float>(hv[0]) == 1.5f);
  CHECK(static_cast<float>(hv[1]) == -2.0f);
  CHECK(static_cast<float>(hv[2]) == 65504.0f);

  const auto e = io::read_npy(fixtures / "u8_0x5.npy");
  CHECK(e.shape == std::vector<std::size_t>{0, 5});
  CHECK(e.data.empty());

  const auto t = io::read_npy(fixtures / "i32_2x3x2.npy");
  std::vector<std::int32_t> want(12);
  for (int k = 0; k < 12; ++k) want[static_cast<std::size_t>(k)] = k - 6;
  CHECK(t.values<std::int32_t>() == want);

  const auto v2 = io::read_npy(fixtures / "f32_v2_4.npy");
  CHECK(v2.values<float>() == std::vector<float>{1, 2, 3, 4});
}

TEST_CASE("io npy: a Fortran-ordered array reads row-major", "[io][npy]") {
  const auto f = io::read_npy(fixtures / "f32_fortran_3x4.npy");
  REQUIRE(f.shape == std::vector<std::size_t>{3, 4});
  std::vector<float> want(12);
  for (int k = 0; k < 12; ++k) want[static_cast<std::size_t>(k)] = static_cast<float>(k);  // arange(12).reshape(3, 4)
  CHECK(f.values<float>() == want);
}

TEST_CASE("io npy: the writer gives numpy's bytes, and files round-trip", "[io][npy]") {
  for (const char* name : {"f32_2x3.npy", "f64_scalar.npy", "i64_vec.npy", "bool_2x2.npy", "f16_3.npy", "u8_0x5.npy", "i32_2x3x2.npy"}) {
    INFO(name);
    const auto bytes = file_bytes(fixtures / name);
    CHECK(io::npy_bytes(io::parse_npy(bytes, name)) == bytes);
  }
  io_test::temp_dir dir;
  io::npy_array a;
  a.type = dtype::i16;
  a.shape = {3, 1, 2};
  for (std::int16_t x : {1, -2, 3, -4, 5, -32768}) {
    const auto* p = reinterpret_cast<const std::byte*>(&x);
    a.data.insert(a.data.end(), p, p + 2);
  }
  io::write_npy(dir / "a.npy", a);
  const auto back = io::read_npy(dir / "a.npy");
  CHECK(back.type == a.type);
  CHECK(back.shape == a.shape);
  CHECK(back.data == a.data);
  CHECK(back.values<std::int16_t>() == std::vector<std::int16_t>{1, -2, 3, -4, 5, -32768});
}

TEST_CASE("io npy: malformed files are io_errors naming the file", "[io][npy]") {
  using io_test::require_io_error;
  const auto parse = [](const std::vector<std::byte>& b) { return io::parse_npy(b, "x.npy"); };
  require_io_error([&] { parse({}); }, errc::format, "x.npy: not a .npy file");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8, 4)); }, errc::unsupported,
                   "x.npy: npy format version 4.0");
  auto cut = header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 0);
  cut.resize(cut.size() - 5);
  require_io_error([&] { parse(cut); }, errc::format, "npy header: says 57 bytes but the file has 52");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 7)); }, errc::format,
                   "npy data: the header's shape and dtype need 8 bytes, the file has 7");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 9)); }, errc::format,
                   "need 8 bytes, the file has 9");
  require_io_error([&] { parse(header_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8)); }, errc::unsupported, "npy dtype '>f4'");
  require_io_error([&] { parse(header_file("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 16)); }, errc::unsupported,
                   "npy dtype '<c8'");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'shape': (2,), }", 8)); }, errc::format, "are all required");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8)); }, errc::format,
                   "unknown key 'x'");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", 8)); }, errc::format,
                   "'descr' twice");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,)}", 8)); }, errc::format, "expected True or False");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}", 8)); }, errc::format,
                   "expected a non-negative integer");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} trailing", 8)); }, errc::format,
                   "text after the dict");
  require_io_error([&] { parse(header_file("{'descr': '<f4}", 8)); }, errc::format, "npy header: unterminated string");
  require_io_error([&] { parse(header_file("{'descr': 'a\\'b', 'fortran_order': False, 'shape': (2,)}", 8)); }, errc::format,
                   "escapes are not allowed");
  require_io_error([&] { parse(header_file("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", 8)); }, errc::overflow,
                   "x.npy: npy header: shape:");
  require_io_error([&] { parse(header_file("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", 8)); }, errc::overflow,
                   "x.npy: npy: data size:");
  require_io_error([&] { parse(header_file("{'descr': '|b1', 'fortran_order': False, 'shape': (2,)}", 0)); }, errc::format,
                   "need 2 bytes, the file has 0");
  auto bad_bool = header_file("{'descr': '|b1', 'fortran_order': False, 'shape': (2,)}", 2);
  bad_bool.back() = std::byte{7};
  require_io_error([&] { parse(bad_bool); }, errc::format, "a bool byte other than 0 or 1");
  require_io_error([&] { io::read_npy(fixtures / "no_such_file.npy"); }, errc::io, "no_such_file.npy: cannot open");
  io::npy_array wrong;
  wrong.shape = {3};
  wrong.data.resize(8);
  require_io_error([&] { io::npy_bytes(wrong); }, errc::invalid_argument, "the shape and dtype need 12 bytes, the data has 8");
  wrong.data.resize(12);
  require_io_error([&] { (void)wrong.values<double>(); }, errc::invalid_argument, "the array holds f32");
}

}  // namespace tessel_test_io_npy
