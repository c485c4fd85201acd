// Pooling (tessel/ops/pool.hpp): max/average/global pooling forward against an fp64 reference over
// odd geometries (stride, asymmetric padding, dilation, ceil_mode, count_include_pad both ways) in
// both layouts and both element types, NCHW and NHWC giving the same bits, 1 vs 2 threads vs an
// emulated card bitwise, the backward against fp64 scatter sums and a gradcheck, ties going to the
// first tap, ONNX/PyTorch output extents, and typed errors for bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/ops/pool.hpp>
#include <tessel/verify/gradcheck.hpp>

#include "error_match.hpp"

namespace tessel_test_ops_pool {

using namespace tessel;
using tessel_test::is_error;

namespace {

struct shape {
  image_dims x;
  pool2d_params p;
  std::string name;
};

pool2d_params geo(std::size_t kh, std::size_t kw, std::size_t s, std::size_t pt, std::size_t pl, std::size_t pb, std::size_t pr, std::size_t d,
                  bool ceil_mode, bool include_pad) {
  pool2d_params p;
  p.kernel_h = kh, p.kernel_w = kw;
  p.stride_h = p.stride_w = s;
  p.pad_top = pt, p.pad_left = pl, p.pad_bottom = pb, p.pad_right = pr;
  p.dilation_h = p.dilation_w = d;
  p.ceil_mode = ceil_mode;
  p.count_include_pad = include_pad;
  return p;
}

std::vector<shape> sweep() {
  return {
      {{1, 1, 1, 1}, geo(1, 1, 1, 0, 0, 0, 0, 1, false, false), "1x1 of 1x1"},
      {{2, 3, 7, 7}, geo(2, 2, 2, 0, 0, 0, 0, 1, false, false), "2x2 stride 2 (floor)"},
      {{2, 3, 7, 7}, geo(2, 2, 2, 0, 0, 0, 0, 1, true, false), "2x2 stride 2 ceil_mode"},
      {{1, 5, 9, 11}, geo(3, 3, 2, 1, 1, 1, 1, 1, false, false), "3x3 stride 2 pad 1 (ResNet)"},
      {{1, 5, 9, 11}, geo(3, 3, 2, 1, 1, 1, 1, 1, false, true), "3x3 stride 2 pad 1 count_include_pad"},
      {{2, 4, 10, 9}, geo(3, 2, 2, 1, 0, 2, 1, 1, true, true), "3x2 asymmetric pad ceil_mode include pad"},
      {{2, 4, 10, 9}, geo(3, 2, 2, 1, 0, 2, 1, 1, true, false), "3x2 asymmetric pad ceil_mode exclude pad"},
      {{1, 6, 12, 12}, geo(3, 3, 1, 2, 2, 2, 2, 2, false, false), "3x3 dilation 2 pad 2"},
      {{1, 6, 12, 13}, geo(2, 3, 3, 1, 1, 0, 2, 3, true, true), "dilation 3 stride 3 ceil_mode include pad"},
      {{3, 70, 5, 6}, geo(2, 2, 1, 0, 0, 1, 1, 1, false, false), "70 channels (two channel blocks NHWC)"},
      {{1, 17, 14, 14}, geo(5, 5, 3, 2, 2, 2, 2, 1, true, false), "5x5 stride 3 ceil_mode"},
      // rows long enough for the NCHW interior's vectors (and their tails)
      {{1, 3, 9, 75}, geo(3, 3, 2, 1, 1, 1, 1, 1, false, false), "3x3 stride 2 pad 1, 38-wide rows"},
      {{1, 2, 6, 70}, geo(3, 3, 1, 1, 1, 1, 1, 1, false, true), "3x3 stride 1 pad 1 include pad, 70-wide rows"},
      {{1, 2, 11, 83}, geo(3, 3, 2, 2, 2, 2, 2, 2, true, false), "3x3 stride 2 dilation 2 ceil_mode, 42-wide rows"},
      {{1, 2, 8, 66}, geo(2, 2, 2, 0, 0, 0, 0, 1, false, false), "2x2 stride 2, 33-wide rows (U-Net)"},
      {{1, 2, 7, 100}, geo(2, 4, 3, 0, 1, 1, 0, 1, false, false), "2x4 stride 3, 33-wide rows"},
  };
}

std::size_t at(conv_layout l, const image_dims& d, std::size_t n, std::size_t c, std::size_t y, std::size_t x) {
  return l == conv_layout::nchw ? ((n * d.c + c) * d.h + y) * d.w + x : ((n * d.h + y) * d.w + x) * d.c + c;
}

template <class T>
std::vector<T> random(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  std::vector<T> v(n);
  for (auto& e : v) e = T(d(g));
  return v;
}
template <class T>
double dbl(T v) {
  return double(arch::to_f32(v));
}
double dbl(double v) { return v; }

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
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

// An independent reference, straight from the definitions: the output extent by ONNX's formula
// with PyTorch's "the last window starts inside the input or its leading padding", every tap by
// its signed coordinate.
std::size_t ref_extent(std::size_t in, std::size_t k, std::size_t s, std::size_t pa, std::size_t pb, std::size_t d, bool ceil_mode) {
  const double num = double(in + pa + pb) - double(d * (k - 1) + 1);
  std::size_t out = std::size_t(ceil_mode ? std::ceil(num / double(s)) : std::floor(num / double(s))) + 1;
  if (ceil_mode && long(out - 1) * long(s) >= long(in + pa)) --out;
  return out;
}
image_dims ref_out(const shape& s) {
  const auto& p = s.p;
  return {s.x.n, s.x.c, ref_extent(s.x.h, p.kernel_h, p.stride_h, p.pad_top, p.pad_bottom, p.dilation_h, p.ceil_mode),
          ref_extent(s.x.w, p.kernel_w, p.stride_w, p.pad_left, p.pad_right, p.dilation_w, p.ceil_mode)};
}

struct window_ref {
  std::vector<std::pair<long, long>> taps;  // inside the input, in (r, s) order
  std::size_t padded = 0;                   // taps inside the padded input
};
window_ref ref_window(const shape& s, std::size_t oy, std::size_t ox) {
  const auto& p = s.p;
  window_ref w;
  for (std::size_t r = 0; r < p.kernel_h; ++r)
    for (std::size_t q = 0; q < p.kernel_w; ++q) {
      const long iy = long(oy * p.stride_h + r * p.dilation_h) - long(p.pad_top), ix = long(ox * p.stride_w + q * p.dilation_w) - long(p.pad_left);
      const bool in_pad = iy < long(s.x.h + p.pad_bottom) && ix < long(s.x.w + p.pad_right);
      w.padded += in_pad;
      if (iy >= 0 && ix >= 0 && iy < long(s.x.h) && ix < long(s.x.w)) w.taps.push_back({iy, ix});
    }
  return w;
}

// fp64 forward in the layout of s.p; argmax (flat index into x) for max.
template <class T>
std::vector<double> pool_ref(const shape& s, pool_kind kind, const std::vector<T>& x, std::vector<std::size_t>* arg = nullptr) {
  const auto o = ref_out(s);
  const auto l = s.p.layout;
  std::vector<double> y(o.size());
  if (arg) arg->assign(o.size(), 0);
  for (std::size_t n = 0; n < o.n; ++n)
    for (std::size_t c = 0; c < o.c; ++c)
      for (std::size_t oy = 0; oy < o.h; ++oy)
        for (std::size_t ox = 0; ox < o.w; ++ox) {
          const auto w = ref_window(s, oy, ox);
          double acc = kind == pool_kind::max ? -std::numeric_limits<double>::infinity() : 0.0;
          std::size_t best = 0;
          for (auto [iy, ix] : w.taps) {
            const std::size_t i = at(l, s.x, n, c, std::size_t(iy), std::size_t(ix));
            const double v = dbl(x[i]);
            if (kind == pool_kind::average)
              acc += v;
            else if (v > acc)
              acc = v, best = i;
          }
          if (kind == pool_kind::average) acc /= double(s.p.count_include_pad ? w.padded : w.taps.size());
          const std::size_t i = at(l, o, n, c, oy, ox);
          y[i] = acc;
          if (arg) (*arg)[i] = best;
        }
  return y;
}

// fp64 gradient: dy to every tap / divisor (average) or to the argmax (max).
template <class T>
std::vector<double> pool_grad_ref(const shape& s, pool_kind kind, const std::vector<T>& x, const std::vector<double>& dy) {
  const auto o = ref_out(s);
  std::vector<std::size_t> arg;
  if (kind == pool_kind::max) pool_ref(s, kind, x, &arg);
  std::vector<double> dx(s.x.size(), 0.0);
  for (std::size_t n = 0; n < o.n; ++n)
    for (std::size_t c = 0; c < o.c; ++c)
      for (std::size_t oy = 0; oy < o.h; ++oy)
        for (std::size_t ox = 0; ox < o.w; ++ox) {
          const std::size_t i = at(s.p.layout, o, n, c, oy, ox);
          if (kind == pool_kind::max) {
            dx[arg[i]] += dy[i];
            continue;
          }
          const auto w = ref_window(s, oy, ox);
          const double div = double(s.p.count_include_pad ? w.padded : w.taps.size());
          for (auto [iy, ix] : w.taps) dx[at(s.p.layout, s.x, n, c, std::size_t(iy), std::size_t(ix))] += dy[i] / div;
        }
  return dx;
}

template <class T, class Dev>
std::vector<T> run_pool(Dev& dev, const shape& s, pool_kind kind, const std::vector<T>& x) {
  const auto o = pool2d_output(s.x, s.p);
  std::vector<T> y(o.size(), T(std::nanf("")));
  if (kind == pool_kind::max)
    max_pool2d(dev, image<const T>{x.data(), s.x}, image<T>{y.data(), o}, s.p);
  else
    avg_pool2d(dev, image<const T>{x.data(), s.x}, image<T>{y.data(), o}, s.p);
  return y;
}

template <class T, class TX, class Dev>
std::vector<TX> run_pool_bwd(Dev& dev, const shape& s, pool_kind kind, const std::vector<T>& x, const std::vector<T>& dy) {
  const auto o = pool2d_output(s.x, s.p);
  std::vector<TX> dx(s.x.size(), TX(std::nanf("")));
  if (kind == pool_kind::max)
    max_pool2d_backward(dev, image<const T>{x.data(), s.x}, image<const T>{dy.data(), o}, image<TX>{dx.data(), s.x}, s.p);
  else
    avg_pool2d_backward(dev, image<const T>{dy.data(), o}, image<TX>{dx.data(), s.x}, s.p);
  return dx;
}

// |got − want| ≤ n·u·Σ|terms| + u_out·|want|, with Σ|terms| bounded by taps·max|x| (sums of at most
// `terms` values).
template <class T>
std::size_t over_bound(const std::vector<T>& got, const std::vector<double>& want, double mag, std::size_t terms, double u_out) {
  std::size_t bad = 0;
  const double u = 0x1p-24;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(dbl(got[i]) - want[i]);
    if (!(e <= double(terms + 1) * u * mag * double(terms) + u_out * std::fabs(want[i]))) ++bad;
  }
  return bad;
}

const char* kind_name(pool_kind k) { return k == pool_kind::max ? "max" : "average"; }

template <class T>
void forward_sweep() {
  host_device dev(2);
  const double u_out = std::is_same_v<T, float> ? 0x1p-24 : 0x1p-8;
  for (const auto& base : sweep())
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc})
      for (pool_kind kind : {pool_kind::max, pool_kind::average}) {
        shape s = base;
        s.p.layout = l;
        INFO(s.name << (l == conv_layout::nchw ? " NCHW " : " NHWC ") << kind_name(kind));
        REQUIRE(pool2d_output(s.x, s.p) == ref_out(s));
        const auto x = random<T>(s.x.size(), 1 + unsigned(s.x.c));
        const auto want = pool_ref(s, kind, x);
        const auto y = run_pool(dev, s, kind, x);
        if (kind == pool_kind::max) {  // a max is one of its inputs: exact
          std::size_t bad = 0;
          for (std::size_t i = 0; i < y.size(); ++i) bad += dbl(y[i]) != want[i];
          CHECK(bad == 0);
        } else {
          CHECK(over_bound(y, want, 2.0, s.p.kernel_h * s.p.kernel_w, u_out) == 0);
        }
      }
}

}  // namespace

TEST_CASE("pool2d forward: max exact and average within the summation bound of fp64, over odd geometries, f32", "[ops][pool]") {
  forward_sweep<float>();
}
TEST_CASE("pool2d forward: max exact and average within the summation bound of fp64, over odd geometries, bf16", "[ops][pool]") {
  forward_sweep<bf16>();
}

TEST_CASE("pool2d output extents follow ONNX with PyTorch's ceil_mode rule", "[ops][pool]") {
  // 6 with kernel 2 stride 2 pad 1 ceil: ceil(6/2)+1 = 4; window 3 starts at 3·2 − 1 = 5, inside the input: kept
  CHECK(pool2d_output({1, 1, 6, 6}, geo(2, 2, 2, 1, 1, 1, 1, 1, true, false)).h == 4);
  // 5 with kernel 2 stride 2 pad 1 ceil: ceil(5/2)+1 = 4; window 3 starts at 3·2 − 1 = 5 = the input's end → dropped
  CHECK(pool2d_output({1, 1, 5, 5}, geo(2, 2, 2, 1, 1, 1, 1, 1, true, false)).h == 3);
  CHECK(pool2d_output({1, 1, 5, 5}, geo(2, 2, 2, 1, 1, 1, 1, 1, false, false)).h == 3);
  CHECK(pool2d_output({1, 1, 7, 7}, geo(2, 2, 2, 0, 0, 0, 0, 1, false, false)).h == 3);
  CHECK(pool2d_output({1, 1, 7, 7}, geo(2, 2, 2, 0, 0, 0, 0, 1, true, false)).h == 4);
  CHECK(pool2d_output({1, 1, 112, 112}, geo(3, 3, 2, 1, 1, 1, 1, 1, false, false)).h == 56);  // ResNet's stem pool
}

TEST_CASE("pool2d: NCHW and NHWC give the same bits, and 1 vs 2 threads vs an emulated card bitwise", "[ops][pool]") {
  host_device one(1), two(2);
  executor ex(2);
  emu::card_spec spec;
  spec.memory_bytes = std::size_t{1} << 28;
  emu::card card(0, spec, ex, false, nullptr);
  for (const auto& base : sweep())
    for (pool_kind kind : {pool_kind::max, pool_kind::average}) {
      INFO(base.name << " " << kind_name(kind));
      shape a = base, b = base;
      a.p.layout = conv_layout::nchw;
      b.p.layout = conv_layout::nhwc;
      const auto o = pool2d_output(a.x, a.p);
      const auto x = random<float>(a.x.size(), 5);
      const auto xb = random<bf16>(a.x.size(), 6);
      const auto dy = random<float>(o.size(), 7);
      const auto y1 = run_pool(one, a, kind, x);
      CHECK(same_bits(y1, run_pool(two, a, kind, x)));
      CHECK(same_bits(y1, run_pool(card, a, kind, x)));
      CHECK(same_bits(relayout(y1, o, conv_layout::nchw, conv_layout::nhwc),
                      run_pool(two, b, kind, relayout(x, a.x, conv_layout::nchw, conv_layout::nhwc))));
      const auto yb = run_pool(one, a, kind, xb);
      CHECK(same_bits(yb, run_pool(card, a, kind, xb)));
      CHECK(same_bits(relayout(yb, o, conv_layout::nchw, conv_layout::nhwc),
                      run_pool(two, b, kind, relayout(xb, a.x, conv_layout::nchw, conv_layout::nhwc))));
      const auto g1 = run_pool_bwd<float, float>(one, a, kind, x, dy);
      CHECK(same_bits(g1, run_pool_bwd<float, float>(two, a, kind, x, dy)));
      CHECK(same_bits(g1, run_pool_bwd<float, float>(card, a, kind, x, dy)));
      CHECK(same_bits(relayout(g1, a.x, conv_layout::nchw, conv_layout::nhwc),
                      run_pool_bwd<float, float>(two, b, kind, relayout(x, a.x, conv_layout::nchw, conv_layout::nhwc),
                                                 relayout(dy, o, conv_layout::nchw, conv_layout::nhwc))));
    }
}

TEST_CASE("pool2d backward matches fp64 scatter sums (f32 and bf16 gradients)", "[ops][pool]") {
  host_device dev(2);
  for (const auto& base : sweep())
    for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc})
      for (pool_kind kind : {pool_kind::max, pool_kind::average}) {
        shape s = base;
        s.p.layout = l;
        INFO(s.name << (l == conv_layout::nchw ? " NCHW " : " NHWC ") << kind_name(kind));
        const auto o = pool2d_output(s.x, s.p);
        const auto x = random<float>(s.x.size(), 11), dy = random<float>(o.size(), 12);
        const auto want = pool_grad_ref(s, kind, x, std::vector<double>(dy.begin(), dy.end()));
        // an input gets at most ceil(k/stride) contributions per axis, each |dy| ≤ 2
        const std::size_t terms = s.p.kernel_h * s.p.kernel_w;
        CHECK(over_bound(run_pool_bwd<float, float>(dev, s, kind, x, dy), want, 2.0, terms, 0x1p-24) == 0);
        CHECK(over_bound(run_pool_bwd<float, bf16>(dev, s, kind, x, dy), want, 2.0, terms, 0x1p-8) == 0);
        // bf16 inputs and output gradient
        const auto xb = random<bf16>(s.x.size(), 13), dyb = random<bf16>(o.size(), 14);
        std::vector<double> dyd(dyb.size());
        for (std::size_t i = 0; i < dyb.size(); ++i) dyd[i] = dbl(dyb[i]);
        CHECK(over_bound(run_pool_bwd<bf16, float>(dev, s, kind, xb, dyb), pool_grad_ref(s, kind, xb, dyd), 2.0, terms, 0x1p-24) == 0);
      }
}

TEST_CASE("max_pool2d: ties give the value and the gradient to the first tap in (row, column) order", "[ops][pool]") {
  host_device dev(2);
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    shape s{{1, 2, 4, 4}, geo(2, 2, 2, 0, 0, 0, 0, 1, false, false), "ties"};
    s.p.layout = l;
    std::vector<float> x(s.x.size(), 1.0f);  // every window is one value four times
    std::vector<float> dy(8);
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = float(i + 1);
    const auto dx = run_pool_bwd<float, float>(dev, s, pool_kind::max, x, dy);
    const auto o = pool2d_output(s.x, s.p);
    for (std::size_t c = 0; c < 2; ++c)
      for (std::size_t y = 0; y < 4; ++y)
        for (std::size_t xx = 0; xx < 4; ++xx) {
          const float want = (y % 2 == 0 && xx % 2 == 0) ? dy[at(l, o, 0, c, y / 2, xx / 2)] : 0.0f;
          CHECK(dx[at(l, s.x, 0, c, y, xx)] == want);
        }
  }
  // a NaN in a window is its max
  shape s{{1, 1, 2, 2}, geo(2, 2, 1, 0, 0, 0, 0, 1, false, false), "nan"};
  const std::vector<float> x{1.0f, std::nanf(""), 3.0f, 2.0f};
  CHECK(std::isnan(run_pool(dev, s, pool_kind::max, x)[0]));
}

TEST_CASE("max_pool2d over zeros of both signs, NaNs and ties: the first tap in (row, column) order, bitwise, both layouts", "[ops][pool]") {
  host_device dev(2);
  const float vals[] = {0.0f, -0.0f, 1.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(), 0.5f};
  for (const auto& base : sweep()) {
    INFO(base.name);
    shape s = base;
    s.p.layout = conv_layout::nchw;
    std::mt19937 g(11);
    std::vector<float> x(s.x.size());
    for (auto& v : x) v = vals[g() % 7];
    const auto o = pool2d_output(s.x, s.p);
    std::vector<float> want(o.size());
    for (std::size_t n = 0; n < o.n; ++n)
      for (std::size_t c = 0; c < o.c; ++c)
        for (std::size_t oy = 0; oy < o.h; ++oy)
          for (std::size_t ox = 0; ox < o.w; ++ox) {  // the first NaN, else the first of the largest
            const auto w = ref_window(s, oy, ox);
            float best = 0.0f;
            bool any = false;
            for (auto [iy, ix] : w.taps) {
              const float v = x[at(s.p.layout, s.x, n, c, std::size_t(iy), std::size_t(ix))];
              if (!any || (!std::isnan(best) && (std::isnan(v) || v > best))) best = v, any = true;
            }
            want[at(s.p.layout, o, n, c, oy, ox)] = best;
          }
    const auto y = run_pool(dev, s, pool_kind::max, x);
    CHECK(same_bits(y, want));
    shape t = s;
    t.p.layout = conv_layout::nhwc;
    CHECK(same_bits(relayout(y, o, conv_layout::nchw, conv_layout::nhwc),
                    run_pool(dev, t, pool_kind::max, relayout(x, s.x, conv_layout::nchw, conv_layout::nhwc))));
  }
}

TEST_CASE("global average and max pooling: forward against fp64, backward, layouts equal", "[ops][pool]") {
  host_device dev(2);
  const image_dims xd{3, 70, 7, 5}, yd{3, 70, 1, 1};
  const auto x = random<float>(xd.size(), 21), dy = random<float>(yd.size(), 22);
  for (conv_layout l : {conv_layout::nchw, conv_layout::nhwc}) {
    std::vector<float> ya(yd.size()), ym(yd.size()), ga(xd.size()), gm(xd.size());
    global_avg_pool2d(dev, image<const float>{x.data(), xd}, image<float>{ya.data(), yd}, l);
    global_max_pool2d(dev, image<const float>{x.data(), xd}, image<float>{ym.data(), yd}, l);
    global_avg_pool2d_backward(dev, image<const float>{dy.data(), yd}, image<float>{ga.data(), xd}, l);
    global_max_pool2d_backward(dev, image<const float>{x.data(), xd}, image<const float>{dy.data(), yd}, image<float>{gm.data(), xd}, l);
    for (std::size_t n = 0; n < xd.n; ++n)
      for (std::size_t c = 0; c < xd.c; ++c) {
        double sum = 0, mx = -1e300;
        std::size_t arg = 0;
        for (std::size_t y = 0; y < xd.h; ++y)
          for (std::size_t xx = 0; xx < xd.w; ++xx) {
            const std::size_t i = at(l, xd, n, c, y, xx);
            sum += x[i];
            if (x[i] > mx) mx = x[i], arg = i;
          }
        const std::size_t o = n * xd.c + c;  // (N, C, 1, 1) is the same in both layouts
        CHECK(std::fabs(ya[o] - sum / 35.0) <= 36 * 0x1p-24 * 70.0 + 0x1p-24 * std::fabs(sum / 35.0));
        CHECK(double(ym[o]) == mx);
        for (std::size_t y = 0; y < xd.h; ++y)
          for (std::size_t xx = 0; xx < xd.w; ++xx) {
            const std::size_t i = at(l, xd, n, c, y, xx);
            CHECK(ga[i] == dy[o] / 35.0f);
            CHECK(gm[i] == (i == arg ? dy[o] : 0.0f));
          }
      }
  }
}

TEST_CASE("pool2d backward: gradcheck of average pooling (include and exclude pad) and max pooling against fp64 differences", "[ops][pool]") {
  host_device dev(2);
  for (bool include : {false, true})
    for (pool_kind kind : {pool_kind::average, pool_kind::max}) {
      shape s{{2, 3, 6, 7}, geo(3, 2, 2, 1, 0, 1, 1, 1, true, include), "gradcheck"};
      s.p.layout = include ? conv_layout::nhwc : conv_layout::nchw;
      INFO(kind_name(kind) << " include_pad " << include);
      // distinct values far apart, so that a small step never changes a max window's argmax
      std::vector<double> xd(s.x.size());
      for (std::size_t i = 0; i < xd.size(); ++i) xd[i] = double((i * 37) % xd.size()) * 0.125 - 2.0;
      verify::gradcheck_options go;
      go.mode = verify::grad_mode::full;
      const auto o = pool2d_output(s.x, s.p);
      const auto r = verify::gradcheck(
          "pool2d", [&](std::span<const double> xs) { return pool_ref(s, kind, std::vector<double>(xs.begin(), xs.end())); },
          [&](std::span<const double> xs, std::span<const double> dy) {
            std::vector<float> xf(xs.begin(), xs.end()), dyf(dy.begin(), dy.end());
            const auto gx = run_pool_bwd<float, float>(dev, s, kind, xf, dyf);
            REQUIRE(dyf.size() == o.size());
            return std::vector<double>(gx.begin(), gx.end());
          },
          xd, go);
      INFO(r.to_string());
      CHECK(r.passed());
      CHECK(!r.mistrusted);
    }
}

TEST_CASE("pool2d: bad geometry, shapes and buffers are typed errors", "[ops][pool]") {
  host_device dev(1);
  const image_dims xd{2, 3, 8, 8};
  std::vector<float> x(xd.size()), y(xd.size()), dx(xd.size());
  auto call = [&](const pool2d_params& p, image_dims yd) { max_pool2d(dev, image<const float>{x.data(), xd}, image<float>{y.data(), yd}, p); };
  const auto p = geo(2, 2, 2, 0, 0, 0, 0, 1, false, false);
  CHECK_NOTHROW(call(p, {2, 3, 4, 4}));
  CHECK_THROWS_MATCHES(call(p, {2, 3, 5, 4}), conv_error, is_error(errc::invalid_argument, "conv", "whose pooling gives 2x3x4x4"));
  CHECK_THROWS_MATCHES(call(geo(0, 2, 2, 0, 0, 0, 0, 1, false, false), {2, 3, 4, 4}), conv_error,
                       is_error(errc::invalid_argument, "conv", "empty kernel"));
  CHECK_THROWS_MATCHES(call(geo(2, 2, 0, 0, 0, 0, 0, 1, false, false), {2, 3, 4, 4}), conv_error, is_error(errc::invalid_argument, "conv", "stride"));
  CHECK_THROWS_MATCHES(call(geo(2, 2, 2, 0, 0, 0, 0, 0, false, false), {2, 3, 4, 4}), conv_error,
                       is_error(errc::invalid_argument, "conv", "dilation"));
  CHECK_THROWS_MATCHES(call(geo(5, 5, 1, 0, 0, 0, 0, 2, false, false), {2, 3, 4, 4}), conv_error,
                       is_error(errc::invalid_argument, "conv", "kernel height extent 9"));
  // padding 3 with a 2-tap kernel: the first window's taps (−3, −2) miss the input
  CHECK_THROWS_MATCHES(call(geo(2, 2, 1, 3, 0, 0, 0, 1, false, false), {2, 3, 10, 7}), conv_error,
                       is_error(errc::invalid_argument, "conv", "window 0 along the height has no tap inside the input"));
  CHECK_THROWS_MATCHES(max_pool2d(dev, image<const float>{nullptr, xd}, image<float>{y.data(), {2, 3, 4, 4}}, p), conv_error,
                       is_error(errc::invalid_argument, "conv", "null x"));
  CHECK_THROWS_MATCHES(avg_pool2d_backward(dev, image<const float>{y.data(), {2, 3, 4, 3}}, image<float>{dx.data(), xd}, p), conv_error,
                       is_error(errc::invalid_argument, "conv", "output gradient"));
  CHECK_THROWS_MATCHES(max_pool2d_backward(dev, image<const float>{x.data(), {2, 3, 8, 7}}, image<const float>{y.data(), {2, 3, 4, 4}},
                                           image<float>{dx.data(), xd}, p),
                       conv_error, is_error(errc::invalid_argument, "conv", "and its gradient"));
  CHECK_THROWS_MATCHES(global_avg_pool2d(dev, image<const float>{x.data(), xd}, image<float>{y.data(), {2, 3, 1, 2}}, conv_layout::nhwc), conv_error,
                       is_error(errc::invalid_argument, "conv", "2x3x1x1"));
  CHECK_THROWS_AS(
      max_pool2d(dev, image<const float>{x.data(), {std::size_t{1} << 40, 3, std::size_t{1} << 20, 8}}, image<float>{y.data(), {2, 3, 4, 4}}, p),
      tessel::overflow_error);  // the input's size overflows
}

TEST_CASE("pool2d_cost counts one operation per output tap and the tensors' bytes", "[ops][pool]") {
  const auto c = pool2d_cost<bf16>(pool_kind::max, {2, 3, 8, 8}, geo(3, 3, 2, 1, 1, 1, 1, 1, false, false));
  CHECK(c.flops == 2.0 * 3 * 4 * 4 * 9);
  CHECK(c.bytes == 2.0 * (2 * 3 * 8 * 8 + 2 * 3 * 4 * 4));
}

}  // namespace tessel_test_ops_pool
