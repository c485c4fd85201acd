// Umbrella for tessel/arch: target flags and vector type, mma atoms, widening decoders, math.
#pragma once
#include <tessel/arch/convert.hpp>
#include <tessel/arch/decode_atoms.hpp>
#include <tessel/arch/gemm_atoms.hpp>
#include <tessel/arch/math.hpp>
#include <tessel/arch/softmax_atoms.hpp>
#include <tessel/arch/stream.hpp>
#include <tessel/arch/target.hpp>
#include <tessel/arch/unpack.hpp>
