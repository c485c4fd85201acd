// The verification layer: check an operator or a user's tile program against an fp64 reference
// (fills, the dtype/K tolerance, a report of the worst element), gradcheck a backward by fp64
// central differences, check determinism bitwise, and the library operators' own entries
// (`tessel-verify --all`).
#pragma once

#include <tessel/verify/check.hpp>
#include <tessel/verify/determinism.hpp>
#include <tessel/verify/gradcheck.hpp>
#include <tessel/verify/ops.hpp>
