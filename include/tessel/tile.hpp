// Umbrella for tessel/tile: tensors, fragments, staged tiles, load/mma/map/reduce/store, epilogues,
// pipelined loops and the block context.
#pragma once
#include <tessel/tile/block_ctx.hpp>
#include <tessel/tile/epilogue.hpp>
#include <tessel/tile/fragment.hpp>
#include <tessel/tile/load.hpp>
#include <tessel/tile/map.hpp>
#include <tessel/tile/mma.hpp>
#include <tessel/tile/pipelined.hpp>
#include <tessel/tile/ranges.hpp>
#include <tessel/tile/store.hpp>
#include <tessel/tile/tensor.hpp>
