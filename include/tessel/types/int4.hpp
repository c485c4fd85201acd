// tessel::int4x2: two signed 4-bit integers (-8..7) packed in one byte, low nibble first;
// the storage of compressed gradients and int4 weights. pack_int4/unpack_int4 do it over spans.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <tessel/types/errors.hpp>
#include <tessel/types/detail/codec.hpp>

namespace tessel {
inline namespace v0 {

struct int4x2 {
  static constexpr int min_value = -8;
  static constexpr int max_value = 7;

  int4x2() = default;
  // Throws std::out_of_range when a value does not fit in 4 signed bits.
  constexpr int4x2(int lo, int hi) : bits_(pack(check(lo), check(hi))) {}

  // Clamps each value to [-8, 7] instead of throwing.
  static constexpr int4x2 saturate(int lo, int hi) noexcept { return from_bits(pack(clamp(lo), clamp(hi))); }
  static constexpr int4x2 from_bits(std::uint8_t b) noexcept {
    int4x2 r;
    r.bits_ = b;
    return r;
  }
  constexpr std::uint8_t bits() const noexcept { return bits_; }

  constexpr int lo() const noexcept { return sign_extend(bits_ & 0xF); }
  constexpr int hi() const noexcept { return sign_extend(bits_ >> 4); }
  // i = 0 is lo, 1 is hi; throws std::out_of_range otherwise.
  constexpr int get(int i) const {
    if (i != 0 && i != 1) throw type_error(errc::out_of_range, "int4x2::get: index " + std::to_string(i) + " not in {0, 1}");
    return i == 0 ? lo() : hi();
  }

  friend constexpr bool operator==(int4x2 a, int4x2 b) noexcept { return a.bits_ == b.bits_; }

 private:
  static constexpr int check(int v) {
    if (v < min_value || v > max_value) throw type_error(errc::out_of_range, "int4x2: value " + std::to_string(v) + " outside [-8, 7]");
    return v;
  }
  static constexpr int clamp(int v) noexcept { return v < min_value ? min_value : (v > max_value ? max_value : v); }
  static constexpr std::uint8_t pack(int lo, int hi) noexcept {
    return static_cast<std::uint8_t>((static_cast<unsigned>(lo) & 0xFu) | ((static_cast<unsigned>(hi) & 0xFu) << 4));
  }
  static constexpr int sign_extend(unsigned nibble) noexcept { return static_cast<int>(nibble ^ 8u) - 8; }

  std::uint8_t bits_;
};
static_assert(sizeof(int4x2) == 1 && std::is_trivially_copyable_v<int4x2>);

// Packs src[2i], src[2i+1] into dst[i] (low, high). src.size() must be 2 * dst.size()
// (std::invalid_argument otherwise). saturate clamps to [-8, 7]; propagate throws
// std::out_of_range naming the first value that does not fit (dst is then unspecified).
inline void pack_int4(std::span<const std::int8_t> src, std::span<int4x2> dst, overflow ov = overflow::saturate) {
  if (src.size() != 2 * dst.size())
    throw type_error(errc::invalid_argument, "pack_int4: source has " + std::to_string(src.size()) + " values but destination has " +
                                                 std::to_string(dst.size()) + " pairs (needs " + std::to_string(dst.size() * 2) + " values)");
  if (ov == overflow::propagate)
    for (std::size_t i = 0; i < src.size(); ++i)
      if (src[i] < int4x2::min_value || src[i] > int4x2::max_value)
        throw type_error(errc::out_of_range,
                         "pack_int4: value " + std::to_string(int(src[i])) + " at index " + std::to_string(i) + " outside [-8, 7]");
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = int4x2::saturate(src[2 * i], src[2 * i + 1]);
}

// Inverse of pack_int4: dst.size() must be 2 * src.size().
inline void unpack_int4(std::span<const int4x2> src, std::span<std::int8_t> dst) {
  if (dst.size() != 2 * src.size())
    throw type_error(errc::invalid_argument, "unpack_int4: source has " + std::to_string(src.size()) + " pairs but destination has " +
                                                 std::to_string(dst.size()) + " values (needs " + std::to_string(src.size() * 2) + ")");
  for (std::size_t i = 0; i < src.size(); ++i) {
    dst[2 * i] = static_cast<std::int8_t>(src[i].lo());
    dst[2 * i + 1] = static_cast<std::int8_t>(src[i].hi());
  }
}

}  // namespace v0
}  // namespace tessel
