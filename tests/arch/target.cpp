// The compile-time target flags: each flag this build claims is one the running CPU has (so no
// atom compiled in can fault), they imply each other as the ISA extensions do, the register type's
// width follows the widest one, and target_name names the best.
#include <catch2/catch.hpp>

#include <fstream>
#include <string>
#include <string_view>

#include <cpuid.h>

#include <tessel/arch/target.hpp>

using namespace tessel;

TEST_CASE("every target flag of this build is supported by the CPU running it", "[arch][target]") {
  __builtin_cpu_init();
  if constexpr (arch::has_avx512) {
    CHECK(__builtin_cpu_supports("avx512f"));
    CHECK(__builtin_cpu_supports("avx512bw"));
    CHECK(__builtin_cpu_supports("avx512vl"));
    CHECK(__builtin_cpu_supports("avx512dq"));
  }
  if constexpr (arch::has_avx512_bf16) CHECK(__builtin_cpu_supports("avx512bf16"));
  if constexpr (arch::has_avx2_fma) {
    CHECK(__builtin_cpu_supports("avx2"));
    CHECK(__builtin_cpu_supports("fma"));
  }
  if constexpr (arch::has_f16c) {
    // (Clang 14's __builtin_cpu_supports has no "f16c": CPUID leaf 1, ECX bit 29)
    unsigned a = 0, b = 0, c = 0, d = 0;
    REQUIRE(__get_cpuid(1, &a, &b, &c, &d));
    CHECK((c >> 29 & 1u) == 1u);
  }
}

TEST_CASE("target flags nest like the ISA extensions and set the vector width", "[arch][target]") {
  // every AVX-512 machine has AVX2 + FMA; the BF16 extension implies AVX512BW
  STATIC_REQUIRE(!arch::has_avx512 || arch::has_avx2_fma);
  STATIC_REQUIRE(!arch::has_avx512_bf16 || arch::has_avx2_fma);
  STATIC_REQUIRE(arch::vec_f32_width == arch::vec_f32::size);
  STATIC_REQUIRE(arch::vec_f32_width == (arch::has_avx512 ? 16 : arch::has_avx2_fma ? 8 : arch::vec_f32_width));
  STATIC_REQUIRE(arch::vec_f32_width >= 1);
  constexpr std::string_view name = arch::target_name();
  constexpr std::string_view best = arch::has_avx512_bf16 ? "avx512_bf16" : arch::has_avx512 ? "avx512" : arch::has_avx2_fma ? "avx2_fma" : "scalar";
  STATIC_REQUIRE(name == best);
}

TEST_CASE("cpu_model names the processor by its CPUID brand string, trimmed and stable", "[arch][target]") {
  const std::string& m = arch::cpu_model();
  REQUIRE_FALSE(m.empty());
  CHECK(m.front() != ' ');
  CHECK(m.back() != ' ');
  CHECK(&arch::cpu_model() == &m);  // computed once
#if defined(__x86_64__) || defined(__i386__)
  // The brand string, read here through the raw __cpuid macro a word at a time: 48 bytes of
  // leaves 0x80000002-4, up to the first NUL, without leading or trailing blanks.
  unsigned top = 0, b = 0, c = 0, d = 0;
  __cpuid(0x80000000u, top, b, c, d);
  if (top >= 0x80000004u) {
    std::string brand;
    for (unsigned leaf = 0x80000002u; leaf <= 0x80000004u; ++leaf) {
      unsigned w[4];
      __cpuid(leaf, w[0], w[1], w[2], w[3]);
      for (unsigned word : w)
        for (int byte = 0; byte < 4; ++byte) brand += char((word >> (8 * byte)) & 0xffu);
    }
    brand.resize(brand.find('\0') == std::string::npos ? brand.size() : brand.find('\0'));
    brand.erase(0, brand.find_first_not_of(" \t"));
    brand.erase(brand.find_last_not_of(" \t") + 1);
    if (!brand.empty()) CHECK(m == brand);
  }
#endif
  // Linux reads the same brand string at boot; a virtual machine restored on another host keeps
  // the boot-time name in /proc/cpuinfo while CPUID answers for the new host (seen here: "AMD
  // EPYC" at boot, "Oxide Virtual Turin-like Processor" now). A difference is reported, not failed.
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      std::string k = line.substr(line.find(':') + 1);
      k.erase(0, k.find_first_not_of(" \t"));
      k.erase(k.find_last_not_of(" \t") + 1);
      if (m != k) WARN("cpu_model() is '" << m << "', the kernel's boot-time model name '" << k << "'");
      break;
    }
}
