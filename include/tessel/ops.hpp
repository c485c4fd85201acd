// tessel/ops.hpp: the fused operators (GEMM, attention, optimizers, norms, activations, softmax,
// losses, rotary embeddings), each a tile program launched on a device.
#pragma once

#include <tessel/ops/activation.hpp>
#include <tessel/ops/attention.hpp>
#include <tessel/ops/embedding.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/gemm_autotune.hpp>
#include <tessel/ops/gemm_grouped.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/norm.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/ops/quant.hpp>
#include <tessel/ops/rope.hpp>
#include <tessel/ops/softmax.hpp>
