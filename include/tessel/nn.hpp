// The model layer: parameters, modules with forward and backward (mixture of experts too), decoder
// models from a config, a paged KV cache and generation with it.
#pragma once

#include <tessel/nn/decoder.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/generate.hpp>
#include <tessel/nn/kv_cache.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/nn/moe.hpp>
#include <tessel/nn/parameters.hpp>
