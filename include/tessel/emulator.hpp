// tessel/emulator.hpp: the UBL128 cluster emulator (cards, fabric, routing, faults, traces).
// See tessel/emulator/cluster.hpp for the data-plane API collectives build on.
#pragma once
#include <tessel/emulator/card.hpp>
#include <tessel/emulator/cluster.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/emulator/errors.hpp>
#include <tessel/emulator/fabric.hpp>
#include <tessel/emulator/routing.hpp>
#include <tessel/emulator/trace.hpp>
