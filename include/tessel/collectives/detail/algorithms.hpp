// The collective algorithms, written once against the type-erased transport. Each one reduces
// every element in rank order 0..n-1 (the canonical order): algorithms move raw contributions or
// rank-order prefix partials, never partial sums in another order, so all of them give the same bits.
// One header per family; this one gathers them for the communicator.
#pragma once

#include <tessel/collectives/algorithm.hpp>
#include <tessel/collectives/detail/all_gather.hpp>
#include <tessel/collectives/detail/all_reduce.hpp>
#include <tessel/collectives/detail/coll_ctx.hpp>
#include <tessel/collectives/detail/reduce_scatter.hpp>
#include <tessel/collectives/detail/scratch.hpp>
#include <tessel/collectives/detail/tree.hpp>
