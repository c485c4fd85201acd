// tessel/ops.hpp: the fused operators (GEMM, attention, optimizers, norms, activations, softmax,
// losses), each a tile program launched on a device.
#pragma once
