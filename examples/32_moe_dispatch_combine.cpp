// 32: MoE dispatch and combine (DeepEP semantics) on 4 thread ranks with 16 experts: each rank
// quantizes its tokens to FP8 (one scale per 128 channels), dispatches them to the ranks holding
// their top-2 experts, "runs" the experts, and combines the weighted outputs back in BF16.
#include <cstdio>
#include <mutex>
#include <vector>

#include <tessel/collectives.hpp>

int main() {
  using namespace tessel;
  std::mutex print;
  threads_world::run(4, [&](threads_transport t) {
    communicator comm(std::move(t));
    const int r = comm.rank(), experts = 16;
    const std::size_t tokens = 8, hidden = 256, top_k = 2;
    std::vector<bf16> x(tokens * hidden);
    std::vector<std::int64_t> idx(tokens * top_k);
    std::vector<float> w(tokens * top_k, 0.5f);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf16(static_cast<float>((i + static_cast<std::size_t>(r)) % 17) / 8.0f);
    for (std::size_t tk = 0; tk < tokens; ++tk) {
      idx[tk * 2] = static_cast<std::int64_t>((tk * 5 + static_cast<std::size_t>(r)) % experts);
      idx[tk * 2 + 1] = tk == 3 ? -1 : static_cast<std::int64_t>((tk * 3 + 7) % experts);  // -1: no second expert
    }
    std::vector<e4m3> x8(x.size());
    std::vector<float> scales(x.size() / 128);
    moe_quantize_fp8(x, hidden, x8, scales);
    auto d = moe_dispatch_fp8(comm, x8, scales, hidden, idx, w, top_k, experts);
    // the "experts": dequantize and double
    std::vector<bf16> y(d.x.size());
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = bf16(2.0f * static_cast<float>(d.x[i]) * d.scales[i / 128]);
    auto out = moe_combine(comm, y, d.handle);
    std::lock_guard lk(print);
    std::printf("rank %d: received %zu rows (per local expert:", r, d.handle.rows());
    for (auto c : d.tokens_per_expert()) std::printf(" %zu", c);
    std::printf("), token 0 channel 1: in %g -> out %g\n", static_cast<double>(static_cast<float>(x[1])),
                static_cast<double>(static_cast<float>(out[1])));
  });
}
