// Umbrella for tessel's graph layer: the typed graph IR (values with dtypes and possibly symbolic
// shapes, ONNX-spelled nodes, verification, a printer, rewiring for passes), shape inference for the
// ONNX operators the reference models use, the activation memory plan of a graph, the passes that
// fold, clean up and fuse a graph (graph::optimize and its fusion report), and the executor that runs
// a graph on a device. The ONNX importer (graph/onnx.hpp) needs the tessel::onnx target.
#pragma once

#include <tessel/graph/errors.hpp>
#include <tessel/graph/executor.hpp>
#include <tessel/graph/fold.hpp>
#include <tessel/graph/fusion.hpp>
#include <tessel/graph/ir.hpp>
#include <tessel/graph/memory.hpp>
#include <tessel/graph/passes.hpp>
#include <tessel/graph/shape_inference.hpp>
