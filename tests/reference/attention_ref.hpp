// Reference attention for tests: a materialised fp64 implementation (the accuracy yardstick),
// a naive materialised implementation in the operator's own dtype (the FlashAttention rule
// compares errors against it), and helpers to index bshd/bhsd tensors. Independent of the
// library's mask code on purpose.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <vector>

namespace tessel::test::attn {

struct problem {
  std::size_t B = 1, Sq = 1, Skv = 1, H = 1, HK = 1, D = 16;
  bool bshd = true;
  bool causal = false, bottom_right = false;
  long wl = -1, wr = -1;
  double scale = 0;  // 0: 1/sqrt(D)
  double sc() const { return scale == 0 ? 1.0 / std::sqrt(double(D)) : scale; }
  std::size_t q_index(std::size_t b, std::size_t i, std::size_t h, std::size_t d) const {
    return bshd ? ((b * Sq + i) * H + h) * D + d : ((b * H + h) * Sq + i) * D + d;
  }
  std::size_t kv_index(std::size_t b, std::size_t j, std::size_t h, std::size_t d) const {
    return bshd ? ((b * Skv + j) * HK + h) * D + d : ((b * HK + h) * Skv + j) * D + d;
  }
  std::size_t q_elems() const { return B * Sq * H * D; }
  std::size_t kv_elems() const { return B * Skv * HK * D; }
  bool visible(std::size_t i, std::size_t j) const {
    const long off = bottom_right ? long(Skv) - long(Sq) : 0;
    const long diag = long(i) + off, jj = long(j);
    if (causal && jj > diag) return false;
    if (wr >= 0 && jj > diag + wr) return false;
    if (wl >= 0 && jj < diag - wl) return false;
    return true;
  }
};

// Materialised attention with a rounding hook: R(x) rounds a value to the storage dtype of the
// implementation being modelled (identity for fp64/f32 intermediates kept wide). Acc is the
// accumulation type (double for the reference, float for the naive same-dtype implementation).
template <class Acc>
struct materialised {
  std::function<Acc(Acc)> round_p = [](Acc x) { return x; };    // P (and dS, dP) storage
  std::function<Acc(Acc)> round_out = [](Acc x) { return x; };  // outputs

  void forward(const problem& p, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v, std::vector<double>& o,
               std::vector<double>& lse) const {
    o.assign(p.q_elems(), 0.0);
    lse.assign(p.B * p.H * p.Sq, -std::numeric_limits<double>::infinity());
    std::vector<Acc> s(p.Skv);
    const std::size_t g = p.H / p.HK;
    for (std::size_t b = 0; b < p.B; ++b)
      for (std::size_t h = 0; h < p.H; ++h)
        for (std::size_t i = 0; i < p.Sq; ++i) {
          Acc mx = -std::numeric_limits<Acc>::infinity();
          for (std::size_t j = 0; j < p.Skv; ++j) {
            if (!p.visible(i, j)) {
              s[j] = -std::numeric_limits<Acc>::infinity();
              continue;
            }
            Acc d = 0;
            for (std::size_t e = 0; e < p.D; ++e) d += Acc(q[p.q_index(b, i, h, e)]) * Acc(k[p.kv_index(b, j, h / g, e)]);
            s[j] = d * Acc(p.sc());
            mx = std::max(mx, s[j]);
          }
          if (mx == -std::numeric_limits<Acc>::infinity()) continue;  // fully masked: zeros, -inf
          Acc l = 0;
          for (std::size_t j = 0; j < p.Skv; ++j) {
            s[j] = p.visible(i, j) ? std::exp(s[j] - mx) : Acc(0);
            l += s[j];
          }
          for (std::size_t j = 0; j < p.Skv; ++j) s[j] = round_p(s[j] / l);
          lse[(b * p.H + h) * p.Sq + i] = double(mx) + std::log(double(l));
          for (std::size_t e = 0; e < p.D; ++e) {
            Acc a = 0;
            for (std::size_t j = 0; j < p.Skv; ++j) a += s[j] * Acc(v[p.kv_index(b, j, h / g, e)]);
            o[p.q_index(b, i, h, e)] = double(round_out(a));
          }
        }
  }

  // Gradients of sum(O ∘ dO).
  void backward(const problem& p, const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                const std::vector<double>& dout, std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) const {
    std::vector<Acc> dqa(p.q_elems(), 0);
    std::vector<Acc> dka(p.kv_elems(), 0), dva(p.kv_elems(), 0);
    const std::size_t g = p.H / p.HK;
    std::vector<Acc> P(p.Skv), dP(p.Skv);
    for (std::size_t b = 0; b < p.B; ++b)
      for (std::size_t h = 0; h < p.H; ++h)
        for (std::size_t i = 0; i < p.Sq; ++i) {
          const std::size_t hk = h / g;
          Acc mx = -std::numeric_limits<Acc>::infinity();
          for (std::size_t j = 0; j < p.Skv; ++j) {
            if (!p.visible(i, j)) {
              P[j] = -std::numeric_limits<Acc>::infinity();
              continue;
            }
            Acc d = 0;
            for (std::size_t e = 0; e < p.D; ++e) d += Acc(q[p.q_index(b, i, h, e)]) * Acc(k[p.kv_index(b, j, hk, e)]);
            P[j] = d * Acc(p.sc());
            mx = std::max(mx, P[j]);
          }
          if (mx == -std::numeric_limits<Acc>::infinity()) continue;
          Acc l = 0;
          for (std::size_t j = 0; j < p.Skv; ++j) {
            P[j] = p.visible(i, j) ? std::exp(P[j] - mx) : Acc(0);
            l += P[j];
          }
          for (std::size_t j = 0; j < p.Skv; ++j) P[j] = round_p(P[j] / l);
          // O row (in Acc) and delta = dO·O
          Acc delta = 0;
          for (std::size_t e = 0; e < p.D; ++e) {
            Acc a = 0;
            for (std::size_t j = 0; j < p.Skv; ++j) a += P[j] * Acc(v[p.kv_index(b, j, hk, e)]);
            delta += Acc(dout[p.q_index(b, i, h, e)]) * round_out(a);
          }
          for (std::size_t j = 0; j < p.Skv; ++j) {
            Acc d = 0;
            for (std::size_t e = 0; e < p.D; ++e) d += Acc(dout[p.q_index(b, i, h, e)]) * Acc(v[p.kv_index(b, j, hk, e)]);
            dP[j] = round_p(d);
          }
          for (std::size_t j = 0; j < p.Skv; ++j) {
            if (P[j] == 0) continue;
            const Acc ds = round_p(P[j] * (dP[j] - delta));
            for (std::size_t e = 0; e < p.D; ++e) {
              dva[p.kv_index(b, j, hk, e)] += P[j] * Acc(dout[p.q_index(b, i, h, e)]);
              dka[p.kv_index(b, j, hk, e)] += ds * Acc(q[p.q_index(b, i, h, e)]) * Acc(p.sc());
              dqa[p.q_index(b, i, h, e)] += ds * Acc(k[p.kv_index(b, j, hk, e)]) * Acc(p.sc());
            }
          }
        }
    dq.resize(p.q_elems());
    for (std::size_t i = 0; i < dqa.size(); ++i) dq[i] = double(round_out(dqa[i]));
    dk.resize(p.kv_elems());
    dv.resize(p.kv_elems());
    for (std::size_t i = 0; i < dka.size(); ++i) {
      dk[i] = double(round_out(dka[i]));
      dv[i] = double(round_out(dva[i]));
    }
  }
};

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && a[i] == b[i]) continue;
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

}  // namespace tessel::test::attn
