// tessel::bf16: every code, the conversion table, and value semantics.
#include "all_codes.hpp"

using tessel::bf16;

TEST_CASE("bf16 every code decodes and round-trips", "[types][bf16]") { check_every_code<bf16>(tessel_ref::bf16_spec); }

TEST_CASE("bf16 conversion table from the issue", "[types][bf16]") {
  const auto from = [](std::uint32_t u) { return bf16(std::bit_cast<float>(u)).bits(); };
  CHECK(from(0x3F808000u) == 0x3F80);            // tie, even stays
  CHECK(from(0x3F818000u) == 0x3F82);            // tie, odd rounds up
  CHECK(from(0x7F7F8000u) == 0x7F80);            // tie at max rounds to Inf
  const std::uint16_t snan = from(0x7F800001u);  // signalling NaN whose payload truncates away
  CHECK(isnan(bf16::from_bits(snan)));
  CHECK(snan != 0x7F80);
  CHECK(from(0xFF800001u) >> 15 == 1);
  CHECK(from(0x00000001u) == 0x0000);  // float denorm_min rounds to +0
  CHECK(from(0x00008000u) == 0x0000);  // tie to even 0
  CHECK(from(0x00018000u) == 0x0002);
  CHECK(from(0x80000000u) == 0x8000);
  CHECK(from(0x7F800000u) == 0x7F80);
  CHECK(from(0xFF800000u) == 0xFF80);
  CHECK(bf16(1e39).bits() == 0x7F80);  // from double: overflow -> Inf
  CHECK(bf16(1e-50).bits() == 0x0000);
  CHECK(bf16(-1e-50).bits() == 0x8000);
  // from double without double rounding: 1 + 2^-8 + 2^-40 rounds up (float would tie to 1).
  CHECK(bf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)).bits() == 0x3F81);
  CHECK(bf16(float(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40))).bits() == 0x3F80);
}

TEST_CASE("bf16 arithmetic and comparison semantics", "[types][bf16]") {
  check_ieee_semantics<bf16>();
  static_assert(bf16(1.0f).bits() == 0x3F80 && float(bf16::from_bits(0x4049)) == 3.140625f);
}
