// tessel: the whole library in one include. Prefer the layer umbrellas (tessel/types.hpp,
// tessel/tile.hpp, ...) in code that needs only part of it; they compile faster.
#pragma once

#include <tessel/types.hpp>
#include <tessel/arch.hpp>
#include <tessel/layout.hpp>
#include <tessel/tile.hpp>
#include <tessel/device.hpp>
#include <tessel/ops.hpp>
#include <tessel/emulator.hpp>
#include <tessel/collectives.hpp>
#include <tessel/io.hpp>
#include <tessel/nn.hpp>
#include <tessel/dist.hpp>
#include <tessel/graph.hpp>
#include <tessel/verify.hpp>
