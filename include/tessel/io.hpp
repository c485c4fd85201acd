// Umbrella for tessel's file layer: safetensors (mapped, validated reads; writes; sharded
// checkpoints) and Hugging Face config.json model descriptions. Uses only the number layer.
#pragma once

#include <tessel/io/errors.hpp>
#include <tessel/io/model_config.hpp>
#include <tessel/io/npy.hpp>
#include <tessel/io/safetensors.hpp>
