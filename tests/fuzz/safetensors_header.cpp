// libFuzzer target: arbitrary bytes as a safetensors file, through the in-memory reader. Any
// tessel::error is a refusal (fine); any other exception, a crash or a sanitizer report is a bug.
// A file that opens must hand out every tensor's bytes and typed elements within the input, and
// the writer must reproduce it: the rewritten file opens with the same tensors, bit for bit.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include <tessel/io/safetensors.hpp>

namespace {
template <class T>
void touch(const tessel::io::tensor_view& t) {
  const auto d = t.data<T>();
  volatile unsigned char sink = 0;
  for (const T& x : d.span()) sink = sink ^ *reinterpret_cast<const unsigned char*>(&x);
  if (d.size() != t.numel() || t.bytes().size() != t.numel() * sizeof(T)) __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = tessel::io;
  try {
    const auto r = io::safetensors_reader::from_memory(std::as_bytes(std::span(data, size)), "fuzz");
    io::safetensors_writer w;
    for (const auto& [k, v] : r.metadata()) w.add_metadata(k, v);
    for (const auto& t : r.tensors()) w.add(t);
    const auto again = io::safetensors_reader::from_bytes(w.to_bytes(), "rewritten");
    if (again.size() != r.size() || again.metadata() != r.metadata()) __builtin_trap();
    for (const auto& t : again.tensors()) {
      const auto o = r.tensor(t.name());
      if (o.dtype() != t.dtype() || !std::ranges::equal(o.shape(), t.shape()) || !std::ranges::equal(o.bytes(), t.bytes())) __builtin_trap();
    }
    for (const auto& t : r.tensors()) {
      const auto* lo = reinterpret_cast<const std::byte*>(data);
      if (t.bytes().data() < lo || t.bytes().data() + t.bytes().size() > lo + size) __builtin_trap();
      switch (t.dtype()) {
        case io::st_dtype::f64: touch<double>(t); break;
        case io::st_dtype::f32: touch<float>(t); break;
        case io::st_dtype::bf16: touch<tessel::bf16>(t); break;
        case io::st_dtype::f16: touch<tessel::fp16>(t); break;
        case io::st_dtype::f8_e4m3: touch<tessel::e4m3>(t); break;
        case io::st_dtype::f8_e5m2: touch<tessel::e5m2>(t); break;
        case io::st_dtype::i64: touch<std::int64_t>(t); break;
        case io::st_dtype::i32: touch<std::int32_t>(t); break;
        case io::st_dtype::i16: touch<std::int16_t>(t); break;
        case io::st_dtype::i8: touch<std::int8_t>(t); break;
        case io::st_dtype::u64: touch<std::uint64_t>(t); break;
        case io::st_dtype::u32: touch<std::uint32_t>(t); break;
        case io::st_dtype::u16: touch<std::uint16_t>(t); break;
        case io::st_dtype::u8: touch<std::uint8_t>(t); break;
        case io::st_dtype::boolean: touch<bool>(t); break;  // throws for a byte other than 0/1
      }
    }
  } catch (const tessel::error&) {}
  return 0;
}
