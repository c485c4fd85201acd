// Umbrella for tessel's number layer: bf16, fp16, e4m3, e5m2, int4x2, their numeric_limits,
// the runtime dtype enum and traits, and the bulk (vectorized) conversions.
#pragma once

#include <tessel/types/bf16.hpp>
#include <tessel/types/convert.hpp>
#include <tessel/types/dtype.hpp>
#include <tessel/types/fp16.hpp>
#include <tessel/types/fp8.hpp>
#include <tessel/types/int4.hpp>
#include <tessel/types/limits.hpp>
