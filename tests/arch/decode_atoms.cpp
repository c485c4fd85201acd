// Attention-decode micro-kernels against fp64 loops: with small-integer bf16 inputs every score and
// output is exact and must match bitwise (any summation order gives the same sum); with random
// inputs the error is within gamma_D * sum |q||k| (gamma_n = n u / (1 - n u), u = 2^-24). Covers
// R = 1..8 rows, D in {32, 64, 96, 128}, even key counts, the token-order atoms for 1, 4 and 8 kv
// heads, the online-softmax token steps against their scalar definitions, and the f32 forms.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <tessel/arch/decode_atoms.hpp>
#include <tessel/types/bf16.hpp>

using namespace tessel;
namespace dec = tessel::arch::decode;
namespace sm = tessel::arch::softmax;

namespace {
constexpr double u = 1.0 / (1 << 24);
double gamma(std::size_t n) { return double(n) * u / (1 - double(n) * u); }
float f(std::uint16_t b) { return float(bf16::from_bits(b)); }
std::uint32_t fbits(float x) { return std::bit_cast<std::uint32_t>(x); }

std::vector<std::uint16_t> bf16_codes(std::size_t n, std::mt19937& g, bool integers) {
  std::vector<std::uint16_t> v(n);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& x : v) x = bf16(integers ? float(int(g() % 9) - 4) : d(g)).bits();
  return v;
}
}  // namespace

TEST_CASE("qk16_bf16: 16 scores per row, exact for integers, within gamma_D otherwise", "[arch][decode]") {
  std::mt19937 g(101);
  for (bool integers : {true, false})
    for (std::size_t D : {32, 64, 96, 128})
      for (std::size_t R = 1; R <= 8; ++R) {
        const auto q = bf16_codes(R * D, g, integers);
        std::vector<std::vector<std::uint16_t>> k(16);
        std::vector<const std::uint16_t*> krow(16);
        for (std::size_t j = 0; j < 16; ++j) {
          k[j] = bf16_codes(D, g, integers);
          krow[j] = k[j].data();
        }
        const std::size_t ld = 19;
        std::vector<float> out(R * ld, -1.0f);
        dec::qk16_bf16(q.data(), R, D, krow.data(), out.data(), ld);
        std::size_t bad = 0;
        for (std::size_t r = 0; r < R; ++r) {
          for (std::size_t j = 0; j < 16; ++j) {
            double ref = 0, abs = 0;
            for (std::size_t d = 0; d < D; ++d) {
              ref += double(f(q[r * D + d])) * f(k[j][d]);
              abs += std::fabs(double(f(q[r * D + d])) * f(k[j][d]));
            }
            bad += integers ? out[r * ld + j] != float(ref) : std::fabs(out[r * ld + j] - ref) > gamma(D) * abs;
          }
          for (std::size_t j = 16; j < ld; ++j) bad += out[r * ld + j] != -1.0f;  // only 16 written
        }
        INFO("D " << D << " R " << R << " integers " << integers);
        REQUIRE(bad == 0);
      }
}

TEST_CASE("pv_bf16 + from_pv_order: O += P V, exact for integers, within gamma_n otherwise", "[arch][decode]") {
  std::mt19937 g(102);
  for (bool integers : {true, false})
    for (std::size_t D : {32, 64, 96, 128})
      for (std::size_t R = 1; R <= 8; ++R) {
        const std::size_t n = 2 * (1 + g() % 20), ldp = n + 2, ldo = D + 16;
        const auto p = bf16_codes(R * ldp, g, integers);
        std::vector<std::vector<std::uint16_t>> v(n);
        std::vector<const std::uint16_t*> vrow(n);
        for (std::size_t j = 0; j < n; ++j) {
          v[j] = bf16_codes(D, g, integers);
          vrow[j] = v[j].data();
        }
        std::vector<float> o(R * ldo, 0.0f);
        for (std::size_t r = 0; r < R; ++r)
          for (std::size_t d = D; d < ldo; ++d) o[r * ldo + d] = -3.0f;
        dec::pv_bf16(p.data(), ldp, R, vrow.data(), n, D, o.data(), ldo);
        std::size_t bad = 0;
        std::vector<float> nat(D);
        for (std::size_t r = 0; r < R; ++r) {
          dec::from_pv_order(o.data() + r * ldo, nat.data(), D);
          for (std::size_t d = 0; d < D; ++d) {
            double ref = 0, abs = 0;
            for (std::size_t j = 0; j < n; ++j) {
              ref += double(f(p[r * ldp + j])) * f(v[j][d]);
              abs += std::fabs(double(f(p[r * ldp + j])) * f(v[j][d]));
            }
            bad += integers ? nat[d] != float(ref) : std::fabs(nat[d] - ref) > gamma(n) * abs;
          }
          for (std::size_t d = D; d < ldo; ++d) bad += o[r * ldo + d] != -3.0f;
        }
        INFO("D " << D << " R " << R << " n " << n << " integers " << integers);
        REQUIRE(bad == 0);
      }
}

TEST_CASE("token-order atoms: qk_tok4(_seq) and pv_tok<4, 8> equal fp64 for integer inputs", "[arch][decode]") {
  std::mt19937 g(103);
  for (std::size_t nh : {1, 4, 8})
    for (std::size_t D : {32, 64, 128}) {
      const std::size_t head = D + 32;  // kv heads of a token row, D used of each
      std::vector<std::vector<std::uint16_t>> rows(8);
      std::vector<const std::uint16_t*> rp(8);
      for (std::size_t t = 0; t < 8; ++t) {
        rows[t] = bf16_codes(nh * head, g, true);
        rp[t] = rows[t].data();
      }
      const auto q = bf16_codes(nh * 4 * D, g, true);
      const std::size_t ld = nh * 4 + 5;
      auto score = [&](std::size_t t, std::size_t h, std::size_t r) {
        double s = 0;
        for (std::size_t d = 0; d < D; ++d) s += double(f(q[(h * 4 + r) * D + d])) * f(rows[t][h * head + d]);
        return s;
      };
      std::size_t bad = 0;
      std::vector<float> out(4 * ld, -1.0f), out2(4 * ld, -1.0f);
      dec::qk_tok4_bf16(q.data(), nh, D, rp.data(), head, rp.data() + 4, out.data(), ld);
      if (nh % 4 == 0) dec::qk_tok4_seq_bf16(q.data(), nh, D, rp.data(), head, rp.data() + 4, out2.data(), ld);
      for (std::size_t t = 0; t < 4; ++t)
        for (std::size_t h = 0; h < nh; ++h)
          for (std::size_t r = 0; r < 4; ++r) {
            bad += out[t * ld + h * 4 + r] != float(score(t, h, r));
            if (nh % 4 == 0) bad += out2[t * ld + h * 4 + r] != float(score(t, h, r));
          }
      // P.V over 4 and 8 tokens: pp holds bf16 pairs (token 2i low, 2i+1 high) per (h, r)
      for (int N : {4, 8}) {
        const std::size_t ldp = nh * 4 + 3;
        std::vector<std::uint32_t> pp((std::size_t(N) / 2) * ldp);
        std::vector<float> pv(std::size_t(N) * nh * 4);
        for (std::size_t i = 0; i < std::size_t(N) / 2; ++i)
          for (std::size_t c = 0; c < nh * 4; ++c) {
            const std::uint16_t lo = bf16(float(int(g() % 9) - 4)).bits(), hi = bf16(float(int(g() % 9) - 4)).bits();
            pp[i * ldp + c] = lo | (std::uint32_t(hi) << 16);
            pv[(2 * i) * nh * 4 + c] = f(lo);
            pv[(2 * i + 1) * nh * 4 + c] = f(hi);
          }
        std::vector<float> o(nh * 4 * D, 0.0f), nat(D);
        if (N == 4)
          dec::pv_tok_bf16<4>(pp.data(), ldp, nh, D, rp.data(), head, rp.data(), o.data());
        else
          dec::pv_tok_bf16<8>(pp.data(), ldp, nh, D, rp.data(), head, rp.data(), o.data());
        for (std::size_t h = 0; h < nh; ++h)
          for (std::size_t r = 0; r < 4; ++r) {
            dec::from_pv_order(o.data() + (h * 4 + r) * D, nat.data(), D);
            for (std::size_t d = 0; d < D; ++d) {
              double ref = 0;
              for (std::size_t t = 0; t < std::size_t(N); ++t) ref += double(pv[t * nh * 4 + h * 4 + r]) * f(rows[t][h * head + d]);
              bad += nat[d] != float(ref);
            }
          }
      }
      INFO("nh " << nh << " D " << D);
      REQUIRE(bad == 0);
    }
}

TEST_CASE("online_tok_max and online_tok_exp equal their scalar definitions", "[arch][decode]") {
  std::mt19937 g(104);
  std::normal_distribution<float> d(0.0f, 4.0f);
  for (std::size_t n : {1, 5, 16, 17, 40}) {
    const std::size_t ld = (n + 15) / 16 * 16, G = 6;
    std::vector<float> s(G * ld);
    for (auto& x : s) x = d(g);
    const float c = 0.3f;
    std::vector<float> m(n), m0(n), alpha(n), sum(n), sum0(n), tmax(n), sh(n);
    for (std::size_t j = 0; j < n; ++j) {
      m0[j] = m[j] = j % 3 == 0 ? -INFINITY : d(g);
      sum0[j] = sum[j] = j % 3 == 0 ? 0.0f : 2.0f;
    }
    dec::online_tok_max(s.data(), ld, G, n, c, m.data(), alpha.data(), tmax.data(), sh.data());
    std::size_t bad = 0;
    for (std::size_t j = 0; j < n; ++j) {
      float mx = s[j];
      for (std::size_t t = 1; t < G; ++t) mx = std::max(mx, s[t * ld + j]);
      const float tc = mx * c, mn = std::max(m0[j], tc);
      bad += fbits(m[j]) != fbits(mn);
      bad += fbits(tmax[j]) != fbits(mx);
      bad += fbits(sh[j]) != fbits(tc - mn);
      bad += fbits(alpha[j]) != fbits(sm::exp2_nonpos(m0[j] - mn));
    }
    std::vector<std::uint32_t> pp((G / 2) * ld);
    dec::online_tok_exp(s.data(), ld, G, n, c, tmax.data(), sh.data(), pp.data(), sum.data());
    for (std::size_t j = 0; j < n; ++j) {
      float acc = sum0[j];
      for (std::size_t t = 0; t < G; t += 2) {
        const float p0 = sm::exp2_nonpos(std::fma(s[t * ld + j] - tmax[j], c, sh[j]));
        const float p1 = sm::exp2_nonpos(std::fma(s[(t + 1) * ld + j] - tmax[j], c, sh[j]));
        acc = acc + p0 + p1;
        bad += pp[(t / 2) * ld + j] != (std::uint32_t(sm::f32_to_bf16_bits(p0)) | (std::uint32_t(sm::f32_to_bf16_bits(p1)) << 16));
      }
      bad += fbits(sum[j]) != fbits(acc);
    }
    INFO("n " << n);
    REQUIRE(bad == 0);
  }
}

TEST_CASE("f32 forms: qk_f32 and pv_f32 within gamma of fp64", "[arch][decode]") {
  std::mt19937 g(105);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (std::size_t D : {1, 7, 16, 33, 128})
    for (std::size_t R : {1, 3, 8}) {
      const std::size_t n = 1 + g() % 20;
      std::vector<float> q(R * D), p(R * n), o(R * D, 0.5f), out(R * n);
      for (auto& x : q) x = d(g);
      for (std::size_t i = 0; i < p.size(); ++i) p[i] = i % 4 == 3 ? 0.0f : d(g);  // zero weights are skipped
      std::vector<std::vector<float>> k(n, std::vector<float>(D));
      std::vector<const float*> kr(n);
      for (std::size_t j = 0; j < n; ++j) {
        for (auto& x : k[j]) x = d(g);
        kr[j] = k[j].data();
      }
      dec::qk_f32(q.data(), R, D, kr.data(), n, out.data(), n);
      dec::pv_f32(p.data(), n, R, kr.data(), n, D, o.data(), D);
      std::size_t bad = 0;
      for (std::size_t r = 0; r < R; ++r) {
        for (std::size_t j = 0; j < n; ++j) {
          double ref = 0, abs = 0;
          for (std::size_t x = 0; x < D; ++x) {
            ref += double(q[r * D + x]) * k[j][x];
            abs += std::fabs(double(q[r * D + x]) * k[j][x]);
          }
          bad += std::fabs(out[r * n + j] - ref) > gamma(D) * abs;
        }
        for (std::size_t x = 0; x < D; ++x) {
          double ref = 0.5, abs = 0.5;
          for (std::size_t j = 0; j < n; ++j) {
            ref += double(p[r * n + j]) * k[j][x];
            abs += std::fabs(double(p[r * n + j]) * k[j][x]);
          }
          bad += std::fabs(o[r * D + x] - ref) > gamma(n + 1) * abs;
        }
      }
      INFO("D " << D << " R " << R);
      REQUIRE(bad == 0);
    }
}

TEST_CASE("touch_lines2 reads one byte of every line of both ranges", "[arch][decode]") {
  std::vector<unsigned char> a(1000), b(1000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<unsigned char>(i * 7);
    b[i] = static_cast<unsigned char>(i * 13 + 1);
  }
  for (std::size_t bytes : {0, 1, 64, 65, 1000}) {
    unsigned want = 0;
    for (std::size_t o = 0; o < bytes; o += 64) want += unsigned(a[o]) + b[o];
    const unsigned got = dec::touch_lines2(a.data(), b.data(), bytes);
    dec::keep(got);
    REQUIRE(got == want);
  }
}
