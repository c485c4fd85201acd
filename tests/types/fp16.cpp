// tessel::fp16: every code, the conversion table, and value semantics.
#include "all_codes.hpp"

using tessel::fp16;

TEST_CASE("fp16 every code decodes and round-trips", "[types][fp16]") { check_every_code<fp16>(tessel_ref::fp16_spec); }

TEST_CASE("fp16 conversion table from the issue", "[types][fp16]") {
  CHECK(fp16(65519.0f).bits() == 0x7BFF);
  CHECK(fp16(65520.0f).bits() == 0x7C00);
  CHECK(fp16(-65520.0f).bits() == 0xFC00);
  CHECK(fp16(65504.0).bits() == 0x7BFF);
  CHECK(fp16(std::ldexp(1.0f, -24)).bits() == 0x0001);
  CHECK(fp16(std::ldexp(1.0f, -25)).bits() == 0x0000);     // tie to even 0
  CHECK(fp16(std::ldexp(3.0f, -26)).bits() == 0x0001);     // above the tie
  CHECK(fp16(std::ldexp(1023.5f, -24)).bits() == 0x0400);  // subnormal rounds up to min normal
  CHECK(fp16(std::numeric_limits<float>::infinity()).bits() == 0x7C00);
  CHECK(isnan(fp16(std::bit_cast<float>(0x7F800001u))));
  CHECK(fp16(1.0f / 3.0f).bits() == 0x3555);
}

TEST_CASE("fp16 arithmetic and comparison semantics", "[types][fp16]") {
  check_ieee_semantics<fp16>();
  static_assert(fp16(1.0f).bits() == 0x3C00 && float(fp16::from_bits(0x7BFF)) == 65504.0f);
}
