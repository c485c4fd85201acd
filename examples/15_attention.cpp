// 15: fused attention. A causal GQA forward pass in bf16 with its log-sum-exp, the backward pass,
// a varlen batch, and decode against a paged KV cache — all without ever forming the S×S matrix.
// Run: ./15_attention
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <tessel/device.hpp>
#include <tessel/ops/attention.hpp>

using namespace tessel;

int main() {
  host_device dev;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  auto randn = [&](std::size_t n) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = bf16(nd(rng));
    return v;
  };

  // 1. Forward: batch 2, 1024 tokens, 8 query heads sharing 2 kv heads (GQA), head dim 128.
  attention_shape s{2, 1024, 1024, 8, 2, 128, attention_layout::bshd};
  auto q = randn(s.batch * s.seq_q * s.heads_q * s.head_dim);
  auto k = randn(s.batch * s.seq_kv * s.heads_kv * s.head_dim);
  auto v = randn(k.size());
  std::vector<bf16> o(q.size());
  std::vector<float> lse(s.batch * s.heads_q * s.seq_q);
  attention_options opt;
  opt.causal = true;
  auto t0 = std::chrono::steady_clock::now();
  attention_forward<host_device, bf16, bf16>(dev, s, q, k, v, o, lse, opt);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double flops = 4.0 * s.seq_q * s.seq_kv * s.head_dim * s.heads_q * s.batch / 2;  // causal: half
  std::printf("forward: o[0] = %g, lse[0] = %g (row 0 sees only key 0: log-sum-exp = its logit), %.1f GFLOP/s\n", float(o[0]), lse[0],
              flops / sec / 1e9);

  // 2. Backward: gradients of sum(o * dout), deterministic whatever the thread count.
  auto dout = randn(q.size());
  std::vector<bf16> dq(q.size()), dk(k.size()), dv(v.size());
  attention_backward<host_device, bf16>(dev, s, q, k, v, o, dout, lse, dq, dk, dv, opt);
  std::printf("backward: dq[0] = %g, dk[0] = %g, dv[0] = %g\n", float(dq[0]), float(dk[0]), float(dv[0]));

  // 3. Varlen: three sequences of 5, 0 and 300 tokens packed back to back.
  const std::vector<std::int32_t> cu{0, 5, 5, 305};
  attention_varlen_shape vs{cu, cu, 4, 4, 64};
  auto vq = randn(305 * 4 * 64), vk = randn(vq.size()), vv = randn(vq.size());
  std::vector<bf16> vo(vq.size());
  attention_forward_varlen<host_device, bf16, bf16>(dev, vs, vq, vk, vv, vo, {}, opt);
  std::printf("varlen: o of the last token, head 0 = %g\n", float(vo[(304 * 4) * 64]));

  // 4. Decode: one new token per sequence against a paged KV cache (pages of 16 tokens).
  attention_decode_shape ds;
  ds.batch = 2;
  ds.seq_q = 1;
  ds.heads_q = 8;
  ds.heads_kv = 2;
  ds.head_dim = 128;
  ds.page_size = 16;
  ds.num_pages = 64;
  ds.pages_per_seq = 32;
  auto kc = randn(ds.num_pages * ds.page_size * ds.heads_kv * ds.head_dim), vc = randn(kc.size());
  std::vector<std::int32_t> table(ds.batch * ds.pages_per_seq);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t((i * 7) % ds.num_pages);  // any page order
  const std::vector<std::int32_t> lens{500, 37};
  auto dq1 = randn(ds.batch * ds.heads_q * ds.head_dim);
  std::vector<bf16> dec(dq1.size());
  attention_decode<host_device, bf16, bf16>(dev, ds, dq1, kc, vc, lens, table, dec, {}, opt);
  std::printf("decode: o[0] = %g\n", float(dec[0]));

  // 5. Bad input is a typed error, never a crash.
  try {
    attention_shape bad = s;
    bad.heads_kv = 3;
    attention_forward<host_device, bf16, bf16>(dev, bad, q, k, v, o);
  } catch (const attention_error& e) { std::printf("error: %s\n", e.what()); }
  return 0;
}
