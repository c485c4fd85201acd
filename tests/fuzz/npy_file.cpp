// libFuzzer target: arbitrary bytes as a .npy file, through the in-memory reader. Any tessel::error
// is a refusal (fine); any other exception, a crash or a sanitizer report is a bug. An array that
// parses must hold exactly numel x element-size bytes, and the writer's file of it must parse back
// to the same dtype, shape and bytes.
#include <cstddef>
#include <cstdint>
#include <span>

#include <tessel/io/npy.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = tessel::io;
  try {
    const io::npy_array a = io::parse_npy(std::as_bytes(std::span(data, size)), "fuzz");
    std::size_t n = tessel::dtype_size(a.type);
    for (std::size_t d : a.shape) n *= d;
    if (n != a.data.size()) __builtin_trap();
    const io::npy_array b = io::parse_npy(io::npy_bytes(a), "rewritten");
    if (b.type != a.type || b.shape != a.shape || b.data != a.data || b.boolean != a.boolean) __builtin_trap();
  } catch (const tessel::error&) {}
  return 0;
}
