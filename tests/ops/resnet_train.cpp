// End to end: a small ResNet trained with tessel's operators on synthetic images, in f32 on the
// host. The model (stem conv3x3 → BN → ReLU; a basic block 8→8; a basic block 8→16 with stride 2
// and a 1x1 conv + BN projection shortcut; global average pool; linear head; cross-entropy) is
// written as one small struct per layer with forward and backward, as a user would write it.
// Checks: (a) the analytic gradient of one forward + backward, for sampled parameters of every
// layer type, against central differences of an independent fp64 re-implementation of the whole
// network; (b) SGD-momentum through the fused optimizer lowers the loss by a stated factor and
// reaches a stated training accuracy; (c) after training, inference (running statistics) predicts
// as training-mode evaluation does, and BN folded into the convolutions (fold_batchnorm, with
// the residual add and ReLU in the conv's epilogue) gives the unfolded inference's logits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/activation.hpp>
#include <tessel/ops/batchnorm.hpp>
#include <tessel/ops/conv.hpp>
#include <tessel/ops/gemm.hpp>
#include <tessel/ops/loss.hpp>
#include <tessel/ops/optim.hpp>
#include <tessel/ops/pool.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_resnet_train {

using namespace tessel;

namespace {

constexpr std::size_t classes = 4, in_ch = 3, side = 8;
constexpr float noise_sigma = 0.6f;

// ---- the model ------------------------------------------------------------------------------

// An NCHW f32 activation (or its gradient).
struct act {
  image_dims d;
  std::vector<float> v;
  void resize(const image_dims& dims) {
    d = dims;
    v.assign(dims.size(), 0.0f);
  }
  image<float> im() { return {v.data(), d}; }
  image<const float> cim() const { return {v.data(), d}; }
  std::span<float> s() { return v; }
  std::span<const float> cs() const { return v; }
};

// A parameter tensor: value, gradient, momentum buffer; `id` is its index in the model's list.
struct param {
  std::vector<float> w, g, m;
  std::size_t id = 0;
};

struct registry {
  std::vector<param*> all;
  void add(param& p, std::size_t n) {
    p.w.assign(n, 0.0f), p.g.assign(n, 0.0f), p.m.assign(n, 0.0f);
    p.id = all.size();
    all.push_back(&p);
  }
};

// conv2d without bias (a BN follows every conv).
struct conv_layer {
  filter_dims fd;
  conv2d_params p;
  param w;
  void init(registry& r, std::size_t cin, std::size_t cout, std::size_t k, std::size_t stride, std::mt19937& rng) {
    fd = {cout, cin, k, k};
    p.stride_h = p.stride_w = stride;
    p.pad_top = p.pad_left = p.pad_bottom = p.pad_right = k / 2;
    r.add(w, fd.size());
    std::normal_distribution<float> nd(0.0f, std::sqrt(2.0f / float(cin * k * k)));  // He
    for (auto& e : w.w) e = nd(rng);
  }
  filter<const float> cw() const { return {w.w.data(), fd}; }
  image_dims out_dims(const image_dims& x) const {
    return {x.n, fd.out, (x.h + 2 * p.pad_top - fd.kh) / p.stride_h + 1, (x.w + 2 * p.pad_left - fd.kw) / p.stride_w + 1};
  }
  void forward(host_device& dev, const act& x, act& y) const {
    y.resize(out_dims(x.d));
    conv2d(dev, x.cim(), cw(), {}, y.im(), p);
  }
  // dW into w.g; dx (if wanted) is overwritten.
  void backward(host_device& dev, const act& x, const act& dy, act* dx) {
    conv2d_backward_weight(dev, x.cim(), dy.cim(), filter<float>{w.g.data(), fd}, p);
    if (!dx) return;
    dx->resize(x.d);
    conv2d_backward_data(dev, dy.cim(), cw(), dx->im(), p);
  }
};

struct bn_layer {
  param gamma, beta;
  std::vector<float> running_mean, running_var, save_mean, save_rstd;
  batchnorm_params p;
  void init(registry& r, std::size_t c) {
    r.add(gamma, c);
    r.add(beta, c);
    std::fill(gamma.w.begin(), gamma.w.end(), 1.0f);
    running_mean.assign(c, 0.0f), running_var.assign(c, 1.0f), save_mean.assign(c, 0.0f), save_rstd.assign(c, 0.0f);
  }
  // train: batch statistics (running statistics updated when `update_running`); else running ones.
  void forward(host_device& dev, const act& x, act& y, bool train, bool update_running = true) {
    y.resize(x.d);
    if (train)
      batchnorm_forward_training(dev, x.cim(), gamma.w, beta.w, y.im(), update_running ? std::span<float>(running_mean) : std::span<float>(),
                                 update_running ? std::span<float>(running_var) : std::span<float>(), save_mean, save_rstd, p);
    else
      batchnorm_forward_inference(dev, x.cim(), gamma.w, beta.w, running_mean, running_var, y.im(), p);
  }
  void backward(host_device& dev, const act& x, const act& dy, act& dx) {
    dx.resize(x.d);
    batchnorm_backward(dev, x.cim(), dy.cim(), gamma.w, save_mean, save_rstd, dx.im(), gamma.g, beta.g, p.layout);
  }
};

// conv → BN, the unit every branch is made of; keeps its activations for the backward.
struct conv_bn {
  conv_layer conv;
  bn_layer bn;
  act a, z;  // conv output, BN output
  void init(registry& r, std::size_t cin, std::size_t cout, std::size_t k, std::size_t stride, std::mt19937& rng) {
    conv.init(r, cin, cout, k, stride, rng);
    bn.init(r, cout);
  }
  const act& forward(host_device& dev, const act& x, bool train, bool update_running) {
    conv.forward(dev, x, a);
    bn.forward(dev, a, z, train, update_running);
    return z;
  }
  // dz → parameter gradients and dx (dz is clobbered).
  void backward(host_device& dev, const act& x, act& dz, act* dx) {
    act da;
    bn.backward(dev, a, dz, da);
    conv.backward(dev, x, da, dx);
  }
};

void relu(host_device& dev, const act& x, act& y) {
  y.resize(x.d);
  relu_forward(dev, x.cs(), y.s());
}
void relu_grad_inplace(host_device& dev, act& g, const act& y) { relu_backward(dev, std::span<const float>(g.v), y.cs(), g.s()); }

// out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), shortcut = x or bn(conv1x1(x)).
struct basic_block {
  conv_bn c1, c2, proj;
  bool has_proj = false;
  act h1, out;
  void init(registry& r, std::size_t cin, std::size_t cout, std::size_t stride, std::mt19937& rng) {
    c1.init(r, cin, cout, 3, stride, rng);
    c2.init(r, cout, cout, 3, 1, rng);
    has_proj = stride != 1 || cin != cout;
    if (has_proj) proj.init(r, cin, cout, 1, stride, rng);
  }
  const act& forward(host_device& dev, const act& x, bool train, bool update_running) {
    relu(dev, c1.forward(dev, x, train, update_running), h1);
    const act& z2 = c2.forward(dev, h1, train, update_running);
    const act& sc = has_proj ? proj.forward(dev, x, train, update_running) : x;
    out.resize(z2.d);
    add_forward(dev, z2.cs(), sc.cs(), out.s());
    relu_forward(dev, std::span<const float>(out.v), out.s());
    return out;
  }
  // dout (clobbered) → parameter gradients and dx.
  void backward(host_device& dev, const act& x, act& dout, act& dx) {
    relu_grad_inplace(dev, dout, out);  // the join's gradient reaches both branches unchanged
    act g = dout, dh1, dsc;
    c2.backward(dev, h1, g, &dh1);
    relu_grad_inplace(dev, dh1, h1);
    c1.backward(dev, x, dh1, &dx);
    if (has_proj) {
      proj.backward(dev, x, dout, &dsc);
      add_forward(dev, dx.cs(), dsc.cs(), dx.s());
    } else {
      add_forward(dev, dx.cs(), dout.cs(), dx.s());
    }
  }
};

// y(N, out) = x(N, in)·W(in, out) + b.
struct linear_layer {
  std::size_t in = 0, out = 0;
  param w, b;
  void init(registry& r, std::size_t i, std::size_t o, std::mt19937& rng) {
    in = i, out = o;
    r.add(w, in * out);
    r.add(b, out);
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(in)));
    for (auto& e : w.w) e = nd(rng);
  }
  void forward(host_device& dev, const std::vector<float>& x, std::size_t n, std::vector<float>& y) const {
    y.assign(n * out, 0.0f);
    gemm(dev, tensor<const float, 2>(x.data(), n, in), tensor<const float, 2>(w.w.data(), in, out), tensor<float, 2>(y.data(), n, out), 1.0f, 0.0f,
         epilogue::bias(b.w));
  }
  void backward(host_device& dev, const std::vector<float>& x, const std::vector<float>& dy, std::size_t n, std::vector<float>& dx) {
    const tensor<const float, 2> X(x.data(), n, in), DY(dy.data(), n, out);
    gemm(dev, X.transposed(), DY, tensor<float, 2>(w.g.data(), in, out));
    const std::vector<float> ones(n, 1.0f);  // db = 1ᵀ·dY, the column sums
    gemm(dev, tensor<const float, 2>(ones.data(), 1, n), DY, tensor<float, 2>(b.g.data(), 1, out));
    dx.assign(n * in, 0.0f);
    gemm(dev, DY, tensor<const float, 2>(w.w.data(), in, out).transposed(), tensor<float, 2>(dx.data(), n, in));
  }
};

struct resnet {
  registry params;
  conv_bn stem;
  basic_block b1, b2;
  linear_layer head;
  act x, h0, pooled;  // input, stem output, pooled (N, C, 1, 1)
  std::vector<float> logits, dlogits;
  explicit resnet(unsigned seed) {
    std::mt19937 rng(seed);
    stem.init(params, in_ch, 8, 3, 1, rng);
    b1.init(params, 8, 8, 1, rng);
    b2.init(params, 8, 16, 2, rng);
    head.init(params, 16, classes, rng);
  }
  std::size_t batch() const { return x.d.n; }
  // Logits of `images` (N, in_ch, side, side); train: BN on batch statistics.
  const std::vector<float>& forward(host_device& dev, std::span<const float> images, std::size_t n, bool train, bool update_running = true) {
    x.resize({n, in_ch, side, side});
    std::copy(images.begin(), images.end(), x.v.begin());
    relu(dev, stem.forward(dev, x, train, update_running), h0);
    const act& y2 = b2.forward(dev, b1.forward(dev, h0, train, update_running), train, update_running);
    pooled.resize({n, y2.d.c, 1, 1});
    global_avg_pool2d(dev, y2.cim(), pooled.im(), conv_layout::nchw);
    head.forward(dev, pooled.v, n, logits);
    return logits;
  }
  // Mean cross-entropy of the last forward, and every parameter's gradient.
  double backward(host_device& dev, std::span<const std::int64_t> labels) {
    const std::size_t n = batch();
    dlogits.assign(n * classes, 0.0f);
    const auto ce = cross_entropy(dev, tensor<const float, 2>(logits.data(), n, classes), labels, tensor<float, 2>(dlogits.data(), n, classes));
    std::vector<float> dpooled;
    head.backward(dev, pooled.v, dlogits, n, dpooled);
    act dy2, dy1, dh0, dx;
    dy2.resize(b2.out.d);
    global_avg_pool2d_backward(dev, image<const float>{dpooled.data(), pooled.d}, dy2.im(), conv_layout::nchw);
    b2.backward(dev, b1.out, dy2, dy1);
    b1.backward(dev, h0, dy1, dh0);
    relu_grad_inplace(dev, dh0, h0);
    stem.backward(dev, x, dh0, nullptr);  // the input needs no gradient
    return ce.loss;
  }
  void sgd(host_device& dev, const sgd_params& h, std::uint64_t step) {
    std::vector<optim_tensor<float, float>> ts(params.all.size());
    for (std::size_t i = 0; i < ts.size(); ++i) ts[i].param = params.all[i]->w, ts[i].grad = params.all[i]->g, ts[i].m = params.all[i]->m;
    const auto r = sgd_step(dev, std::span<const optim_tensor<float, float>>(ts), h, step);
    REQUIRE_FALSE(r.skipped);
  }
};

std::size_t argmax(const float* p, std::size_t n) { return std::size_t(std::max_element(p, p + n) - p); }

// ---- synthetic data -------------------------------------------------------------------------
// Class k is a stripe pattern of one orientation (0: rows, 1: columns, 2: diagonal, 3:
// anti-diagonal) of period 4, with a random phase, amplitude and per-channel gain, plus Gaussian
// noise of σ = 0.6 on every pixel: no single pixel tells the class, an oriented filter does.
struct dataset {
  std::vector<float> images;  // (count, in_ch, side, side)
  std::vector<std::int64_t> labels;
  dataset(std::size_t count, unsigned seed, float sigma = noise_sigma) : images(count * in_ch * side * side), labels(count) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> phase(0.0f, 6.2831853f), amp(0.6f, 1.2f), gain(0.5f, 1.5f);
    std::normal_distribution<float> noise(0.0f, sigma);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t k = i % classes;  // balanced
      labels[i] = std::int64_t(k);
      const float ph = phase(rng), a = amp(rng);
      for (std::size_t c = 0; c < in_ch; ++c) {
        const float gc = gain(rng);
        for (std::size_t y = 0; y < side; ++y)
          for (std::size_t x = 0; x < side; ++x) {
            const float t = k == 0 ? float(y) : k == 1 ? float(x) : k == 2 ? float(x + y) : float(x + side - y);
            images[((i * in_ch + c) * side + y) * side + x] = a * gc * std::sin(1.5707963f * t + ph) + noise(rng);
          }
      }
    }
  }
  std::span<const float> batch_images(std::size_t first, std::size_t n) const {
    return {images.data() + first * in_ch * side * side, n * in_ch * side * side};
  }
  std::span<const std::int64_t> batch_labels(std::size_t first, std::size_t n) const { return {labels.data() + first, n}; }
};

// ---- an independent fp64 forward of the same network ----------------------------------------
// Plain loops over the definitions (no tessel operator), reading parameters from P[param.id] so
// that one parameter can be moved by ±h. `signs` records every ReLU input's sign, so a finite
// difference whose perturbation crosses a ReLU kink can be recognised and not used.
struct ref_net {
  const resnet& net;
  std::vector<std::vector<double>> P;
  std::vector<char> signs;
  explicit ref_net(const resnet& n) : net(n) {
    for (const param* p : n.params.all) P.emplace_back(p->w.begin(), p->w.end());
  }
  using img = std::vector<double>;
  img conv(const img& x, const image_dims& d, const conv_layer& l, image_dims& od) const {
    od = l.out_dims(d);
    const auto& w = P[l.w.id];
    const std::size_t k = l.fd.kh, st = l.p.stride_h, pad = l.p.pad_top;
    img y(od.size(), 0.0);
    for (std::size_t n = 0; n < d.n; ++n)
      for (std::size_t o = 0; o < od.c; ++o)
        for (std::size_t oy = 0; oy < od.h; ++oy)
          for (std::size_t ox = 0; ox < od.w; ++ox) {
            double s = 0;
            for (std::size_t c = 0; c < d.c; ++c)
              for (std::size_t r = 0; r < k; ++r)
                for (std::size_t q = 0; q < k; ++q) {
                  const std::ptrdiff_t iy = std::ptrdiff_t(oy * st + r) - std::ptrdiff_t(pad), ix = std::ptrdiff_t(ox * st + q) - std::ptrdiff_t(pad);
                  if (iy < 0 || ix < 0 || iy >= std::ptrdiff_t(d.h) || ix >= std::ptrdiff_t(d.w)) continue;
                  s += x[((n * d.c + c) * d.h + std::size_t(iy)) * d.w + std::size_t(ix)] * w[((o * d.c + c) * k + r) * k + q];
                }
            y[((n * od.c + o) * od.h + oy) * od.w + ox] = s;
          }
    return y;
  }
  img bn(const img& x, const image_dims& d, const bn_layer& l) const {
    const auto &g = P[l.gamma.id], &b = P[l.beta.id];
    const std::size_t plane = d.h * d.w;
    const double M = double(d.n * plane);
    img y(x.size());
    for (std::size_t c = 0; c < d.c; ++c) {
      double mean = 0, var = 0;
      for (std::size_t n = 0; n < d.n; ++n)
        for (std::size_t q = 0; q < plane; ++q) mean += x[(n * d.c + c) * plane + q];
      mean /= M;
      for (std::size_t n = 0; n < d.n; ++n)
        for (std::size_t q = 0; q < plane; ++q) var += (x[(n * d.c + c) * plane + q] - mean) * (x[(n * d.c + c) * plane + q] - mean);
      const double rstd = 1.0 / std::sqrt(var / M + double(l.p.eps));
      for (std::size_t n = 0; n < d.n; ++n)
        for (std::size_t q = 0; q < plane; ++q) {
          const std::size_t i = (n * d.c + c) * plane + q;
          y[i] = (x[i] - mean) * rstd * g[c] + b[c];
        }
    }
    return y;
  }
  img relu(img x) {
    for (auto& v : x) {
      signs.push_back(v > 0);
      v = v > 0 ? v : 0.0;
    }
    return x;
  }
  img cbn(const img& x, const image_dims& d, const conv_bn& l, image_dims& od) const { return bn(conv(x, d, l.conv, od), od, l.bn); }
  img block(const img& x, const image_dims& d, const basic_block& b, image_dims& od) {
    image_dims d1, d2;
    const img h1 = relu(cbn(x, d, b.c1, d1));
    img y = cbn(h1, d1, b.c2, d2);
    const img sc = b.has_proj ? cbn(x, d, b.proj, od) : x;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += sc[i];
    od = d2;
    return relu(std::move(y));
  }
  // Mean cross-entropy of the network on (images, labels).
  double loss(std::span<const float> images, std::span<const std::int64_t> labels) {
    signs.clear();
    const std::size_t n = labels.size();
    image_dims d{n, in_ch, side, side}, d0, d1, d2;
    const img x(images.begin(), images.end());
    const img y = block(block(relu(cbn(x, d, net.stem, d0)), d0, net.b1, d1), d1, net.b2, d2);
    const std::size_t plane = d2.h * d2.w;
    const auto &W = P[net.head.w.id], &B = P[net.head.b.id];
    double total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      std::vector<double> pooled(d2.c, 0.0), z(classes);
      for (std::size_t c = 0; c < d2.c; ++c) {
        for (std::size_t q = 0; q < plane; ++q) pooled[c] += y[(i * d2.c + c) * plane + q];
        pooled[c] /= double(plane);
      }
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t k = 0; k < classes; ++k) {
        z[k] = B[k];
        for (std::size_t c = 0; c < d2.c; ++c) z[k] += pooled[c] * W[c * classes + k];
        mx = std::max(mx, z[k]);
      }
      double se = 0;
      for (std::size_t k = 0; k < classes; ++k) se += std::exp(z[k] - mx);
      total += mx + std::log(se) - z[std::size_t(labels[i])];
    }
    return total / double(n);
  }
};

// Mean loss, accuracy and logits of `net` over a whole dataset in batches of `bs`.
struct evaluation {
  double loss = 0, accuracy = 0;
  std::vector<float> logits;  // (count, classes)
};
template <class Forward>
evaluation evaluate(host_device& dev, const dataset& data, std::size_t bs, const Forward& forward) {
  evaluation e;
  const std::size_t count = data.labels.size();
  std::vector<float> scratch(bs * classes);
  std::size_t right = 0;
  for (std::size_t first = 0; first < count; first += bs) {
    const std::vector<float>& z = forward(data.batch_images(first, bs), bs);
    const auto ce = cross_entropy(dev, tensor<const float, 2>(z.data(), bs, classes), data.batch_labels(first, bs),
                                  tensor<float, 2>(scratch.data(), bs, classes));
    e.loss += ce.loss * double(bs) / double(count);
    for (std::size_t i = 0; i < bs; ++i) right += argmax(z.data() + i * classes, classes) == std::size_t(data.labels[first + i]);
    e.logits.insert(e.logits.end(), z.begin(), z.end());
  }
  e.accuracy = double(right) / double(count);
  return e;
}

// The inference network with every BN folded into its convolution (fold_batchnorm): stem and
// first convs of the blocks carry ReLU in their epilogue, a block's second conv the residual add
// and the ReLU (conv_residual | relu): one kernel per conv, no BN pass, no separate add.
struct folded_net {
  struct conv {
    filter_dims fd;
    conv2d_params p;
    std::vector<float> w, b;
    image_dims out_dims(const image_dims& x) const {
      return {x.n, fd.out, (x.h + 2 * p.pad_top - fd.kh) / p.stride_h + 1, (x.w + 2 * p.pad_left - fd.kw) / p.stride_w + 1};
    }
    explicit conv(const conv_bn& l) : fd(l.conv.fd), p(l.conv.p), w(l.conv.w.w), b(fd.out) {
      fold_batchnorm(filter<float>{w.data(), fd}, {}, l.bn.gamma.w, l.bn.beta.w, l.bn.running_mean, l.bn.running_var, l.bn.p.eps, b);
    }
    template <class Chain>
    void run(host_device& dev, const act& x, act& y, const Chain& ep) const {
      y.resize(out_dims(x.d));
      conv2d(dev, x.cim(), filter<const float>{w.data(), fd}, b, y.im(), p, ep);
    }
  };
  struct block {
    conv c1, c2;
    std::vector<conv> proj;  // empty: identity shortcut
    explicit block(const basic_block& b) : c1(b.c1), c2(b.c2) {
      if (b.has_proj) proj.emplace_back(b.proj);
    }
    void run(host_device& dev, const act& x, act& out) const {
      act h1, sc;
      c1.run(dev, x, h1, epilogue::relu);
      if (!proj.empty()) proj[0].run(dev, x, sc, epilogue::chain<>{});
      c2.run(dev, h1, out, conv_residual<float>(proj.empty() ? x.cim() : sc.cim(), conv_layout::nchw) | epilogue::relu);
    }
  };
  conv stem;
  block b1, b2;
  const linear_layer& head;
  act x, h0, y1, y2, pooled;
  std::vector<float> logits;
  explicit folded_net(const resnet& n) : stem(n.stem), b1(n.b1), b2(n.b2), head(n.head) {}
  const std::vector<float>& forward(host_device& dev, std::span<const float> images, std::size_t n) {
    x.resize({n, in_ch, side, side});
    std::copy(images.begin(), images.end(), x.v.begin());
    stem.run(dev, x, h0, epilogue::relu);
    b1.run(dev, h0, y1);
    b2.run(dev, y1, y2);
    pooled.resize({n, y2.d.c, 1, 1});
    global_avg_pool2d(dev, y2.cim(), pooled.im(), conv_layout::nchw);
    head.forward(dev, pooled.v, n, logits);
    return logits;
  }
};

struct training_run {
  double loss0 = 0, loss1 = 0, acc0 = 0, acc1 = 0;  // training set, training-mode eval, before/after
  resnet net;
  explicit training_run(unsigned seed) : net(seed) {}
};

constexpr std::size_t train_count = 256, batch = 16, train_steps = 60;

// Trains from `seed` (weights, data and batch order) for `steps` SGD-momentum steps.
void train(host_device& dev, training_run& run, const dataset& data, unsigned seed, std::size_t steps) {
  resnet& net = run.net;
  auto train_eval = [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& { return net.forward(dev, im, n, true, false); };
  const evaluation before = evaluate(dev, data, batch, train_eval);
  run.loss0 = before.loss, run.acc0 = before.accuracy;
  sgd_params h;
  h.momentum = 0.9f;
  h.weight_decay = 1e-4f;
  std::mt19937 rng(seed * 7919u + 1u);
  std::vector<std::size_t> order(train_count / batch);
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (std::size_t step = 1; step <= steps; ++step) {
    if ((step - 1) % order.size() == 0) std::shuffle(order.begin(), order.end(), rng);
    const std::size_t first = order[(step - 1) % order.size()] * batch;
    // 0.05 for the first 70% of the steps, then 0.005: the running statistics settle on the
    // final weights
    h.lr = 10 * step <= 7 * steps ? 0.05f : 0.005f;
    net.forward(dev, data.batch_images(first, batch), batch, true);
    net.backward(dev, data.batch_labels(first, batch));
    net.sgd(dev, h, step);
  }
  const evaluation after = evaluate(dev, data, batch, train_eval);
  run.loss1 = after.loss, run.acc1 = after.accuracy;
}

// γ_K = K·u/(1 − K·u): the worst-case relative error of a K-term sum (DESIGN.md's GEMM bound).
double gamma_k(double k, double u) { return k * u / (1.0 - k * u); }

}  // namespace

// (a) The f32 analytic gradient against fp64 central differences of the fp64 reference.
//
// Error budget for one sampled component i of parameter tensor T (h = 1e-6·max(1, |θ_i|)):
//   |g_f32,i − FD_i| ≤ τ·G_T + t_i + ρ, where
//   - τ = Σ γ_{K_l}(u_f32) over every reduction of the forward and the backward (each conv's
//     C·KH·KW and O·KH·KW and N·OH·OW, the pool's H·W, the linear layer's depths), plus 4·u_f32 for
//     each elementwise pass; it bounds the f32 computation's error relative to the magnitude of
//     the sums it is made of, for which we take G_T = max |g_f32| over T (a normwise bound: a
//     component that cancels to near 0 keeps the error of the sums that produced it);
//   - t_i = |FD_i(2h) − FD_i(h)|/3 is the truncation error of FD(h) (O(h²): FD(2h)'s is 4 times it),
//     measured rather than assumed;
//   - ρ = τ_64·(1 + |L|)/h is the fp64 rounding of L(θ ± h) divided by 2h, with τ_64 the same sum
//     as τ at u_f64.
// A perturbation whose ReLU sign pattern differs from the centre's is a kink, not a derivative:
// that sample is replaced by another index (a few such are expected; at most a quarter may be).
TEST_CASE("resnet: one forward+backward matches fp64 finite differences for every layer type", "[ops][resnet_train]") {
  host_device dev(2);
  resnet net(11);
  // gradients of γ, β and the head bias are degenerate at (1, 0, 0): move them off it
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ug(0.6f, 1.4f), ub(-0.3f, 0.3f);
  for (bn_layer* b : {&net.stem.bn, &net.b1.c1.bn, &net.b1.c2.bn, &net.b2.c1.bn, &net.b2.c2.bn, &net.b2.proj.bn}) {
    for (auto& g : b->gamma.w) g = ug(rng);
    for (auto& v : b->beta.w) v = ub(rng);
  }
  for (auto& v : net.head.b.w) v = ub(rng);
  const std::size_t n = 8;
  const dataset data(n, 3);
  net.forward(dev, data.batch_images(0, n), n, true, false);
  const double loss32 = net.backward(dev, data.batch_labels(0, n));

  // the error budget's depths, walking the layers as the forward and backward do
  const double uf = std::ldexp(1.0, -24), ud = std::ldexp(1.0, -53);
  std::vector<double> depths;
  auto conv_depths = [&](const conv_bn& l, const image_dims& x) {
    const image_dims y = l.conv.out_dims(x);
    depths.push_back(double(l.conv.fd.in * l.conv.fd.kh * l.conv.fd.kw));   // forward
    depths.push_back(double(l.conv.fd.out * l.conv.fd.kh * l.conv.fd.kw));  // data gradient
    depths.push_back(double(y.n * y.h * y.w));                              // weight gradient
    for (int e = 0; e < 5; ++e) depths.push_back(4.0);                      // BN forward/backward, ReLU, adds
    return y;
  };
  image_dims d = conv_depths(net.stem, {n, in_ch, side, side});
  for (const basic_block* b : {&net.b1, &net.b2}) {
    const image_dims d1 = conv_depths(b->c1, d);
    if (b->has_proj) conv_depths(b->proj, d);
    d = conv_depths(b->c2, d1);
  }
  depths.push_back(double(d.h * d.w));    // pool
  depths.push_back(double(net.head.in));  // head forward
  depths.push_back(double(n));            // dW, db
  depths.push_back(double(classes));      // dx
  depths.push_back(16.0);                 // cross-entropy: exp, log-sum-exp, softmax − target
  double tau = 0, tau64 = 0;
  for (double k : depths) tau += gamma_k(k, uf), tau64 += gamma_k(k, ud);

  ref_net ref(net);
  const double loss64 = ref.loss(data.batch_images(0, n), data.batch_labels(0, n));
  const std::vector<char> centre = ref.signs;
  // the f32 forward is the same function: its loss agrees with the fp64 one within the budget
  CHECK(std::fabs(loss32 - loss64) <= tau * (1.0 + loss64));

  const std::size_t per_tensor = 3;
  std::size_t checked = 0, kinks = 0, sensitive = 0;
  double worst = 0;  // largest error / bound
  std::mt19937 pick(9);
  for (const param* p : net.params.all) {
    const double G =
        std::max(1e-30, double(std::fabs(*std::max_element(p->g.begin(), p->g.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }))));
    std::size_t ok = 0, tries = 0;
    while (ok < per_tensor && tries < 4 * per_tensor) {
      ++tries;
      const std::size_t i = std::uniform_int_distribution<std::size_t>(0, p->w.size() - 1)(pick);
      const double th = ref.P[p->id][i], h = 1e-6 * std::max(1.0, std::fabs(th));
      double L[4];  // θ + h, θ − h, θ + 2h, θ − 2h
      const double steps[4] = {h, -h, 2 * h, -2 * h};
      bool kink = false;
      for (int s = 0; s < 4; ++s) {
        ref.P[p->id][i] = th + steps[s];
        L[s] = ref.loss(data.batch_images(0, n), data.batch_labels(0, n));
        kink = kink || ref.signs != centre;
      }
      ref.P[p->id][i] = th;
      if (kink) {
        ++kinks;
        continue;
      }
      const double fd1 = (L[0] - L[1]) / (2 * h), fd2 = (L[2] - L[3]) / (4 * h);
      const double bound = tau * G + std::fabs(fd2 - fd1) / 3.0 + tau64 * (1.0 + std::fabs(loss64)) / h;
      const double err = std::fabs(double(p->g[i]) - fd1);
      INFO("parameter " << p->id << " index " << i << ": analytic " << p->g[i] << ", fp64 FD " << fd1 << ", error " << err << ", bound " << bound);
      CHECK(err <= bound);
      worst = std::max(worst, err / bound);
      // the budget is tight enough to matter: a 1% error in any component of at least a tenth of
      // its tensor's largest would exceed it
      if (std::fabs(fd1) >= 0.1 * G) {
        CHECK(std::fabs(1.01 * double(p->g[i]) - fd1) > bound);
        ++sensitive;
      }
      ++ok, ++checked;
    }
    CHECK(ok == per_tensor);
  }
  WARN("gradcheck: " << checked << " components of " << net.params.all.size() << " tensors, " << kinks << " kinks skipped, worst error/bound "
                     << worst << " (tau " << tau << "), " << sensitive << " where a 1% error would fail");
  CHECK(kinks * 4 <= checked);
  CHECK(sensitive * 2 >= checked);
}

// (b) and (c). Seeds 1-8 were run locally (the hidden test below) to check the margins: the loss
// factor 20 has 4x margin over the worst seed (89), the accuracies 0.95/0.9 hold at half the steps.
TEST_CASE("resnet: SGD-momentum training lowers the loss and reaches the accuracy, inference agrees", "[ops][resnet_train]") {
  host_device dev(2);
  const unsigned seed = 1;
  const dataset data(train_count, seed);
  training_run run(seed);
  train(dev, run, data, seed, train_steps);
  INFO("training set: loss " << run.loss0 << " -> " << run.loss1 << ", accuracy " << run.acc0 << " -> " << run.acc1 << " after " << train_steps
                             << " steps");
  // (b) from ~ln 4 = 1.39 at chance accuracy
  CHECK(run.loss1 * 20.0 <= run.loss0);
  CHECK(run.acc1 >= 0.95);
  // and it generalises: 256 fresh images of the same distribution
  const dataset held_out(train_count, seed + 1000);
  const evaluation test = evaluate(dev, held_out, batch, [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& {
    return run.net.forward(dev, im, n, false);
  });
  INFO("held-out accuracy " << test.accuracy);
  CHECK(test.accuracy >= 0.9);

  // (c) training-mode evaluation (batch statistics) against inference (running statistics)
  resnet& net = run.net;
  const evaluation tr = evaluate(
      dev, data, batch, [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& { return net.forward(dev, im, n, true, false); });
  const evaluation inf = evaluate(
      dev, data, batch, [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& { return net.forward(dev, im, n, false); });
  std::size_t same = 0;
  for (std::size_t i = 0; i < train_count; ++i) same += argmax(&tr.logits[i * classes], classes) == argmax(&inf.logits[i * classes], classes);
  INFO("inference accuracy " << inf.accuracy << ", loss " << inf.loss << "; predictions equal to training mode's: " << same << " of " << train_count);
  CHECK(inf.accuracy >= 0.95);
  CHECK(double(same) >= 0.95 * double(train_count));

  // folded BN (one conv kernel per conv, residual and ReLU in its epilogue) against the unfolded
  // inference: the same function in f32, so the logits agree within the f32 budget of (a) for
  // the inference path: τ = Σ γ_K over its reductions (each conv's C·KH·KW, pool, head), plus
  // 4·u per elementwise pass and u per folded weight, relative to the largest logit.
  folded_net folded(net);
  const evaluation fo =
      evaluate(dev, data, batch, [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& { return folded.forward(dev, im, n); });
  const double uf = std::ldexp(1.0, -24);
  double tau = gamma_k(double(net.head.in), uf) + gamma_k(16.0, uf);
  for (const conv_bn* l : {&net.stem, &net.b1.c1, &net.b1.c2, &net.b2.c1, &net.b2.c2, &net.b2.proj})
    tau += gamma_k(double(l->conv.fd.in * l->conv.fd.kh * l->conv.fd.kw), uf) + 3 * 4 * uf + uf;
  double zmax = 0, dmax = 0;
  for (std::size_t i = 0; i < inf.logits.size(); ++i)
    zmax = std::max(zmax, double(std::fabs(inf.logits[i]))), dmax = std::max(dmax, double(std::fabs(fo.logits[i] - inf.logits[i])));
  INFO("folded vs unfolded inference: max |dz| " << dmax << ", bound " << tau * zmax << " (max |z| " << zmax << ")");
  CHECK(dmax <= tau * zmax);
  CHECK(dmax > 0.0);  // folding really changed the arithmetic (the comparison is not of a run with itself)
  std::size_t same_folded = 0;
  for (std::size_t i = 0; i < train_count; ++i) same_folded += argmax(&fo.logits[i * classes], classes) == argmax(&inf.logits[i * classes], classes);
  CHECK(fo.accuracy >= 0.9);
  CHECK(same_folded + 2 >= train_count);  // only a near-tie may flip
}

// The margin check behind the chosen steps and thresholds: `test_ops "[.resnet_seeds]"`. Seeds 1-8
// at 60 steps (measured): loss factor 89-159, training accuracy 1.0, inference 0.996-1.0, held out
// 0.984-1.0; at 30 steps the worst seed had factor 2.5 and training accuracy 0.953.
TEST_CASE("resnet: training margins over seeds 1-8", "[.resnet_seeds]") {
  host_device dev(2);
  for (std::size_t steps : {train_steps / 2, train_steps}) {
    for (unsigned seed = 1; seed <= 8; ++seed) {
      const dataset data(train_count, seed), held_out(train_count, seed + 1000);
      training_run run(seed);
      train(dev, run, data, seed, steps);
      resnet& net = run.net;
      auto infer = [&](std::span<const float> im, std::size_t n) -> const std::vector<float>& { return net.forward(dev, im, n, false); };
      const evaluation inf = evaluate(dev, data, batch, infer), test = evaluate(dev, held_out, batch, infer);
      WARN("steps " << steps << " seed " << seed << ": loss " << run.loss0 << " -> " << run.loss1 << " (factor " << run.loss0 / run.loss1
                    << "), accuracy " << run.acc0 << " -> " << run.acc1 << ", inference " << inf.accuracy << ", held out " << test.accuracy);
    }
  }
}

}  // namespace tessel_test_ops_resnet_train
