// conv2d (tessel/ops/conv.hpp): forward against fp64 with the GEMM bound γ_K·Σ|x·w| + u_out·|y|
// (K = C/groups·KH·KW) over odd geometries in both layouts and both input types, NCHW and NHWC
// giving the same bits, 1 vs 2 threads vs an emulated card bitwise, the fused bias/residual/ReLU
// epilogue against the unfused composition, batch-norm folding, the data/weight/bias gradients
// against fp64 (and a gradcheck), and typed errors for bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/verify/gradcheck.hpp>

#include "error_match.hpp"

namespace tessel_test_ops_conv {

using namespace tessel;
using tessel_test::is_error;

namespace {

struct shape {
  std::size_t n, c, h, w, k, kh, kw;
  conv2d_params p;
  std::string name;
};

conv2d_params geo(std::size_t s, std::size_t pt, std::size_t pl, std::size_t pb, std::size_t pr, std::size_t d, std::size_t groups) {
  conv2d_params p;
  p.stride_h = p.stride_w = s;
  p.pad_top = pt, p.pad_left = pl, p.pad_bottom = pb, p.pad_right = pr;
  p.dilation_h = p.dilation_w = d;
  p.groups = groups;
  return p;
}

std::vector<shape> sweep() {
  return {
      {1, 1, 1, 1, 1, 1, 1, geo(1, 0, 0, 0, 0, 1, 1), "tiny 1x1x1"},
      {1, 3, 7, 7, 4, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "3x3 pad 1"},
      {2, 5, 9, 11, 7, 3, 3, geo(2, 1, 0, 2, 1, 1, 1), "3x3 stride 2 asymmetric pad"},
      {1, 4, 10, 10, 6, 3, 3, geo(1, 2, 2, 2, 2, 2, 1), "3x3 dilation 2"},
      {2, 6, 8, 8, 9, 3, 3, geo(1, 1, 1, 1, 1, 1, 3), "groups 3"},
      {1, 8, 9, 9, 8, 3, 3, geo(1, 1, 1, 1, 1, 1, 8), "depthwise"},
      {2, 13, 5, 6, 17, 1, 1, geo(1, 0, 0, 0, 0, 1, 1), "1x1"},
      {1, 16, 8, 8, 8, 1, 1, geo(2, 0, 0, 0, 0, 1, 1), "1x1 stride 2"},
      {1, 3, 23, 23, 8, 7, 7, geo(2, 3, 3, 3, 3, 1, 1), "7x7 stride 2 stem"},
      {1, 70, 6, 6, 67, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "70->67 channels, K = 630"},
      {1, 520, 4, 4, 9, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "K = 4680 (K pieces)"},
      {3, 8, 30, 30, 16, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "N = 3, M = 2700 (row blocks)"},
      {2, 12, 7, 5, 300, 2, 3, geo(1, 0, 1, 1, 0, 1, 2), "300 outputs (column blocks), 2x3 kernel, groups 2"},
      // small M, wide N: blocks split the columns into narrower strips (ResNet's 7x7 and 14x14 layers)
      {1, 40, 7, 7, 260, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "M = 49, N = 260 (column split)"},
      {1, 33, 9, 9, 130, 3, 3, geo(2, 1, 1, 1, 1, 1, 1), "M = 25, N = 130, K = 297, stride 2 (column split)"},
      {1, 14, 6, 7, 200, 3, 3, geo(1, 2, 2, 2, 2, 2, 2), "M = 42, 100 outputs per group, dilation 2, groups 2 (column split)"},
      {2, 10, 8, 8, 12, 1, 1, geo(1, 0, 0, 0, 0, 1, 2), "1x1 groups 2 (the filter is B as it lies)"},
      // wide rows at stride 1: NCHW moves 16 neighbouring pixels by 16 columns at a time (runs that
      // touch the padding, a K tail that is not a multiple of 16, rows that straddle image rows)
      {2, 20, 13, 40, 24, 3, 3, geo(1, 1, 2, 1, 0, 1, 1), "W = 40, K = 180, asymmetric pad"},
      {1, 9, 11, 37, 5, 3, 3, geo(1, 2, 2, 2, 2, 2, 1), "W = 37, dilation 2"},
      {2, 24, 3, 32, 10, 1, 1, geo(1, 0, 0, 0, 0, 1, 1), "1x1 W = 32"},
      // output channels per group past a multiple of 64 by more than 32 run on the 64-column f32
      // atom, the others on the 32-column one (conv_narrow): both, with padding and row blocks
      {2, 12, 9, 10, 128, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "128 outputs (64-column atom)"},
      {1, 6, 8, 37, 48, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "48 outputs (64-column atom, a part panel)"},
      {1, 7, 12, 34, 32, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "32 outputs (32-column atom, whole panels)"},
      // one-row images of one channel: the last pixels of an image and the first of the next lie
      // side by side in memory, but are not neighbours
      {3, 1, 1, 40, 2, 1, 17, geo(1, 0, 8, 0, 8, 1, 1), "1x17 on 1x40 images, one channel"},
      // f32 NCHW rows of 32+ pixels at stride 1 run with output channels as rows (conv_use_channel_rows):
      // two panels of filter rows, depth chunks, K pieces, groups
      {1, 60, 4, 36, 100, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "W = 36, 100 outputs, K = 540 (two depth chunks)"},
      {1, 460, 2, 33, 6, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "W = 33, K = 4140 (K pieces)"},
      {2, 8, 5, 36, 12, 3, 3, geo(1, 1, 1, 1, 1, 1, 2), "W = 36, groups 2"},
      // and at stride 2 (every other input column: the 7x7 stem), runs into the padding on both sides
      {2, 3, 9, 70, 16, 7, 7, geo(2, 3, 3, 3, 3, 1, 1), "7x7 stride 2, W = 70 (OW = 35)"},
      {1, 5, 6, 67, 40, 3, 3, geo(2, 1, 0, 1, 2, 1, 1), "3x3 stride 2, W = 67, asymmetric pad (OW = 34)"},
      {1, 4, 5, 72, 8, 3, 3, geo(2, 2, 2, 2, 2, 2, 1), "3x3 stride 2, dilation 2, W = 72 (OW = 36)"},
  };
}

std::size_t at(conv_layout l, const image_dims& d, std::size_t n, std::size_t c, std::size_t y, std::size_t x) {
  return l == conv_layout::nchw ? ((n * d.c + c) * d.h + y) * d.w + x : ((n * d.h + y) * d.w + x) * d.c + c;
}

template <class T>
std::vector<T> random(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& e : v) e = T(d(g));
  return v;
}
template <class T>
double dbl(T v) {
  return double(arch::to_f32(v));
}
double dbl(double v) { return v; }

struct geom {
  image_dims x, y;
  filter_dims f;
};
geom dims_of(const shape& s) {
  const auto g = detail::conv_geometry({s.n, s.c, s.h, s.w}, {s.k, s.c / s.p.groups, s.kh, s.kw}, s.p);
  return {g.in(), g.out(), g.fil()};
}

// fp64 forward: y (in the layout of p) and Σ|x·w| per element.
template <class T>
void conv_ref(const shape& s, const std::vector<T>& x, const std::vector<T>& w, const std::vector<float>& bias, std::vector<double>& y,
              std::vector<double>& mag) {
  const auto d = dims_of(s);
  const auto& p = s.p;
  const std::size_t cg = s.c / p.groups, kg = s.k / p.groups;
  y.assign(d.y.size(), 0.0);
  mag.assign(d.y.size(), 0.0);
  for (std::size_t n = 0; n < s.n; ++n)
    for (std::size_t o = 0; o < s.k; ++o)
      for (std::size_t oy = 0; oy < d.y.h; ++oy)
        for (std::size_t ox = 0; ox < d.y.w; ++ox) {
          double acc = bias.empty() ? 0.0 : double(bias[o]), m = 0;
          const std::size_t g = o / kg;
          for (std::size_t c = 0; c < cg; ++c)
            for (std::size_t r = 0; r < s.kh; ++r)
              for (std::size_t q = 0; q < s.kw; ++q) {
                const long iy = long(oy * p.stride_h + r * p.dilation_h) - long(p.pad_top);
                const long ix = long(ox * p.stride_w + q * p.dilation_w) - long(p.pad_left);
                if (iy < 0 || ix < 0 || iy >= long(s.h) || ix >= long(s.w)) continue;
                const double t =
                    dbl(x[at(p.layout, d.x, n, g * cg + c, std::size_t(iy), std::size_t(ix))]) * dbl(w[((o * cg + c) * s.kh + r) * s.kw + q]);
                acc += t;
                m += std::fabs(t);
              }
          const std::size_t i = at(p.layout, d.y, n, o, oy, ox);
          y[i] = acc;
          mag[i] = m;
        }
}

double gamma(std::size_t k) {
  const double u = 0x1p-24;
  return double(k) * u / (1.0 - double(k) * u);
}

// Elements over γ_K·mag + u_out·|want| (+ a bias rounding).
template <class TY>
std::size_t over_bound(const std::vector<TY>& got, const std::vector<double>& want, const std::vector<double>& mag, std::size_t K) {
  const double uo = std::is_same_v<TY, float> ? 0x1p-24 : 0x1p-8;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(dbl(got[i]) - want[i]);
    if (!(e <= gamma(K + 1) * (mag[i] + std::fabs(want[i])) + uo * std::fabs(want[i]) + 1e-30)) ++bad;
  }
  return bad;
}

template <class T, class TY, class Dev, class Chain = epilogue::chain<>>
std::vector<TY> run_conv(Dev& dev, const shape& s, const std::vector<T>& x, const std::vector<T>& w, const std::vector<float>& bias,
                         const Chain& ep = {}) {
  const auto d = dims_of(s);
  std::vector<TY> y(d.y.size(), TY(std::nanf("")));
  conv2d(dev, image<const T>{x.data(), d.x}, filter<const T>{w.data(), d.f}, std::span<const float>(bias), image<TY>{y.data(), d.y}, s.p, ep);
  return y;
}

template <class T>
std::vector<T> relayout(const std::vector<T>& v, const image_dims& d, conv_layout from, conv_layout to) {
  std::vector<T> o(v.size());
  for (std::size_t n = 0; n < d.n; ++n)
    for (std::size_t c = 0; c < d.c; ++c)
      for (std::size_t y = 0; y < d.h; ++y)
        for (std::size_t x = 0; x < d.w; ++x) o[at(to, d, n, c, y, x)] = v[at(from, d, n, c, y, x)];
  return o;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T, class TY>
void forward_sweep() {
  host_device dev(2);
  for (const auto& base : sweep())
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
      shape s = base;
      s.p.layout = l;
      const auto d = dims_of(s);
      const auto x = random<T>(d.x.size(), 1 + unsigned(s.c)), w = random<T>(d.f.size(), 2 + unsigned(s.k));
      const auto bias = random<float>(s.k, 3);
      std::vector<double> want, mag;
      conv_ref(s, x, w, bias, want, mag);
      INFO(s.name << (l == conv_layout::nchw ? " NCHW" : " NHWC"));
      const auto y = run_conv<T, TY>(dev, s, x, w, bias);
      CHECK(over_bound(y, want, mag, s.c / s.p.groups * s.kh * s.kw) == 0);
    }
}

}  // namespace

TEST_CASE("conv2d forward matches fp64 within the GEMM bound over odd geometries, f32", "[ops][conv]") { forward_sweep<float, float>(); }
TEST_CASE("conv2d forward matches fp64 within the GEMM bound over odd geometries, bf16 in, f32 and bf16 out", "[ops][conv]") {
  forward_sweep<bf16, float>();
  forward_sweep<bf16, bf16>();
}

TEST_CASE("conv2d: integer-valued inputs give the exact sum", "[ops][conv]") {
  host_device dev(2);
  shape s{2, 20, 9, 9, 24, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "int"};
  const auto d = dims_of(s);
  std::vector<float> x(d.x.size()), w(d.f.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 7 % 9) - 4);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(int(i * 5 % 7) - 3);
  std::vector<double> want, mag;
  conv_ref(s, x, w, {}, want, mag);
  const auto y = run_conv<float, float>(dev, s, x, w, {});
  std::size_t bad = 0;
  for (std::size_t i = 0; i < y.size(); ++i) bad += double(y[i]) != want[i];
  CHECK(bad == 0);
}

TEST_CASE("conv2d: NCHW and NHWC give the same bits, and 1 vs 2 threads vs an emulated card bitwise", "[ops][conv]") {
  host_device one(1), two(2);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t{1} << 30;
  emu::card card(0, spec, ex, false, nullptr);
  for (const auto& base : sweep()) {
    INFO(base.name);
    shape a = base, b = base;
    a.p.layout = conv_layout::nchw;
    b.p.layout = conv_layout::nhwc;
    const auto d = dims_of(a);
    const auto x = random<float>(d.x.size(), 5), w = random<float>(d.f.size(), 6);
    const auto xb = random<bf16>(d.x.size(), 7), wb = random<bf16>(d.f.size(), 8);
    const auto bias = random<float>(base.k, 9);
    const auto y1 = run_conv<float, float>(one, a, x, w, bias);
    CHECK(same_bits(y1, run_conv<float, float>(two, a, x, w, bias)));
    CHECK(same_bits(y1, run_conv<float, float>(card, a, x, w, bias)));
    const auto yb = run_conv<bf16, bf16>(one, a, xb, wb, bias);
    CHECK(same_bits(yb, run_conv<bf16, bf16>(two, a, xb, wb, bias)));
    CHECK(same_bits(yb, run_conv<bf16, bf16>(card, a, xb, wb, bias)));
    const bool gemm_path = base.kh == 1 && base.kw == 1 && base.p.stride_h == 1 && base.p.groups == 1;  // NHWC 1x1 runs as a GEMM
    const auto y_nhwc = run_conv<float, float>(two, b, relayout(x, d.x, conv_layout::nchw, conv_layout::nhwc), w, bias);
    CHECK(same_bits(run_conv<float, float>(one, b, relayout(x, d.x, conv_layout::nchw, conv_layout::nhwc), w, bias), y_nhwc));
    if (!gemm_path) CHECK(same_bits(relayout(y1, d.y, conv_layout::nchw, conv_layout::nhwc), y_nhwc));
    // bf16 in, f32 out: NCHW rows of 32+ pixels run on channel rows where the bf16 pair-dot atoms
    // do (pairs of depth rows interleaved), NHWC on pixel rows: the same bits either way
    const auto yb32 = run_conv<bf16, float>(two, a, xb, wb, bias);
    CHECK(same_bits(yb32, run_conv<bf16, float>(one, a, xb, wb, bias)));
    CHECK(same_bits(yb32, run_conv<bf16, float>(card, a, xb, wb, bias)));
    if (!gemm_path)
      CHECK(same_bits(relayout(yb32, d.y, conv_layout::nchw, conv_layout::nhwc),
                      run_conv<bf16, float>(two, b, relayout(xb, d.x, conv_layout::nchw, conv_layout::nhwc), wb, bias)));
  }
}

TEST_CASE("conv2d: NCHW rows of 32+ pixels at stride 1 or 2 take the channel-rows orientation, bf16 exactly where the bf16 atoms stage bf16",
          "[ops][conv]") {
  const auto g = detail::conv_geometry({1, 8, 12, 40}, {16, 8, 3, 3}, geo(1, 1, 1, 1, 1, 1, 1));
  CHECK(detail::conv_use_channel_rows<float, float>(g));
  CHECK(detail::conv_use_channel_rows<bf16, float>(g) == std::is_same_v<mma_traits<bf16>::stage_type, bf16>);
  CHECK_FALSE(detail::conv_use_channel_rows<bf16, bf16>(g));  // a bf16 output stores through the pixel rows
  const auto narrow = detail::conv_geometry({1, 8, 12, 31}, {16, 8, 3, 3}, geo(1, 1, 1, 1, 1, 1, 1));
  CHECK_FALSE(detail::conv_use_channel_rows<bf16, float>(narrow));
  CHECK_FALSE(detail::conv_use_channel_rows<float, float>(narrow));
  CHECK(detail::conv_use_channel_rows<float, float>(detail::conv_geometry({1, 3, 224, 224}, {64, 3, 7, 7}, geo(2, 3, 3, 3, 3, 1, 1))));  // the stem
  CHECK_FALSE(detail::conv_use_channel_rows<float, float>(detail::conv_geometry({1, 3, 200, 200}, {8, 3, 3, 3}, geo(3, 1, 1, 1, 1, 1, 1))));
}

namespace {
// The one-pass packer (OIHW straight into the B panel tiles) against GEMM's B load of the
// transposed (K,N) filter matrix, tile by tile: the same bits where the load writes.
template <class T, bool Narrow = false>
bool direct_pack_matches_load(host_device& dev, filter_dims f, std::size_t groups) {
  using S = typename mma_traits<T>::stage_type;
  conv2d_params p;
  p.groups = groups;
  const auto g = detail::conv_geometry({1, f.in * groups, f.kh, f.kw}, f, p);
  const auto w = random<T>(f.size(), 61);
  using D = detail::conv_panel_direct_pack_program<T, S, Narrow>;
  using P = detail::conv_panel_pack_program<S, Narrow>;
  const std::size_t nb = ceil_div(g.kg, D::NB), nk = ceil_div(g.depth(), D::KC), n = groups * nb * nk * D::b_stage::elements;
  std::vector<S> a(n, detail::zero_elem<S>()), b(n, S(std::nanf("")));
  S* km = detail::conv_pack_filter<S>(dev, g, w.data(), false);
  detail::gemm_run(dev, grid{groups, nb, nk}, P{detail::conv_matrix<S>{km, g.depth(), g.kg, true}, a.data(), nb, nk}, 1.0);
  dev.deallocate(km);
  detail::gemm_run(dev, grid{groups, nb, nk}, D{w.data(), b.data(), g.kg, g.cg, g.kh * g.kw, nb, nk}, 1.0);
  return same_bits(a, b);
}
}  // namespace

TEST_CASE("conv2d: the one-pass filter packer writes the tiles GEMM's B load packs from the transposed filter, bit for bit", "[ops][conv]") {
  host_device dev(2);
  for (auto [f, groups] :
       {std::pair<filter_dims, std::size_t>{{7, 5, 3, 3}, 1}, {{300, 6, 2, 3}, 2}, {{9, 520, 3, 3}, 1}, {{16, 1, 3, 3}, 16}, {{512, 512, 3, 3}, 1}}) {
    INFO(f.out << "x" << f.in << "x" << f.kh << "x" << f.kw << " groups " << groups);
    CHECK(direct_pack_matches_load<float>(dev, f, groups));
    CHECK(direct_pack_matches_load<float, true>(dev, f, groups));  // the narrow atom's panels
    CHECK(direct_pack_matches_load<bf16>(dev, f, groups));
  }
}

TEST_CASE("conv2d: the block shape keeps every worker busy on small M and stays inside one B tile", "[ops][conv]") {
  auto check = [](auto tag, auto narrow) {
    using S = decltype(tag);
    constexpr bool Narrow = decltype(narrow)::value;
    using cfg = detail::gemm_config<S, S, false, Narrow>;
    for (std::size_t M : {1, 7, 49, 50, 196, 392, 784, 3136, 25088})
      for (std::size_t N : {1, 64, 130, 256, 512})
        for (std::size_t K : {9, 576, 4608})
          for (unsigned w : {1u, 2u, 3u}) {
            const auto b = detail::conv_block_shape<S, Narrow>(M, N, K, 1, w, true);
            INFO("M " << M << " N " << N << " K " << K << " workers " << w << " -> MB " << b.MB << " NW " << b.NW);
            CHECK(b.MB >= 1);
            CHECK(b.MB <= cfg::MB_max);
            CHECK(b.NW % cfg::NR == 0);
            CHECK(cfg::NB % b.NW == 0);  // a block's columns never straddle two (KC,NB) tiles
            const std::size_t blocks = ceil_div(M, b.MB) * ceil_div(N, b.NW);
            // enough (MR,NR) tiles and work to share: no worker idles (3 workers: at least 2 busy,
            // as 3 uneven blocks may take no fewer rounds than 2 wider ones)
            if (ceil_div(M, cfg::MR) * ceil_div(N, cfg::NR) >= w && double(M) * double(N) * double(K) >= 4e6) CHECK(blocks >= std::min(w, 2u));
            if (w == 1) CHECK(b.NW == cfg::NB);  // one worker: full-width blocks
          }
    // ResNet-50's 256 channels at 14x14 (M = 196, N = 256) on 2 workers: two column halves, not
    // three row blocks of which one worker runs two
    const auto r = detail::conv_block_shape<S, Narrow>(196, 256, 2304, 1, 2, true);
    CHECK(ceil_div(196, r.MB) * ceil_div(256, r.NW) % 2 == 0);
  };
  check(float{}, std::false_type{});
  check(float{}, std::true_type{});
  check(bf16{}, std::false_type{});
}

TEST_CASE("conv2d: f32 groups of 32 or fewer output channels (mod 64) take the 32-column atom, where it exists", "[ops][conv]") {
  using wide = detail::gemm_config<float, float>;
  using thin = detail::gemm_config<float, float, false, true>;
  if constexpr (detail::conv_has_narrow<float>) {
    CHECK(thin::NR * 2 == wide::NR);
    for (std::size_t n : {1, 4, 31, 32, 65, 96, 130, 160}) CHECK(detail::conv_narrow<float>(n));
    for (std::size_t n : {33, 48, 64, 100, 128, 256, 512}) CHECK_FALSE(detail::conv_narrow<float>(n));
  } else {
    CHECK(thin::NR == wide::NR);
    CHECK_FALSE(detail::conv_narrow<float>(32));
  }
  if constexpr (arch::has_pair_atom) CHECK_FALSE(detail::conv_narrow<bf16>(32));  // the bf16 pair atom is 32 columns wide already
}

TEST_CASE("conv2d with a prepacked filter gives the bits of conv2d with the plain filter (both layouts, f32 and bf16, host and card)",
          "[ops][conv]") {
  host_device two(2);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t{1} << 30;
  emu::card card(0, spec, ex, false, nullptr);
  for (const auto& base : sweep())
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
      shape s = base;
      s.p.layout = l;
      INFO(s.name << (l == conv_layout::nchw ? " NCHW" : " NHWC"));
      const bool gemm_path = l == conv_layout::nhwc && s.kh == 1 && s.kw == 1 && s.p.stride_h == 1 && s.p.groups == 1;  // the plain call's GEMM
      const auto d = dims_of(s);
      const auto x = random<float>(d.x.size(), 51), w = random<float>(d.f.size(), 52), bias = random<float>(s.k, 53);
      const auto xb = random<bf16>(d.x.size(), 54), wb = random<bf16>(d.f.size(), 55);
      const conv2d_packed_filter<float, host_device> pw(two, filter<const float>{w.data(), d.f}, s.p.groups);
      const conv2d_packed_filter<bf16, host_device> pwb(two, filter<const bf16>{wb.data(), d.f}, s.p.groups);
      std::vector<float> y(d.y.size()), yb(d.y.size());
      conv2d(two, image<const float>{x.data(), d.x}, pw, std::span<const float>(bias), image<float>{y.data(), d.y}, s.p);
      conv2d(two, image<const bf16>{xb.data(), d.x}, pwb, std::span<const float>(bias), image<float>{yb.data(), d.y}, s.p);
      if (!gemm_path) {
        CHECK(same_bits(y, run_conv<float, float>(two, s, x, w, bias)));
        CHECK(same_bits(yb, run_conv<bf16, float>(two, s, xb, wb, bias)));
      }
      std::vector<double> want, mag;
      conv_ref(s, x, w, bias, want, mag);
      CHECK(over_bound(y, want, mag, s.c / s.p.groups * s.kh * s.kw) == 0);
      const conv2d_packed_filter<float, emu::card> pc(card, filter<const float>{w.data(), d.f}, s.p.groups);
      std::vector<float> yc(d.y.size());
      conv2d(card, image<const float>{x.data(), d.x}, pc, std::span<const float>(bias), image<float>{yc.data(), d.y}, s.p);
      CHECK(same_bits(y, yc));
    }
  host_device dev(1);
  std::vector<float> x(2 * 4 * 8 * 8), w(6 * 4 * 3 * 3), y(2 * 6 * 8 * 8);
  const conv2d_packed_filter<float, host_device> pw(dev, filter<const float>{w.data(), {6, 4, 3, 3}}, 1);
  conv2d_params p = geo(1, 1, 1, 1, 1, 1, 1);
  p.groups = 2;
  CHECK_THROWS_MATCHES(conv2d(dev, image<const float>{x.data(), {2, 4, 8, 8}}, pw, {}, image<float>{y.data(), {2, 6, 8, 8}}, p), conv_error,
                       is_error(errc::invalid_argument, "conv", "packed for 1 groups"));
  CHECK_THROWS_MATCHES((conv2d_packed_filter<float, host_device>(dev, filter<const float>{w.data(), {6, 4, 3, 3}}, 4)), conv_error,
                       is_error(errc::invalid_argument, "conv", "groups 4 must divide the output channels 6"));
}

TEST_CASE("conv2d: the fused bias + residual + ReLU epilogue equals the unfused composition bitwise", "[ops][conv]") {
  host_device dev(2);
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc})
    for (std::size_t kh : {1u, 3u})
      for (std::size_t wd : {12u, 40u}) {  // 40: NCHW (f32, and bf16 in with the pair-dot atoms) runs the chain on channel rows
        shape s{2, 16, 12, wd, 16, kh, kh, geo(1, kh / 2, kh / 2, kh / 2, kh / 2, 1, 1), "residual"};
        s.p.layout = l;
        const auto d = dims_of(s);
        const auto res = random<float>(d.y.size(), 13);
        const auto bias = random<float>(s.k, 14);
        auto check = [&](const auto& x, const auto& w) {
          using T = typename std::decay_t<decltype(x)>::value_type;
          const auto fused = run_conv<T, float>(dev, s, x, w, bias, conv_residual<float>(image<const float>{res.data(), d.y}, l) | epilogue::relu);
          auto plain = run_conv<T, float>(dev, s, x, w, bias);
          for (std::size_t i = 0; i < plain.size(); ++i) plain[i] = std::max(plain[i] + res[i], 0.0f);
          CHECK(same_bits(fused, plain));
          std::size_t zeros = 0;
          for (float v : fused) zeros += v == 0.0f;
          CHECK(zeros > 0);  // the ReLU did something
          CHECK(zeros < fused.size());
        };
        check(random<float>(d.x.size(), 11), random<float>(d.f.size(), 12));
        check(random<bf16>(d.x.size(), 11), random<bf16>(d.f.size(), 12));
      }
}

TEST_CASE("conv2d: folding an inference batch norm into the filter and bias matches BN(conv(x))", "[ops][conv]") {
  host_device dev(2);
  shape s{1, 8, 10, 10, 12, 3, 3, geo(1, 1, 1, 1, 1, 1, 1), "fold"};
  const auto d = dims_of(s);
  const auto x = random<float>(d.x.size(), 21), w = random<float>(d.f.size(), 22), b = random<float>(s.k, 23);
  const auto gamma_ = random<float>(s.k, 24, 0.5f, 1.5f), beta = random<float>(s.k, 25), mean = random<float>(s.k, 26),
             var = random<float>(s.k, 27, 0.1f, 2.0f);
  const float eps = 1e-5f;
  std::vector<double> z, mag;
  conv_ref(s, x, w, b, z, mag);
  auto wf = w;
  std::vector<float> bf(s.k);
  fold_batchnorm(filter<float>{wf.data(), d.f}, b, gamma_, beta, mean, var, eps, bf);
  const auto y = run_conv<float, float>(dev, s, x, wf, bf);
  const std::size_t plane = d.y.h * d.y.w;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const std::size_t c = i / plane % s.k;
    const double sc = double(gamma_[c]) / std::sqrt(double(var[c]) + eps);
    const double want = (z[i] - mean[c]) * sc + beta[c];
    bad += std::fabs(double(y[i]) - want) > 1e-5 * (sc * mag[i] + std::fabs(want) + 1.0);
  }
  CHECK(bad == 0);
  CHECK_THROWS_MATCHES(fold_batchnorm(filter<float>{wf.data(), d.f}, b, std::span<const float>(gamma_).first(3), beta, mean, var, eps, bf),
                       conv_error, is_error(errc::invalid_argument, "conv", "per-channel"));
}

namespace {
// fp64 data and weight gradients of the forward above for an output gradient dy.
template <class T>
void backward_ref(const shape& s, const std::vector<T>& x, const std::vector<T>& w, const std::vector<T>& dy, std::vector<double>& dx,
                  std::vector<double>& dxm, std::vector<double>& dw, std::vector<double>& dwm) {
  const auto d = dims_of(s);
  const auto& p = s.p;
  const std::size_t cg = s.c / p.groups, kg = s.k / p.groups;
  dx.assign(d.x.size(), 0.0), dxm.assign(d.x.size(), 0.0), dw.assign(d.f.size(), 0.0), dwm.assign(d.f.size(), 0.0);
  for (std::size_t n = 0; n < s.n; ++n)
    for (std::size_t o = 0; o < s.k; ++o)
      for (std::size_t oy = 0; oy < d.y.h; ++oy)
        for (std::size_t ox = 0; ox < d.y.w; ++ox) {
          const double g = dbl(dy[at(p.layout, d.y, n, o, oy, ox)]);
          for (std::size_t c = 0; c < cg; ++c)
            for (std::size_t r = 0; r < s.kh; ++r)
              for (std::size_t q = 0; q < s.kw; ++q) {
                const long iy = long(oy * p.stride_h + r * p.dilation_h) - long(p.pad_top);
                const long ix = long(ox * p.stride_w + q * p.dilation_w) - long(p.pad_left);
                if (iy < 0 || ix < 0 || iy >= long(s.h) || ix >= long(s.w)) continue;
                const std::size_t xi = at(p.layout, d.x, n, o / kg * cg + c, std::size_t(iy), std::size_t(ix)),
                                  wi = ((o * cg + c) * s.kh + r) * s.kw + q;
                dx[xi] += g * dbl(w[wi]);
                dxm[xi] += std::fabs(g * dbl(w[wi]));
                dw[wi] += g * dbl(x[xi]);
                dwm[wi] += std::fabs(g * dbl(x[xi]));
              }
        }
}
}  // namespace

TEST_CASE("conv2d backward: data, weight and bias gradients match fp64 within the GEMM bound", "[ops][conv]") {
  host_device dev(2), one(1);
  for (const auto& base : sweep())
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
      shape s = base;
      s.p.layout = l;
      INFO(s.name << (l == conv_layout::nchw ? " NCHW" : " NHWC"));
      const auto d = dims_of(s);
      const auto x = random<float>(d.x.size(), 31), w = random<float>(d.f.size(), 32), dy = random<float>(d.y.size(), 33);
      std::vector<double> dx, dxm, dw, dwm;
      backward_ref(s, x, w, dy, dx, dxm, dw, dwm);
      std::vector<float> gx(d.x.size(), std::nanf("")), gw(d.f.size(), std::nanf("")), gb(s.k, std::nanf(""));
      conv2d_backward_data(dev, image<const float>{dy.data(), d.y}, filter<const float>{w.data(), d.f}, image<float>{gx.data(), d.x}, s.p);
      conv2d_backward_weight(dev, image<const float>{x.data(), d.x}, image<const float>{dy.data(), d.y}, filter<float>{gw.data(), d.f}, s.p);
      conv2d_backward_bias(dev, image<const float>{dy.data(), d.y}, std::span<float>(gb), l);
      CHECK(over_bound(gx, dx, dxm, s.k / s.p.groups * s.kh * s.kw) == 0);
      CHECK(over_bound(gw, dw, dwm, d.y.n * d.y.h * d.y.w) == 0);
      std::vector<double> db(s.k, 0.0), dbm(s.k, 0.0);
      for (std::size_t n = 0; n < d.y.n; ++n)
        for (std::size_t o = 0; o < s.k; ++o)
          for (std::size_t y = 0; y < d.y.h; ++y)
            for (std::size_t xx = 0; xx < d.y.w; ++xx) {
              db[o] += dy[at(l, d.y, n, o, y, xx)];
              dbm[o] += std::fabs(dy[at(l, d.y, n, o, y, xx)]);
            }
      CHECK(over_bound(gb, db, dbm, d.y.n * d.y.h * d.y.w) == 0);
      // thread count never changes the bits
      std::vector<float> gx1(d.x.size()), gw1(d.f.size());
      conv2d_backward_data(one, image<const float>{dy.data(), d.y}, filter<const float>{w.data(), d.f}, image<float>{gx1.data(), d.x}, s.p);
      conv2d_backward_weight(one, image<const float>{x.data(), d.x}, image<const float>{dy.data(), d.y}, filter<float>{gw1.data(), d.f}, s.p);
      CHECK(same_bits(gx, gx1));
      CHECK(same_bits(gw, gw1));
      if (base.name == "3x3 stride 2 asymmetric pad" || base.name == "groups 3") {  // bf16 inputs too
        const auto xb = random<bf16>(d.x.size(), 34), wb = random<bf16>(d.f.size(), 35), dyb = random<bf16>(d.y.size(), 36);
        backward_ref(s, xb, wb, dyb, dx, dxm, dw, dwm);
        conv2d_backward_data(dev, image<const bf16>{dyb.data(), d.y}, filter<const bf16>{wb.data(), d.f}, image<float>{gx.data(), d.x}, s.p);
        conv2d_backward_weight(dev, image<const bf16>{xb.data(), d.x}, image<const bf16>{dyb.data(), d.y}, filter<float>{gw.data(), d.f}, s.p);
        CHECK(over_bound(gx, dx, dxm, s.k / s.p.groups * s.kh * s.kw) == 0);
        CHECK(over_bound(gw, dw, dwm, d.y.n * d.y.h * d.y.w) == 0);
      }
    }
}

TEST_CASE("conv2d backward: gradcheck of the data and weight gradients against fp64 differences of the forward", "[ops][conv]") {
  host_device dev(2);
  shape s{2, 4, 6, 7, 6, 3, 2, geo(2, 1, 0, 1, 1, 2, 2), "gradcheck"};
  s.p.dilation_w = 1;
  const auto d = dims_of(s);
  const auto w = random<float>(d.f.size(), 41);
  const auto x = random<float>(d.x.size(), 42);
  auto fwd = [&](const std::vector<double>& xd, const std::vector<double>& wd) {
    std::vector<double> y, mag;
    std::vector<double> xx(xd), ww(wd);
    conv_ref<double>(s, xx, ww, {}, y, mag);
    return y;
  };
  std::vector<double> wd(w.begin(), w.end()), xd(x.begin(), x.end());
  verify::gradcheck_options go;
  go.mode = verify::grad_mode::full;
  const auto rx = verify::gradcheck(
      "conv2d_backward_data", [&](std::span<const double> xs) { return fwd(std::vector<double>(xs.begin(), xs.end()), wd); },
      [&](std::span<const double> xs, std::span<const double> dy) {
        (void)xs;
        std::vector<float> dyf(dy.begin(), dy.end()), gx(d.x.size());
        conv2d_backward_data(dev, image<const float>{dyf.data(), d.y}, filter<const float>{w.data(), d.f}, image<float>{gx.data(), d.x}, s.p);
        return std::vector<double>(gx.begin(), gx.end());
      },
      xd, go);
  CHECK(rx.passed());
  CHECK(!rx.mistrusted);
  const auto rw = verify::gradcheck(
      "conv2d_backward_weight", [&](std::span<const double> ws) { return fwd(xd, std::vector<double>(ws.begin(), ws.end())); },
      [&](std::span<const double>, std::span<const double> dy) {
        std::vector<float> dyf(dy.begin(), dy.end()), gw(d.f.size());
        conv2d_backward_weight(dev, image<const float>{x.data(), d.x}, image<const float>{dyf.data(), d.y}, filter<float>{gw.data(), d.f}, s.p);
        return std::vector<double>(gw.begin(), gw.end());
      },
      wd, go);
  CHECK(rw.passed());
  CHECK(!rw.mistrusted);
}

TEST_CASE("conv2d: bad geometry, shapes and buffers are typed errors", "[ops][conv]") {
  host_device dev(1);
  std::vector<float> x(2 * 4 * 8 * 8), w(6 * 4 * 3 * 3), y(2 * 6 * 8 * 8), b(6);
  conv2d_params p = geo(1, 1, 1, 1, 1, 1, 1);
  auto call = [&](image_dims xd, filter_dims fd, image_dims yd, const conv2d_params& q, std::span<const float> bias = {}) {
    conv2d(dev, image<const float>{x.data(), xd}, filter<const float>{w.data(), fd}, bias, image<float>{y.data(), yd}, q);
  };
  const image_dims xd{2, 4, 8, 8}, yd{2, 6, 8, 8};
  const filter_dims fd{6, 4, 3, 3};
  CHECK_NOTHROW(call(xd, fd, yd, p));
  CHECK_THROWS_MATCHES(call(xd, {6, 3, 3, 3}, yd, p), conv_error, is_error(errc::invalid_argument, "conv", "needs I = C/groups = 4"));
  CHECK_THROWS_MATCHES(call(xd, {6, 2, 3, 3}, yd, geo(1, 1, 1, 1, 1, 1, 3)), conv_error,
                       is_error(errc::invalid_argument, "conv", "groups 3 must divide"));
  CHECK_THROWS_MATCHES(call(xd, fd, yd, geo(0, 1, 1, 1, 1, 1, 1)), conv_error, is_error(errc::invalid_argument, "conv", "stride"));
  CHECK_THROWS_MATCHES(call(xd, fd, yd, geo(1, 1, 1, 1, 1, 0, 1)), conv_error, is_error(errc::invalid_argument, "conv", "dilation"));
  CHECK_THROWS_MATCHES(call(xd, fd, yd, geo(1, 1, 1, 1, 1, 1, 0)), conv_error, is_error(errc::invalid_argument, "conv", "groups"));
  CHECK_THROWS_MATCHES(call(xd, fd, yd, geo(1, 0, 0, 0, 0, 5, 1)), conv_error, is_error(errc::invalid_argument, "conv", "kernel height extent 11"));
  CHECK_THROWS_MATCHES(call(xd, fd, {2, 6, 6, 6}, p), conv_error, is_error(errc::invalid_argument, "conv", "which give 2x6x8x8"));
  CHECK_THROWS_MATCHES(call(xd, fd, yd, p, std::span<const float>(b).first(5)), conv_error, is_error(errc::invalid_argument, "conv", "bias has 5"));
  CHECK_THROWS_MATCHES(conv2d(dev, image<const float>{nullptr, xd}, filter<const float>{w.data(), fd}, {}, image<float>{y.data(), yd}, p), conv_error,
                       is_error(errc::invalid_argument, "conv", "null x"));
  CHECK_THROWS_AS(call({std::size_t{1} << 40, 4, std::size_t{1} << 20, 8}, fd, yd, p), tessel::error);  // size arithmetic overflows
  CHECK_THROWS_MATCHES(
      conv2d_backward_data(dev, image<const float>{y.data(), {2, 6, 7, 8}}, filter<const float>{w.data(), fd}, image<float>{x.data(), xd}, p),
      conv_error, is_error(errc::invalid_argument, "conv", "output gradient"));
  std::vector<float> db(5);
  CHECK_THROWS_MATCHES(conv2d_backward_bias(dev, image<const float>{y.data(), yd}, std::span<float>(db), conv_layout::nchw), conv_error,
                       is_error(errc::invalid_argument, "conv", "bias gradient has 5"));
}

TEST_CASE("conv2d_cost counts the implicit GEMM's FLOPs and the tensors' bytes", "[ops][conv]") {
  conv2d_params p = geo(2, 1, 1, 1, 1, 1, 2);
  const auto c = conv2d_cost<bf16, float>({3, 8, 10, 10}, {12, 4, 3, 3}, p);
  // output 3x12x5x5, depth 4·3·3 = 36
  CHECK(c.flops == 2.0 * 3 * 5 * 5 * 12 * 36);
  CHECK(c.bytes == 2.0 * (3 * 8 * 10 * 10) + 2.0 * (12 * 4 * 3 * 3) + 4.0 * (3 * 12 * 5 * 5));
  CHECK(c.precision == math_precision::bf16);
}

}  // namespace tessel_test_ops_conv
