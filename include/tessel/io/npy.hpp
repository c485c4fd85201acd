// NumPy's .npy files (format versions 1.0, 2.0 and 3.0): a validating reader that returns a
// row-major copy (Fortran-ordered arrays are reordered), and a writer whose files numpy.load reads.
// The header is a Python dict literal; the reader accepts exactly what numpy writes (keys 'descr',
// 'fortran_order', 'shape' in any order, a trailing comma, spaces) and refuses anything else with
// an io_error naming the file: a file is untrusted input (tests/fuzz/npy_file.cpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <tessel/io/detail/file.hpp>
#include <tessel/io/errors.hpp>
#include <tessel/types/dtype.hpp>

namespace tessel {
inline namespace v0 {
namespace io {

static_assert(std::endian::native == std::endian::little, "tessel::io reads .npy files on little-endian hosts only");

// An array read from (or to be written to) a .npy file: row-major bytes. NumPy's bool ('|b1')
// reads as u8 with `boolean` set (the graph layer's bool is u8 too).
struct npy_array {
  dtype type = dtype::f32;
  std::vector<std::size_t> shape;  // empty: a scalar
  std::vector<std::byte> data;     // numel * dtype_size(type) bytes
  bool boolean = false;

  std::size_t numel() const {
    std::size_t n = 1;
    for (std::size_t d : shape) n *= d;  // the reader checked the product
    return n;
  }
  // The elements as T (T must be the array's element type).
  template <class T>
  std::vector<T> values() const {
    if (!detail_has_type<T>())
      throw io_error(errc::invalid_argument, "npy", std::string("values<T>(): the array holds ") + std::string(dtype_name(type)));
    std::vector<T> v(numel());
    if (!v.empty()) std::memcpy(v.data(), data.data(), v.size() * sizeof(T));
    return v;
  }

 private:
  template <class T>
  bool detail_has_type() const {
    return tessel::detail::has_dtype<T> && tessel::detail::dtype_of_v<T> == type;
  }
};

namespace detail {

// The descr strings numpy writes for the dtypes tessel has ('<' little-endian, '|' one byte).
struct npy_descr {
  std::string_view descr;
  dtype type;
  bool boolean;
};
inline constexpr npy_descr npy_descrs[] = {
    {"<f8", dtype::f64, false}, {"<f4", dtype::f32, false}, {"<f2", dtype::fp16, false}, {"<i8", dtype::i64, false},
    {"<i4", dtype::i32, false}, {"<i2", dtype::i16, false}, {"|i1", dtype::i8, false},   {"<u8", dtype::u64, false},
    {"<u4", dtype::u32, false}, {"<u2", dtype::u16, false}, {"|u1", dtype::u8, false},   {"|b1", dtype::u8, true},
};

// A cursor over the header's dict literal.
class npy_header_parser {
 public:
  npy_header_parser(std::string_view text, std::string_view file) : s_(text), file_(file) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw io_error(errc::format, file_, "npy header: " + what + " (at byte " + std::to_string(i_) + " of '" + std::string(s_) + "')");
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  std::string string_literal() {
    skip_space();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) fail("expected a quoted string");
    const char q = s_[i_++];
    const std::size_t start = i_;
    while (i_ < s_.size() && s_[i_] != q) {
      if (s_[i_] == '\\') fail("escapes are not allowed in header strings");
      ++i_;
    }
    if (i_ >= s_.size()) fail("unterminated string");
    return std::string(s_.substr(start, i_++ - start));
  }
  bool boolean_literal() {
    skip_space();
    for (auto [word, v] : {std::pair<std::string_view, bool>{"True", true}, {"False", false}})
      if (s_.substr(i_, word.size()) == word) {
        i_ += word.size();
        return v;
      }
    fail("expected True or False");
  }
  std::size_t integer() {
    skip_space();
    if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) fail("expected a non-negative integer");
    std::size_t v = 0;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
      v = io::detail::add_checked(io::detail::mul_checked(v, 10, file_, "npy header: shape: "), static_cast<std::size_t>(s_[i_] - '0'), file_,
                                  "npy header: shape: ");
      ++i_;
    }
    if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2's long suffix, which old numpy wrote
    return v;
  }
  std::vector<std::size_t> shape_tuple() {
    expect('(');
    std::vector<std::size_t> shape;
    if (eat(')')) return shape;
    for (;;) {
      if (shape.size() >= 64) fail("more than 64 dims");
      shape.push_back(integer());
      if (eat(')')) break;
      expect(',');
      if (eat(')')) break;
    }
    return shape;
  }
  bool at_end() {
    skip_space();
    return i_ == s_.size();
  }

 private:
  std::string_view s_;
  std::string_view file_;
  std::size_t i_ = 0;
};

}  // namespace detail

// What a .npy header says, and where the data starts.
struct npy_header {
  dtype type = dtype::f32;
  bool boolean = false;
  bool fortran_order = false;
  std::vector<std::size_t> shape;
  std::size_t data_offset = 0;  // bytes from the start of the file
  std::size_t data_bytes = 0;   // numel * element size, checked
};

inline constexpr std::size_t npy_max_header = std::size_t{1} << 20;  // numpy itself refuses far less

inline npy_header parse_npy_header(std::span<const std::byte> bytes, std::string_view file) {
  static constexpr unsigned char magic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || std::memcmp(bytes.data(), magic, sizeof magic) != 0)
    throw io_error(errc::format, file, "not a .npy file (no \\x93NUMPY magic)");
  const auto major = static_cast<unsigned>(bytes[6]);
  std::size_t len = 0, pre = 0;
  if (major == 1) {
    len = static_cast<std::size_t>(bytes[8]) | static_cast<std::size_t>(bytes[9]) << 8;
    pre = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw io_error(errc::format, file, "npy header: truncated length field");
    for (int k = 0; k < 4; ++k) len |= static_cast<std::size_t>(bytes[8 + static_cast<std::size_t>(k)]) << (8 * k);
    pre = 12;
  } else {
    throw io_error(errc::unsupported, file,
                   "npy format version " + std::to_string(major) + "." + std::to_string(static_cast<unsigned>(bytes[7])) + " (1.0 to 3.0 are read)");
  }
  if (len > npy_max_header) throw io_error(errc::format, file, "npy header: " + std::to_string(len) + " bytes is more than the 1 MiB limit");
  if (bytes.size() - pre < len)
    throw io_error(errc::format, file,
                   "npy header: says " + std::to_string(len) + " bytes but the file has " + std::to_string(bytes.size() - pre) + " after the length");
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + pre), len);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\0')) text.remove_suffix(1);

  npy_header h;
  h.data_offset = pre + len;
  detail::npy_header_parser p(text, file);
  bool have_descr = false, have_order = false, have_shape = false;
  p.expect('{');
  while (!p.eat('}')) {
    const std::string key = p.string_literal();
    p.expect(':');
    if (key == "descr") {
      if (have_descr) p.fail("'descr' twice");
      have_descr = true;
      const std::string d = p.string_literal();
      std::string norm = d;
      if (norm.size() == 3 && norm[0] == '=') norm[0] = '<';  // native order is little-endian here
      if (norm == "<i1" || norm == "<u1" || norm == "<b1") norm[0] = '|';
      const auto it =
          std::find_if(std::begin(detail::npy_descrs), std::end(detail::npy_descrs), [&](const detail::npy_descr& x) { return x.descr == norm; });
      if (it == std::end(detail::npy_descrs))
        throw io_error(errc::unsupported, file, "npy dtype '" + d + "' (little-endian f8 f4 f2 i8 i4 i2 i1 u8 u4 u2 u1 and b1 are read)");
      h.type = it->type;
      h.boolean = it->boolean;
    } else if (key == "fortran_order") {
      if (have_order) p.fail("'fortran_order' twice");
      have_order = true;
      h.fortran_order = p.boolean_literal();
    } else if (key == "shape") {
      if (have_shape) p.fail("'shape' twice");
      have_shape = true;
      h.shape = p.shape_tuple();
    } else {
      p.fail("unknown key '" + key + "'");
    }
    if (p.eat('}')) break;
    p.expect(',');
  }
  if (!p.at_end()) p.fail("text after the dict");
  if (!have_descr || !have_order || !have_shape) p.fail("'descr', 'fortran_order' and 'shape' are all required");
  std::size_t n = dtype_size(h.type);
  for (std::size_t d : h.shape) n = io::detail::mul_checked(n, d, file, "npy: data size: ");
  h.data_bytes = n;
  return h;
}

// Parses a whole .npy file held in memory.
inline npy_array parse_npy(std::span<const std::byte> bytes, std::string_view file = "npy") {
  const npy_header h = parse_npy_header(bytes, file);
  const std::size_t have = bytes.size() - h.data_offset;
  if (have != h.data_bytes)
    throw io_error(errc::format, file,
                   "npy data: the header's shape and dtype need " + std::to_string(h.data_bytes) + " bytes, the file has " + std::to_string(have));
  npy_array a;
  a.type = h.type;
  a.boolean = h.boolean;
  a.shape = h.shape;
  const std::byte* src = bytes.data() + h.data_offset;
  a.data.assign(src, src + h.data_bytes);
  if (a.boolean)
    for (std::byte b : a.data)
      if (b != std::byte{0} && b != std::byte{1}) throw io_error(errc::format, file, "npy data: a bool byte other than 0 or 1");
  if (h.fortran_order && a.shape.size() > 1 && h.data_bytes > 0) {
    // Column-major to row-major: walk the row-major index, find each element's column-major offset.
    const std::size_t es = dtype_size(a.type), r = a.shape.size(), total = h.data_bytes / es;
    std::vector<std::size_t> idx(r, 0), fstride(r);
    fstride[0] = 1;
    for (std::size_t k = 1; k < r; ++k) fstride[k] = fstride[k - 1] * a.shape[k - 1];
    for (std::size_t i = 0; i < total; ++i) {
      std::size_t off = 0;
      for (std::size_t k = 0; k < r; ++k) off += idx[k] * fstride[k];
      std::memcpy(a.data.data() + i * es, src + off * es, es);
      for (std::size_t k = r; k-- > 0;) {
        if (++idx[k] < a.shape[k]) break;
        idx[k] = 0;
      }
    }
  }
  return a;
}

inline npy_array read_npy(const std::filesystem::path& path) {
  const detail::mapped_file f(path);
  return parse_npy(f.bytes(), path.string());
}

// A version 1.0 .npy file (2.0 when the header needs more than 65535 bytes), row-major.
inline std::vector<std::byte> npy_bytes(dtype type, std::span<const std::size_t> shape, std::span<const std::byte> data, bool boolean = false) {
  const auto it = std::find_if(std::begin(detail::npy_descrs), std::end(detail::npy_descrs),
                               [&](const detail::npy_descr& x) { return x.type == type && x.boolean == boolean; });
  if (it == std::end(detail::npy_descrs)) throw io_error(errc::unsupported, "npy", std::string("no npy dtype for ") + std::string(dtype_name(type)));
  std::size_t n = dtype_size(type);
  for (std::size_t d : shape) n = io::detail::mul_checked(n, d, "npy", "npy: data size: ");
  if (n != data.size())
    throw io_error(errc::invalid_argument, "npy",
                   "the shape and dtype need " + std::to_string(n) + " bytes, the data has " + std::to_string(data.size()));
  std::string dict = "{'descr': '" + std::string(it->descr) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t k = 0; k < shape.size(); ++k) dict += std::to_string(shape[k]) + (shape.size() == 1 || k + 1 < shape.size() ? ", " : "");
  if (!shape.empty()) dict.resize(dict.size() - (shape.size() == 1 ? 1 : 0));
  dict += "), }";
  const bool v2 = dict.size() + 11 > 65535;
  const std::size_t pre = v2 ? 12 : 10;
  std::size_t total = pre + dict.size() + 1;
  const std::size_t pad = (64 - total % 64) % 64;  // numpy aligns the data to 64 bytes
  dict.append(pad, ' ');
  dict += '\n';
  std::vector<std::byte> out;
  out.reserve(pre + dict.size() + data.size());
  for (unsigned char c : std::initializer_list<unsigned char>{0x93, 'N', 'U', 'M', 'P', 'Y'}) out.push_back(std::byte{c});
  out.push_back(std::byte{static_cast<unsigned char>(v2 ? 2 : 1)});
  out.push_back(std::byte{0});
  const std::size_t len = dict.size();
  for (std::size_t k = 0; k < (v2 ? 4u : 2u); ++k) out.push_back(std::byte{static_cast<unsigned char>(len >> (8 * k))});
  for (char c : dict) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

inline std::vector<std::byte> npy_bytes(const npy_array& a) { return npy_bytes(a.type, a.shape, a.data, a.boolean); }

inline void write_npy(const std::filesystem::path& path, const npy_array& a) {
  const std::vector<std::byte> bytes = npy_bytes(a);
  detail::atomic_file f(path);
  f.write(bytes);
  f.commit();
}

}  // namespace io
}  // namespace v0
}  // namespace tessel
