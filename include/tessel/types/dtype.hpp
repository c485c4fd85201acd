// Runtime element types: tessel::dtype names every element type tessel stores, with its size and
// name, the compile-time mapping dtype_of<T> / dtype_type_t<D>, and visit_dtype for runtime dispatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <tessel/types/errors.hpp>
#include <tessel/types/bf16.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>
#include <tessel/types/int4.hpp>

namespace tessel {
inline namespace v0 {

enum class dtype : std::uint8_t { f64, f32, bf16, fp16, e4m3, e5m2, i64, i32, i16, i8, u64, u32, u16, u8, i4x2 };

inline constexpr dtype all_dtypes[] = {dtype::f64, dtype::f32, dtype::bf16, dtype::fp16, dtype::e4m3, dtype::e5m2, dtype::i64, dtype::i32,
                                       dtype::i16, dtype::i8,  dtype::u64,  dtype::u32,  dtype::u16,  dtype::u8,   dtype::i4x2};

}  // namespace v0

namespace detail {
template <class T>
inline constexpr bool has_dtype = false;
template <class T>
inline constexpr dtype dtype_of_v = dtype::f32;
#define TESSEL_DTYPE_MAP_(T, D)              \
  template <>                                \
  inline constexpr bool has_dtype<T> = true; \
  template <>                                \
  inline constexpr dtype dtype_of_v<T> = D;
TESSEL_DTYPE_MAP_(double, dtype::f64)
TESSEL_DTYPE_MAP_(float, dtype::f32)
TESSEL_DTYPE_MAP_(tessel::bf16, dtype::bf16)
TESSEL_DTYPE_MAP_(tessel::fp16, dtype::fp16)
TESSEL_DTYPE_MAP_(tessel::e4m3, dtype::e4m3)
TESSEL_DTYPE_MAP_(tessel::e5m2, dtype::e5m2)
TESSEL_DTYPE_MAP_(std::int64_t, dtype::i64)
TESSEL_DTYPE_MAP_(std::int32_t, dtype::i32)
TESSEL_DTYPE_MAP_(std::int16_t, dtype::i16)
TESSEL_DTYPE_MAP_(std::int8_t, dtype::i8)
TESSEL_DTYPE_MAP_(std::uint64_t, dtype::u64)
TESSEL_DTYPE_MAP_(std::uint32_t, dtype::u32)
TESSEL_DTYPE_MAP_(std::uint16_t, dtype::u16)
TESSEL_DTYPE_MAP_(std::uint8_t, dtype::u8)
TESSEL_DTYPE_MAP_(tessel::int4x2, dtype::i4x2)
#undef TESSEL_DTYPE_MAP_

template <dtype D>
struct dtype_type;
template <>
struct dtype_type<dtype::f64> {
  using type = double;
};
template <>
struct dtype_type<dtype::f32> {
  using type = float;
};
template <>
struct dtype_type<dtype::bf16> {
  using type = tessel::bf16;
};
template <>
struct dtype_type<dtype::fp16> {
  using type = tessel::fp16;
};
template <>
struct dtype_type<dtype::e4m3> {
  using type = tessel::e4m3;
};
template <>
struct dtype_type<dtype::e5m2> {
  using type = tessel::e5m2;
};
template <>
struct dtype_type<dtype::i64> {
  using type = std::int64_t;
};
template <>
struct dtype_type<dtype::i32> {
  using type = std::int32_t;
};
template <>
struct dtype_type<dtype::i16> {
  using type = std::int16_t;
};
template <>
struct dtype_type<dtype::i8> {
  using type = std::int8_t;
};
template <>
struct dtype_type<dtype::u64> {
  using type = std::uint64_t;
};
template <>
struct dtype_type<dtype::u32> {
  using type = std::uint32_t;
};
template <>
struct dtype_type<dtype::u16> {
  using type = std::uint16_t;
};
template <>
struct dtype_type<dtype::u8> {
  using type = std::uint8_t;
};
template <>
struct dtype_type<dtype::i4x2> {
  using type = tessel::int4x2;
};

[[noreturn]] inline void bad_dtype(dtype d) {
  throw type_error(errc::invalid_argument, "invalid dtype value " + std::to_string(static_cast<int>(d)));
}
}  // namespace detail

inline namespace v0 {

// True for the element types that have a dtype (cv-qualifiers ignored).
template <class T>
concept dtype_element = detail::has_dtype<std::remove_cv_t<T>>;

// dtype_of<bf16> == dtype::bf16. Using it with a type that has no dtype does not compile.
template <dtype_element T>
inline constexpr dtype dtype_of = detail::dtype_of_v<std::remove_cv_t<T>>;

// The C++ type of a dtype: dtype_type_t<dtype::bf16> is tessel::bf16.
template <dtype D>
using dtype_type_t = typename detail::dtype_type<D>::type;

// Calls f(std::type_identity<T>{}) with T the type of d; throws std::invalid_argument on a bad value.
template <class F>
constexpr decltype(auto) visit_dtype(dtype d, F&& f) {
  switch (d) {
#define TESSEL_DTYPE_CASE_(D) \
  case dtype::D: return static_cast<F&&>(f)(std::type_identity<dtype_type_t<dtype::D>>{});
    TESSEL_DTYPE_CASE_(f64)
    TESSEL_DTYPE_CASE_(f32)
    TESSEL_DTYPE_CASE_(bf16)
    TESSEL_DTYPE_CASE_(fp16)
    TESSEL_DTYPE_CASE_(e4m3)
    TESSEL_DTYPE_CASE_(e5m2)
    TESSEL_DTYPE_CASE_(i64)
    TESSEL_DTYPE_CASE_(i32)
    TESSEL_DTYPE_CASE_(i16)
    TESSEL_DTYPE_CASE_(i8)
    TESSEL_DTYPE_CASE_(u64)
    TESSEL_DTYPE_CASE_(u32)
    TESSEL_DTYPE_CASE_(u16)
    TESSEL_DTYPE_CASE_(u8)
    TESSEL_DTYPE_CASE_(i4x2)
#undef TESSEL_DTYPE_CASE_
  }
  detail::bad_dtype(d);
}

// Bytes per element (i4x2: one byte holds two 4-bit values).
constexpr std::size_t dtype_size(dtype d) {
  return visit_dtype(d, []<class T>(std::type_identity<T>) { return sizeof(T); });
}

constexpr std::string_view dtype_name(dtype d) {
  switch (d) {
    case dtype::f64: return "f64";
    case dtype::f32: return "f32";
    case dtype::bf16: return "bf16";
    case dtype::fp16: return "fp16";
    case dtype::e4m3: return "e4m3";
    case dtype::e5m2: return "e5m2";
    case dtype::i64: return "i64";
    case dtype::i32: return "i32";
    case dtype::i16: return "i16";
    case dtype::i8: return "i8";
    case dtype::u64: return "u64";
    case dtype::u32: return "u32";
    case dtype::u16: return "u16";
    case dtype::u8: return "u8";
    case dtype::i4x2: return "i4x2";
  }
  detail::bad_dtype(d);
}

// Inverse of dtype_name; throws std::invalid_argument naming the unknown string.
constexpr dtype dtype_from_name(std::string_view name) {
  for (dtype d : all_dtypes)
    if (dtype_name(d) == name) return d;
  throw type_error(errc::invalid_argument, "unknown dtype name '" + std::string(name) + "'");
}

constexpr bool dtype_is_floating(dtype d) {
  switch (d) {
    case dtype::f64:
    case dtype::f32:
    case dtype::bf16:
    case dtype::fp16:
    case dtype::e4m3:
    case dtype::e5m2: return true;
    default: return false;
  }
}

constexpr bool dtype_is_signed(dtype d) {
  switch (d) {
    case dtype::u64:
    case dtype::u32:
    case dtype::u16:
    case dtype::u8: return false;
    default: return true;
  }
}

// Bits of one value (i4x2 counts 4: the width of each packed value).
constexpr std::size_t dtype_bits(dtype d) { return d == dtype::i4x2 ? 4 : dtype_size(d) * 8; }

}  // namespace v0
}  // namespace tessel
