// Consumes tessel::onnx from an installed tessel: imports the model given on the command line.
#include <cstdio>

#include <tessel/graph/onnx.hpp>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const tessel::graph::graph g = tessel::graph::import_onnx(argv[1]);
  std::printf("onnx consumer: %zu nodes\n", g.node_count());
  return g.node_count() > 0 ? 0 : 1;
}
