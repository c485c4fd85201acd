// Tutorial 00: tessel's number types. bf16, fp16 and the two OCP FP8 formats convert from float and
// double with one round-to-nearest-even; value conversion never saturates, the bulk API can; FP8
// tensors are usually stored block-scaled, one float scale per 128 values.
#include <cstdio>
#include <limits>
#include <vector>

#include <tessel/types.hpp>

int main() {
  using namespace tessel;

  // 1. Scalar conversions: explicit, exact, and inspectable bit by bit.
  const float x = 3.14159265f;
  std::printf("%-6s %-10s %-6s %s\n", "type", "bits", "value", "max finite");
  std::printf("%-6s 0x%04x     %-6g %g\n", "bf16", bf16(x).bits(), double(bf16(x)), double(std::numeric_limits<bf16>::max()));
  std::printf("%-6s 0x%04x     %-6g %g\n", "fp16", fp16(x).bits(), double(fp16(x)), double(std::numeric_limits<fp16>::max()));
  std::printf("%-6s 0x%02x       %-6g %g\n", "e4m3", e4m3(x).bits(), double(e4m3(x)), double(std::numeric_limits<e4m3>::max()));
  std::printf("%-6s 0x%02x       %-6g %g\n", "e5m2", e5m2(x).bits(), double(e5m2(x)), double(std::numeric_limits<e5m2>::max()));

  // 2. Overflow: value semantics give NaN (E4M3 has no Inf) or Inf; the bulk API can saturate.
  std::printf("\ne4m3(500.f) is NaN: %s, e5m2(1e5f) is Inf: %s\n", isnan(e4m3(500.0f)) ? "yes" : "no", isinf(e5m2(1e5f)) ? "yes" : "no");
  const std::vector<float> big = {500.0f, -1e9f, 1.0f};
  std::vector<e4m3> sat(big.size());
  convert(std::span<const float>(big), std::span<e4m3>(sat), overflow::saturate);
  std::printf("saturated to e4m3: %g %g %g\n", double(sat[0]), double(sat[1]), double(sat[2]));

  // 3. Arithmetic goes through float and rounds once; comparisons follow IEEE (-0 == +0, NaN unordered).
  const bf16 a(1.0f), b(0.00390625f);  // b = 2^-8: exactly half an ulp of 1 in bf16
  std::printf("\nbf16: 1 + 2^-8 = %g (tie -> even), -0 == +0: %s\n", double(a + b), bf16(-0.0f) == bf16(0.0f) ? "true" : "false");

  // 4. Block-scaled FP8: one scale per 128 values maps each block's largest |x| to 448.
  std::vector<float> acts(256);
  for (std::size_t i = 0; i < acts.size(); ++i) acts[i] = (i < 128 ? 0.01f : 20.0f) * float(int(i % 7) - 3);
  std::vector<e4m3> q(acts.size());
  const std::vector<float> scales = quantize_blocks(std::span<const float>(acts), std::span<e4m3>(q));
  std::vector<float> back(acts.size());
  dequantize_blocks(std::span<const e4m3>(q), std::span<const float>(scales), std::span<float>(back));
  std::printf("\nblock scales: %g %g; x[5] = %g -> %g, x[131] = %g -> %g\n", double(scales[0]), double(scales[1]), double(acts[5]), double(back[5]),
              double(acts[131]), double(back[131]));

  // 5. Runtime dtypes: names, sizes and dispatch for code that handles any element type.
  for (dtype d : {dtype::f32, dtype::bf16, dtype::e4m3, dtype::i4x2})
    std::printf("%s%.*s:%zu", d == dtype::f32 ? "\ndtypes " : " ", int(dtype_name(d).size()), dtype_name(d).data(), dtype_size(d));
  std::printf(" (bytes)\n");
  return 0;
}
