// 01: a first tile program. Each block of the grid loads one (R, C) tile of X into a fragment,
// applies y = relu(2x) with `map`, and stores it; edge tiles are zero-filled on load and clipped
// on store, so any shape works. Run: ./01_first_tile_program
#include <cstdio>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/tile.hpp>

using namespace tessel;

struct scale_relu {
  static constexpr std::size_t R = 8, C = 16;
  tensor<const float, 2> X;
  tensor<float, 2> Y;
  void operator()(block_ctx& ctx) const {
    auto [i, j] = ctx.block_index();  // which (R,C) tile
    fragment<float, R, C> t;          // (R,C)
    load(X.tile<R, C>(i, j), t);
    map(t, [](float x) { return 2.0f * x; });
    store(t, Y.tile<R, C>(i, j), epilogue::relu);  // clipped to Y's edge
  }
};

int main() {
  const std::size_t M = 37, N = 50;
  std::vector<float> x(M * N), y(M * N);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 7) - 3);
  host_device dev(2);  // two workers
  dev.launch(grid{ceil_div(M, scale_relu::R), ceil_div(N, scale_relu::C)},
             scale_relu{tensor<const float, 2>(x.data(), M, N), tensor<float, 2>(y.data(), M, N)});
  std::size_t bad = 0;
  for (std::size_t i = 0; i < x.size(); ++i) bad += y[i] != (x[i] > 0 ? 2 * x[i] : 0.0f);
  std::printf("relu(2x) over a %zux%zu matrix on %u workers: %zu wrong\n", M, N, dev.capabilities().workers, bad);
  return bad == 0 ? 0 : 1;
}
