// Umbrella for tessel's graph layer: the typed graph IR (values with dtypes and possibly symbolic
// shapes, ONNX-spelled nodes, verification, a printer, rewiring for passes), shape inference for the
// ONNX operators the reference models use, and the activation memory plan of a graph.
#pragma once

#include <tessel/graph/errors.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/memory.hpp>
#include <tessel/graph/shape_inference.hpp>
