// graph/executor.hpp: every op kind against the fp64 reference interpreter of exec_reference.hpp
// (small shapes, broadcasting and edge cases), the fused ops of domain "tessel" against their ONNX
// equivalents, the MLP and the transformer block of graph_models.hpp end to end within a bound
// derived from K and the dtype, planned vs unplanned vs poisoned arenas, host vs emulated card, 1 vs
// 2 threads (bitwise), bf16 compute within its bound, and bad inputs as typed graph_errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/emulator/card.hpp>
#include <tessel/graph.hpp>
#include "error_match.hpp"
#include "graph/exec_reference.hpp"
#include "graph/graph_models.hpp"

namespace tessel_test_graph_executor {

using tessel::dtype;
using tessel::errc;
using tessel::host_device;
using tessel_test::is_error;
using namespace tessel_test_graph;
using tg::graph_error;

constexpr double u32 = 0x1p-24;  // f32 unit roundoff
constexpr double u16 = 0x1p-8;   // bf16 unit roundoff

// "x3": built with append (GCC 12 -O3 reports a false -Wrestrict for "x" + std::to_string(i)).
std::string nm(const char* prefix, std::size_t i) {
  std::string s(prefix);
  s.append(std::to_string(i));
  return s;
}

double gamma(std::size_t k, double u) { return double(k) * u / (1 - double(k) * u); }

// |got - want| <= abs + rel * |want| elementwise (NaN matches NaN); shape and dtype equal.
void check_close(const tg::host_tensor& got, const rt& want, double rel, double abs, const std::string& what) {
  INFO(what);
  REQUIRE(got.type == want.t);
  std::vector<std::size_t> gs;
  for (auto d : got.shape) gs.push_back(static_cast<std::size_t>(d));
  REQUIRE(gs == want.s);
  const rt g = from_host(got);
  std::size_t bad = 0;
  std::string first;
  for (std::size_t i = 0; i < g.v.size(); ++i) {
    const double a = g.v[i], b = want.v[i];
    if (std::isnan(a) && std::isnan(b)) continue;
    const bool ok = a == b || std::fabs(a - b) <= abs + rel * std::fabs(b);
    if (!ok && bad++ == 0) first = nm("element ", i).append(": got ").append(std::to_string(a)).append(", want ").append(std::to_string(b));
  }
  INFO(first);
  CHECK(bad == 0);
}

// Runs `g` on a 2-thread host_device and the fp64 reference on the bound graph; checks every graph
// output within rel/abs.
tg::tensor_map run_and_check(const tg::graph& g, const std::map<std::string, rt>& inputs, double rel, double abs, tg::compile_options opt = {}) {
  host_device dev(2);
  auto exe = tg::compile(g, dev, opt);
  tg::tensor_map in;
  for (const auto& [k, v] : inputs) in.emplace(k, to_host(v));
  tg::tensor_map out = exe.run(in);
  const auto ref = reference(exe.bound_graph(), inputs);
  for (tg::value_id v : g.outputs()) {
    const std::string& name = g.get(v).name;
    check_close(out.at(name), ref.at(name), rel, abs, g.name() + ": " + name);
  }
  return out;
}

rt rand_rt(std::vector<std::size_t> s, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) { return to_rt(s, randu(count(s), seed, lo, hi)); }

std::vector<std::int64_t> i64s(const std::vector<std::size_t>& s) { return {s.begin(), s.end()}; }

// One node over f32 inputs x0, x1, ... of the given shapes; output y (more outputs: y1, y2, ...).
tg::graph one_node(const std::string& op, const std::vector<std::vector<std::size_t>>& shapes, tg::attribute_map attrs = {}, std::size_t outputs = 1,
                   const std::string& domain = {}, std::vector<dtype> types = {}) {
  tg::graph g(op);
  std::vector<std::string> ins, outs;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    tg::tensor_shape s;
    for (auto d : shapes[i]) s.dims.emplace_back(d);
    g.add_input(nm("x", i), i < types.size() ? types[i] : dtype::f32, s);
    ins.push_back(nm("x", i));
  }
  for (std::size_t o = 0; o < outputs; ++o) outs.push_back(o ? nm("y", o) : std::string("y"));
  g.add_node(op, "n", ins, outs, std::move(attrs), domain);
  for (auto& o : outs) g.mark_output(o);
  return g;
}

std::map<std::string, rt> rand_inputs(const std::vector<std::vector<std::size_t>>& shapes, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::map<std::string, rt> m;
  for (std::size_t i = 0; i < shapes.size(); ++i) m[nm("x", i)] = rand_rt(shapes[i], seed + static_cast<std::uint32_t>(i), lo, hi);
  return m;
}

// ---- elementwise ---------------------------------------------------------------------------------------

TEST_CASE("unary ops match fp64 within a few ulps", "[graph][executor]") {
  const std::vector<std::size_t> s{3, 37};
  for (const char* op :
       {"Abs", "Neg", "Relu", "Ceil", "Floor", "Sqrt", "Exp", "Log", "Sin", "Cos", "Tanh", "Erf", "Reciprocal", "Sigmoid", "Identity"}) {
    auto in = rand_inputs({s}, 11, -3.0f, 3.0f);
    in["x0"].v[0] = 0.0;  // edges: zero, and negative values where Sqrt/Log give NaN
    in["x0"].v[1] = -0.0;
    for (double& v : in["x0"].v) v = static_cast<float>(v);
    // std:: math functions in float are within 2 ulps; the comparison allows 4 and 1e-7 near 0
    run_and_check(one_node(op, {s}), in, 4 * 0x1p-23, 1e-7);
  }
  // Gelu (tessel's activation operator, both forms) and Dropout (inference: identity, mask all ones)
  for (const char* a : {"none", "tanh"})
    run_and_check(one_node("Gelu", {s}, {{"approximate", std::string(a)}}), rand_inputs({s}, 3, -4, 4), 1e-5, 1e-6);
  run_and_check(one_node("Dropout", {s}, {}, 2), rand_inputs({s}, 4), 0, 0);
}

TEST_CASE("binary and variadic ops broadcast like numpy", "[graph][executor]") {
  const std::vector<std::pair<std::vector<std::size_t>, std::vector<std::size_t>>> cases = {
      {{2, 3, 4}, {4}}, {{2, 1, 4}, {3, 1}}, {{1}, {2, 3}}, {{}, {2, 2}}, {{0, 3}, {3}}, {{5, 1, 1}, {1, 6, 7}}, {{4, 5}, {4, 5}}};
  for (const auto& [a, b] : cases)
    for (const char* op : {"Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater"}) {
      auto in = rand_inputs({a, b}, 21, 0.5f, 2.0f);
      if (!in["x0"].v.empty() && !in["x1"].v.empty()) in["x0"].v[0] = in["x1"].v[0];  // an equal pair for Equal
      run_and_check(one_node(op, {a, b}), in, 2 * u32, 0);
    }
  // three inputs
  for (const char* op : {"Sum", "Mean", "Max", "Min"})
    run_and_check(one_node(op, {{2, 3}, {3}, {2, 1}}), rand_inputs({{2, 3}, {3}, {2, 1}}, 5), 4 * u32, 1e-7);
  // Pow with a float and with an integer exponent
  run_and_check(one_node("Pow", {{3, 4}, {4}}), rand_inputs({{3, 4}, {4}}, 6, 0.5f, 2.0f), 4 * u32, 0);
  {
    tg::graph g = one_node("Pow", {{3, 4}, {1}}, {}, 1, {}, {dtype::f32, dtype::i64});
    auto in = rand_inputs({{3, 4}}, 7);
    in["x1"] = rt{dtype::i64, {1}, {3}};
    run_and_check(g, in, 4 * u32, 0);
  }
  // Where: a u8 condition broadcast against f32 values
  {
    tg::graph g = one_node("Where", {{2, 1, 4}, {3, 4}, {2, 3, 1}}, {}, 1, {}, {dtype::u8, dtype::f32, dtype::f32});
    auto in = rand_inputs({{2, 1, 4}, {3, 4}, {2, 3, 1}}, 8);
    for (double& v : in["x0"].v) v = v > 0 ? 1 : 0;
    in["x0"].t = dtype::u8;
    run_and_check(g, in, 0, 0);
  }
}

TEST_CASE("integer arithmetic is exact and integer division by zero is an error naming the node", "[graph][executor]") {
  for (const char* op : {"Add", "Sub", "Mul", "Div", "Max", "Min"}) {
    tg::graph g = one_node(op, {{2, 3}, {3}}, {}, 1, {}, {dtype::i64, dtype::i64});
    std::map<std::string, rt> in{{"x0", rt{dtype::i64, {2, 3}, {7, -7, 100, 3, 0, -1}}}, {"x1", rt{dtype::i64, {3}, {2, 3, -5}}}};
    run_and_check(g, in, 0, 0);
  }
  tg::graph g = one_node("Div", {{2}, {2}}, {}, 1, {}, {dtype::i32, dtype::i32});
  host_device dev(1);
  auto exe = tg::compile(g, dev);
  CHECK_THROWS_MATCHES(exe.run({{"x0", to_host(rt{dtype::i32, {2}, {1, 2}})}, {"x1", to_host(rt{dtype::i32, {2}, {1, 0}})}}), graph_error,
                       is_error(errc::invalid_argument, "graph", "Div 'n': integer division by zero"));
}

TEST_CASE("Cast converts between float and integer dtypes", "[graph][executor]") {
  {
    tg::graph g = one_node("Cast", {{6}}, {{"to", std::int64_t{7}}});  // f32 -> i64 truncates toward zero
    std::map<std::string, rt> in{{"x0", rt{dtype::f32, {6}, {1.5, -1.5, 2.99, -0.5, 100, 0}}}};
    run_and_check(g, in, 0, 0);
  }
  {
    tg::graph g = one_node("Cast", {{3}}, {{"to", std::int64_t{1}}}, 1, {}, {dtype::i64});
    run_and_check(g, {{"x0", rt{dtype::i64, {3}, {-4, 0, 1 << 20}}}}, 0, 0);
  }
  {  // f32 -> bf16 -> f32 rounds to 8 significant bits, to nearest even
    tg::graph g("cast16");
    g.add_input("x", dtype::f32, {4});
    g.add_node("Cast", "to16", {"x"}, {"h"}, {{"to", std::string("bf16")}});
    g.add_node("Cast", "to32", {"h"}, {"y"}, {{"to", std::int64_t{1}}});
    g.mark_output("y");
    host_device dev(1);
    auto exe = tg::compile(g, dev);
    const std::vector<float> x{1.0f + 0x1p-8f, 1.0f + 0x1p-7f + 0x1p-8f, 3.0f, -1.0f - 0x1p-9f};
    const auto y = exe.run({{"x", tg::host_tensor::of<float>({4}, x)}}).at("y").values<float>();
    CHECK(y == std::vector<float>{1.0f, 1.0f + 0x1p-6f, 3.0f, -1.0f});
  }
}

// ---- data movement ----------------------------------------------------------------------------------------

TEST_CASE("reshape family, transpose, concat, split, slice, gather, expand, shape and constants move data exactly", "[graph][executor]") {
  auto x = rand_inputs({{2, 3, 4}}, 31);
  {
    tg::graph h("reshape");
    h.add_input("x0", dtype::f32, {2, 3, 4});
    h.add_constant_ints("shape", {0, -1});
    h.add_node("Reshape", "r", {"x0", "shape"}, {"y"});
    h.mark_output("y");
    run_and_check(h, x, 0, 0);
  }
  run_and_check(one_node("Flatten", {{2, 3, 4}}, {{"axis", std::int64_t{2}}}), x, 0, 0);
  for (auto perm : {tg::ints{2, 0, 1}, tg::ints{1, 0, 2}, tg::ints{0, 2, 1}})
    run_and_check(one_node("Transpose", {{2, 3, 4}}, {{"perm", perm}}), x, 0, 0);
  run_and_check(one_node("Transpose", {{2, 3, 4}}), x, 0, 0);  // default: reversed
  {
    tg::graph g("sq");
    g.add_input("x0", dtype::f32, {2, 1, 4});
    g.add_constant_ints("ax", {1});
    g.add_constant_ints("ax2", {0, -1});
    g.add_node("Squeeze", "s", {"x0", "ax"}, {"a"});
    g.add_node("Unsqueeze", "u", {"a", "ax2"}, {"y"});
    g.mark_output("y");
    run_and_check(g, rand_inputs({{2, 1, 4}}, 32), 0, 0);
  }
  for (std::int64_t ax : {0, 1, -1}) {
    std::vector<std::vector<std::size_t>> s = {{2, 3, 4}, {2, 3, 4}, {2, 3, 4}};
    for (std::size_t i = 0; i < 3; ++i) s[i][nax(ax, 3)] = i + 1;
    run_and_check(one_node("Concat", s, {{"axis", ax}}), rand_inputs(s, 33), 0, 0);
    run_and_check(one_node("Split", {{6, 6, 6}}, {{"axis", ax}, {"split", tg::ints{1, 2, 3}}}, 3), rand_inputs({{6, 6, 6}}, 34), 0, 0);
  }
  run_and_check(one_node("Split", {{4, 6}}, {{"axis", std::int64_t{1}}}, 2), rand_inputs({{4, 6}}, 35), 0, 0);
  {  // rows of 320,004 bytes, copied in two pieces (256 KiB, then the end of the middle part and the last part)
    const std::vector<std::vector<std::size_t>> s = {{2, 30000}, {2, 50000}, {2, 1}};
    run_and_check(one_node("Concat", s, {{"axis", std::int64_t{1}}}), rand_inputs(s, 36), 0, 0);
    run_and_check(one_node("Split", {{2, 80001}}, {{"axis", std::int64_t{1}}, {"split", tg::ints{30000, 50000, 1}}}, 3),
                  rand_inputs({{2, 80001}}, 37), 0, 0);
  }
  {  // Slice: negative starts, a negative step, an axis subset, clamped ends
    tg::graph g("slice");
    g.add_input("x0", dtype::f32, {5, 6, 7});
    g.add_constant_ints("st", {-1, 1});
    g.add_constant_ints("en", {-100, 1000});
    g.add_constant_ints("ax", {0, 2});
    g.add_constant_ints("sp", {-2, 3});
    g.add_node("Slice", "s", {"x0", "st", "en", "ax", "sp"}, {"y"});
    g.mark_output("y");
    run_and_check(g, rand_inputs({{5, 6, 7}}, 36), 0, 0);
    tg::graph h("slice2");
    h.add_input("x0", dtype::f32, {5, 6});
    h.add_constant_ints("st", {1, 2});
    h.add_constant_ints("en", {4, -1});
    h.add_node("Slice", "s", {"x0", "st", "en"}, {"y"});
    h.mark_output("y");
    run_and_check(h, rand_inputs({{5, 6}}, 37), 0, 0);
  }
  for (std::int64_t ax : {0, 1, 2}) {  // Gather: negative indices, a 2-D index tensor
    tg::graph g("gather");
    g.add_input("x0", dtype::f32, {3, 4, 5});
    g.add_constant<std::int64_t>("idx", {2, 2}, std::vector<std::int64_t>{0, -1, 2, 1});
    g.add_node("Gather", "g", {"x0", "idx"}, {"y"}, {{"axis", ax}});
    g.mark_output("y");
    run_and_check(g, rand_inputs({{3, 4, 5}}, 38), 0, 0);
  }
  {
    tg::graph g("expand");
    g.add_input("x0", dtype::f32, {3, 1});
    g.add_constant_ints("shape", {2, 3, 4});
    g.add_node("Expand", "e", {"x0", "shape"}, {"y"});
    g.add_node("Shape", "sh", {"y"}, {"s"});
    g.add_node("Constant", "c", {}, {"k"}, {{"value_floats", tg::floats{1.5, -2}}});
    g.mark_output("y");
    g.mark_output("s");
    g.mark_output("k");
    run_and_check(g, rand_inputs({{3, 1}}, 39), 0, 0);
  }
}

// ---- reductions, softmax, norms ---------------------------------------------------------------------

TEST_CASE("reductions over any axes, with and without keepdims", "[graph][executor]") {
  const std::vector<std::size_t> s{3, 4, 5};
  for (const char* op : {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"})
    for (auto axes : {tg::ints{1}, tg::ints{0, 2}, tg::ints{-1}, tg::ints{}})
      for (std::int64_t keep : {0, 1}) {
        tg::graph g(op);
        g.add_input("x0", dtype::f32, {3, 4, 5});
        std::vector<std::string> ins{"x0"};
        if (!axes.empty()) {
          g.add_constant_ints("axes", axes);
          ins.push_back("axes");
        }
        g.add_node(op, "r", ins, {"y"}, {{"keepdims", keep}});
        g.mark_output("y");
        // sums accumulate in double and round once; products of 60 values in [0.5, 1.5] too
        run_and_check(g, rand_inputs({s}, 41, 0.5f, 1.5f), 2 * u32, 0);
      }
  // noop_with_empty_axes keeps the tensor
  run_and_check(one_node("ReduceSum", {s}, {{"noop_with_empty_axes", std::int64_t{1}}}), rand_inputs({s}, 42), 0, 0);
}

TEST_CASE("Softmax and LogSoftmax over any axis", "[graph][executor]") {
  for (const char* op : {"Softmax", "LogSoftmax"})
    for (std::int64_t ax : {-1, 0, 1}) run_and_check(one_node(op, {{3, 5, 7}}, {{"axis", ax}}), rand_inputs({{3, 5, 7}}, 51, -5, 5), 1e-6, 1e-7);
}

TEST_CASE("LayerNormalization with its statistics, BatchNormalization", "[graph][executor]") {
  for (std::int64_t ax : {-1, 1}) {
    const std::vector<std::size_t> ns = ax == -1 ? std::vector<std::size_t>{8} : std::vector<std::size_t>{3, 8};
    tg::graph g = one_node("LayerNormalization", {{2, 3, 8}, ns, {8}}, {{"axis", ax}, {"epsilon", 1e-3}}, 3);
    run_and_check(g, rand_inputs({{2, 3, 8}, ns, {8}}, 61, -2, 2), 1e-5, 1e-6);
  }
  tg::graph g = one_node("BatchNormalization", {{2, 3, 4, 5}, {3}, {3}, {3}, {3}});
  auto in = rand_inputs({{2, 3, 4, 5}, {3}, {3}, {3}, {3}}, 62);
  for (double& v : in["x4"].v) v = std::fabs(v) + 0.1;  // variances
  run_and_check(g, in, 1e-5, 1e-6);
}

// ---- GEMM ---------------------------------------------------------------------------------------------------

TEST_CASE("MatMul broadcasts batch dims and takes vectors, within the GEMM bound", "[graph][executor]") {
  const std::vector<std::pair<std::vector<std::size_t>, std::vector<std::size_t>>> cases = {
      {{3, 4}, {4, 5}},       {{2, 3, 40}, {40, 5}},  {{2, 1, 3, 4}, {5, 4, 6}}, {{4}, {4, 5}},    {{3, 4}, {4}},
      {{2, 3, 4}, {2, 4, 5}}, {{1, 3, 4}, {3, 4, 2}}, {{3, 0}, {0, 5}},          {{0, 4}, {4, 5}}, {{70, 33}, {33, 65}}};
  for (const auto& [a, b] : cases) {
    const std::size_t K = a.back();
    // inputs in [0, 1]: |A||B| = AB, so the bound gamma_K |A||B| + u |C| is relative to C
    run_and_check(one_node("MatMul", {a, b}), rand_inputs({a, b}, 71, 0, 1), gamma(K, u32) + u32, 0);
  }
}

TEST_CASE("Gemm with transposes, alpha, beta and a broadcast C", "[graph][executor]") {
  for (std::int64_t ta : {0, 1})
    for (std::int64_t tb : {0, 1})
      for (const auto& cs :
           {std::vector<std::size_t>{5}, std::vector<std::size_t>{3, 1}, std::vector<std::size_t>{}, std::vector<std::size_t>{3, 5}}) {
        const std::vector<std::size_t> a = ta ? std::vector<std::size_t>{7, 3} : std::vector<std::size_t>{3, 7};
        const std::vector<std::size_t> b = tb ? std::vector<std::size_t>{5, 7} : std::vector<std::size_t>{7, 5};
        tg::graph g = one_node("Gemm", {a, b, cs}, {{"transA", ta}, {"transB", tb}, {"alpha", 0.5}, {"beta", 2.0}});
        run_and_check(g, rand_inputs({a, b, cs}, 81, 0, 1), gamma(7, u32) + 4 * u32, 0);
      }
  run_and_check(one_node("Gemm", {{4, 6}, {6, 3}}), rand_inputs({{4, 6}, {6, 3}}, 82, 0, 1), gamma(6, u32) + u32, 0);
}

// ---- CNN ops (ops::conv2d, ops/pool.hpp, ops/batchnorm.hpp) -------------------------------------------------------------------------

TEST_CASE("Conv with pads, strides, dilations, groups and auto_pad, then pools and global pools", "[graph][executor]") {
  struct conv_case {
    std::vector<std::size_t> x, w;
    tg::attribute_map a;
  };
  const std::vector<conv_case> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {}},
      {{1, 4, 9, 8}, {6, 2, 3, 2}, {{"group", std::int64_t{2}}, {"pads", tg::ints{1, 0, 2, 1}}, {"strides", tg::ints{2, 1}}}},
      {{1, 2, 8, 8}, {3, 2, 3, 3}, {{"dilations", tg::ints{2, 1}}, {"auto_pad", std::string("SAME_UPPER")}, {"strides", tg::ints{2, 2}}}},
      {{2, 3, 10}, {5, 3, 4}, {{"pads", tg::ints{1, 2}}, {"strides", tg::ints{3}}}},  // 1-D
  };
  for (const auto& c : cases) {
    const std::size_t K = c.w[1] * c.w[2] * (c.w.size() > 3 ? c.w[3] : 1);
    run_and_check(one_node("Conv", {c.x, c.w, {c.w[0]}}, c.a), rand_inputs({c.x, c.w, {c.w[0]}}, 91, 0, 1), gamma(K + 1, u32) + u32, 0);
    run_and_check(one_node("Conv", {c.x, c.w}, c.a), rand_inputs({c.x, c.w}, 92, 0, 1), gamma(K, u32) + u32, 0);
  }
  for (const char* op : {"MaxPool", "AveragePool"})
    for (std::int64_t incl : {0, 1}) {
      tg::attribute_map a{{"kernel_shape", tg::ints{3, 2}}, {"pads", tg::ints{1, 1, 1, 0}}, {"strides", tg::ints{2, 1}}};
      if (std::string(op) == "AveragePool") a["count_include_pad"] = incl;
      run_and_check(one_node(op, {{2, 3, 7, 6}}, a), rand_inputs({{2, 3, 7, 6}}, 93), 4 * u32, 1e-7);
      a["ceil_mode"] = std::int64_t{1};
      run_and_check(one_node(op, {{2, 3, 7, 6}}, a), rand_inputs({{2, 3, 7, 6}}, 94), 4 * u32, 1e-7);
    }
  for (const char* op : {"GlobalAveragePool", "GlobalMaxPool"})
    run_and_check(one_node(op, {{2, 3, 5, 4}}), rand_inputs({{2, 3, 5, 4}}, 95), 2 * u32, 0);
}

// ---- fused ops ------------------------------------------------------------------------------------------------

TEST_CASE("FusedMatMul equals MatMul + Add + Add + activation", "[graph][executor][fused]") {
  struct fm_case {
    std::vector<std::size_t> a, b, bias, res;
  };
  const std::vector<fm_case> cases = {
      {{2, 5, 24}, {24, 16}, {16}, {2, 5, 16}},     // the epilogue path: one GEMM, tail in its epilogue
      {{130, 24}, {24, 40}, {40}, {130, 40}},       // more rows than one block
      {{2, 5, 24}, {2, 24, 16}, {16}, {2, 5, 16}},  // batched B: GEMM, then the tail as a pass
      {{4, 6}, {6, 4}, {4, 1}, {}},                 // a per-row bias: the pass
      {{3, 8}, {8, 5}, {}, {5}},                    // a broadcast residual: the pass
      {{3, 8}, {8, 5}, {}, {}},
      {{4, 2048}, {2048, 16}, {16}, {4, 16}},  // deep K: the GEMM splits K, the tail runs in its reduce
  };
  for (const auto& c : cases)
    for (const char* act : {"", "Relu", "Gelu", "GeluTanh", "Sigmoid", "Tanh", "Silu"}) {
      tg::graph f("fused");
      tg::graph u("unfused");
      for (tg::graph* g : {&f, &u}) {
        g->add_input("a", dtype::f32, tg::tensor_shape(std::vector<tg::dim>(c.a.begin(), c.a.end())));
        g->add_input("b", dtype::f32, tg::tensor_shape(std::vector<tg::dim>(c.b.begin(), c.b.end())));
        if (!c.bias.empty()) g->add_input("bias", dtype::f32, tg::tensor_shape(std::vector<tg::dim>(c.bias.begin(), c.bias.end())));
        if (!c.res.empty()) g->add_input("res", dtype::f32, tg::tensor_shape(std::vector<tg::dim>(c.res.begin(), c.res.end())));
      }
      f.add_node("FusedMatMul", "fm", {"a", "b", c.bias.empty() ? "" : "bias", c.res.empty() ? "" : "res"}, {"y"},
                 {{"activation", std::string(act)}, {"alpha", 0.75}}, "tessel");
      f.mark_output("y");
      u.add_constant<float>("alpha", {}, std::vector<float>{0.75f});
      u.add_node("MatMul", "mm", {"a", "b"}, {"p"});
      u.add_node("Mul", "scale", {"p", "alpha"}, {"q"});
      std::string cur = "q";
      if (!c.bias.empty()) {
        u.add_node("Add", "addb", {cur, "bias"}, {"qb"});
        cur = "qb";
      }
      if (!c.res.empty()) {
        u.add_node("Add", "addr", {cur, "res"}, {"qr"});
        cur = "qr";
      }
      const std::string a = act;
      if (a.empty())
        u.add_node("Identity", "act", {cur}, {"y"});
      else if (a == "Gelu")
        u.add_node("Gelu", "act", {cur}, {"y"});
      else if (a == "GeluTanh")
        u.add_node("Gelu", "act", {cur}, {"y"}, {{"approximate", std::string("tanh")}});
      else if (a == "Silu") {
        u.add_node("Sigmoid", "sg", {cur}, {"sg"});
        u.add_node("Mul", "act", {cur, "sg"}, {"y"});
      } else
        u.add_node(a, "act", {cur}, {"y"});
      u.mark_output("y");
      std::map<std::string, rt> in{{"a", rand_rt(c.a, 1, 0, 1)}, {"b", rand_rt(c.b, 2, 0, 1)}};
      if (!c.bias.empty()) in["bias"] = rand_rt(c.bias, 3, 0, 1);
      if (!c.res.empty()) in["res"] = rand_rt(c.res, 4, 0, 1);
      INFO("activation '" << act << "'");
      // both against fp64 (non-negative inputs: the GEMM bound is relative), and each other
      const double tol = gamma(c.a.back(), u32) + 8 * u32 + 2e-6;  // + the activations' own error
      const auto yf = run_and_check(f, in, tol, 1e-6);
      const auto yu = run_and_check(u, in, tol, 1e-6);
      check_close(yf.at("y"), from_host(yu.at("y")), 2 * tol, 2e-6, "fused vs unfused");
    }
}

// The unfused attention: scores by MatMul, scaled, masked, softmaxed, times V (GQA by repeating kv heads).
tg::graph unfused_attention(std::size_t B, std::size_t Hq, std::size_t Hkv, std::size_t Sq, std::size_t Sk, std::size_t D, bool mask) {
  tg::graph g("attn_unfused");
  g.add_input("q", dtype::f32, {B, Hq, Sq, D});
  g.add_input("k", dtype::f32, {B, Hkv, Sk, D});
  g.add_input("v", dtype::f32, {B, Hkv, Sk, D});
  if (mask) g.add_input("mask", dtype::f32, {Sq, Sk});
  std::string k = "k", v = "v";
  if (Hq != Hkv) {  // repeat each kv head Hq/Hkv times: [B,Hkv,1,S,D] -> expand -> reshape
    g.add_constant_ints("ax", {2});
    g.add_constant_ints("rep", {static_cast<std::int64_t>(B), static_cast<std::int64_t>(Hkv), static_cast<std::int64_t>(Hq / Hkv),
                                static_cast<std::int64_t>(Sk), static_cast<std::int64_t>(D)});
    g.add_constant_ints("merged",
                        {static_cast<std::int64_t>(B), static_cast<std::int64_t>(Hq), static_cast<std::int64_t>(Sk), static_cast<std::int64_t>(D)});
    for (const char* t : {"k", "v"}) {
      const std::string s = t;
      g.add_node("Unsqueeze", "u" + s, {s, "ax"}, {s + "_u"});
      g.add_node("Expand", "e" + s, {s + "_u", "rep"}, {s + "_e"});
      g.add_node("Reshape", "r" + s, {s + "_e", "merged"}, {s + "_r"});
    }
    k = "k_r";
    v = "v_r";
  }
  g.add_node("Transpose", "kt", {k}, {"kt"}, {{"perm", tg::ints{0, 1, 3, 2}}});
  g.add_node("MatMul", "qk", {"q", "kt"}, {"s"});
  g.add_constant<float>("scale", {}, std::vector<float>{static_cast<float>(1 / std::sqrt(double(D)))});
  g.add_node("Mul", "sc", {"s", "scale"}, {"ss"});
  std::string cur = "ss";
  if (mask) {
    g.add_node("Add", "m", {"ss", "mask"}, {"sm"});
    cur = "sm";
  }
  g.add_node("Softmax", "p", {cur}, {"p"}, {{"axis", std::int64_t{-1}}});
  g.add_node("MatMul", "pv", {"p", v}, {"y"});
  g.mark_output("y");
  return g;
}

TEST_CASE("Attention (fused operator and by parts) equals the unfused graph: GQA, causal bottom-right, additive mask", "[graph][executor][fused]") {
  struct at_case {
    std::size_t B, Hq, Hkv, Sq, Sk, D;
    bool causal, mask;
  };
  const std::vector<at_case> cases = {
      {2, 4, 2, 5, 7, 16, false, false},  // the fused operator, GQA
      {1, 2, 2, 3, 9, 32, true, false},   // fused, causal bottom-right (a decode-like step sees the cache)
      {2, 4, 1, 4, 6, 8, false, true},    // by parts: a mask, head dim 8
      {1, 2, 2, 4, 4, 16, true, true},    // by parts: mask and causal
      {1, 1, 1, 6, 6, 12, true, false},   // by parts: head dim 12
      {2, 3, 3, 40, 50, 12, true, true},  // by parts: 12000 mask elements, blocks of 4096 start inside rows of 50
  };
  for (const auto& c : cases) {
    INFO("B " << c.B << " Hq " << c.Hq << " Hkv " << c.Hkv << " Sq " << c.Sq << " Sk " << c.Sk << " D " << c.D << " causal " << c.causal << " mask "
              << c.mask);
    tg::graph f("attn");
    f.add_input("q", dtype::f32, {c.B, c.Hq, c.Sq, c.D});
    f.add_input("k", dtype::f32, {c.B, c.Hkv, c.Sk, c.D});
    f.add_input("v", dtype::f32, {c.B, c.Hkv, c.Sk, c.D});
    if (c.mask) f.add_input("mask", dtype::f32, {c.Sq, c.Sk});
    f.add_node("Attention", "a", {"q", "k", "v", c.mask ? "mask" : ""}, {"y"}, {{"causal", std::int64_t{c.causal}}}, "tessel");
    f.mark_output("y");
    std::map<std::string, rt> in{
        {"q", rand_rt({c.B, c.Hq, c.Sq, c.D}, 1)}, {"k", rand_rt({c.B, c.Hkv, c.Sk, c.D}, 2)}, {"v", rand_rt({c.B, c.Hkv, c.Sk, c.D}, 3)}};
    if (c.mask) in["mask"] = rand_rt({c.Sq, c.Sk}, 4, -2, 0);
    // outputs are convex combinations of V rows (|v| <= 1): errors from the scores (gamma_D) and the softmax
    const double tol = 4 * (gamma(c.D, u32) + gamma(c.Sk, u32)) + 1e-6;
    const auto yf = run_and_check(f, in, 0, tol);
    if (!c.causal) {
      tg::graph u = unfused_attention(c.B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D, c.mask);
      const auto yu = run_and_check(u, in, 0, tol);
      check_close(yf.at("y"), from_host(yu.at("y")), 0, 2 * tol, "fused vs unfused");
    }
  }
}

TEST_CASE("RMS and skip norms equal their ONNX equivalents", "[graph][executor][fused]") {
  const std::vector<std::size_t> xs{2, 3, 16};
  {
    tg::graph f = one_node("RMSNormalization", {xs, {16}}, {{"epsilon", 1e-4}}, 1, "tessel");
    tg::graph u("rms_unfused");
    u.add_input("x0", dtype::f32, {2, 3, 16});
    u.add_input("x1", dtype::f32, {16});
    u.add_constant<float>("two", {}, std::vector<float>{2.0f});
    u.add_constant<float>("eps", {}, std::vector<float>{1e-4f});
    u.add_constant_ints("ax", {-1});
    u.add_node("Pow", "sq", {"x0", "two"}, {"x2"});
    u.add_node("ReduceMean", "ms", {"x2", "ax"}, {"m"});
    u.add_node("Add", "ae", {"m", "eps"}, {"me"});
    u.add_node("Sqrt", "rt", {"me"}, {"r"});
    u.add_node("Div", "dv", {"x0", "r"}, {"xn"});
    u.add_node("Mul", "sc", {"xn", "x1"}, {"y"});
    u.mark_output("y");
    const auto in = rand_inputs({xs, {16}}, 5, -2, 2);
    const auto yf = run_and_check(f, in, 1e-5, 1e-6);
    const auto yu = run_and_check(u, in, 1e-5, 1e-6);
    check_close(yf.at("y"), from_host(yu.at("y")), 2e-5, 2e-6, "fused vs unfused");
  }
  for (const char* op : {"SkipLayerNormalization", "SkipRMSNormalization"})
    for (const auto& skip : {xs, std::vector<std::size_t>{3, 16}}) {  // a full skip, and one that broadcasts
      const bool layer = std::string(op) == "SkipLayerNormalization";
      std::vector<std::vector<std::size_t>> shapes{xs, skip, {16}};
      if (layer) shapes.push_back({16});
      tg::graph f = one_node(op, shapes, {}, 2, "tessel");
      tg::graph u("skip_unfused");
      for (std::size_t i = 0; i < shapes.size(); ++i)
        u.add_input(nm("x", i), dtype::f32, tg::tensor_shape(std::vector<tg::dim>(shapes[i].begin(), shapes[i].end())));
      u.add_node("Add", "add", {"x0", "x1"}, {"y1"});
      if (layer)
        u.add_node("LayerNormalization", "ln", {"y1", "x2", "x3"}, {"y"});
      else
        u.add_node("RMSNormalization", "ln", {"y1", "x2"}, {"y"}, {}, "tessel");
      u.mark_output("y");
      u.mark_output("y1");
      const auto in = rand_inputs(shapes, 6, -2, 2);
      const auto yf = run_and_check(f, in, 1e-5, 1e-6);
      const auto yu = run_and_check(u, in, 1e-5, 1e-6);
      check_close(yf.at("y"), from_host(yu.at("y")), 2e-5, 2e-6, "fused vs unfused");
      check_close(yf.at("y1"), from_host(yu.at("y1")), 0, 0, "the sum output");
    }
}

TEST_CASE("RotaryEmbedding matches fp64, rotate-half and interleaved, and equals its unfused spelling", "[graph][executor][fused]") {
  const std::vector<std::size_t> xs{2, 3, 5, 8};
  // Inputs in [-2, 2]: both products and the sum are at most 8 in size, and each of the three
  // roundings (or two, when the compiler contracts to an FMA) errs by at most 8·u.
  const double bound = 3 * 8 * u32;
  for (std::int64_t inter : {0, 1})
    for (const auto& cs : {std::vector<std::size_t>{5, 8}, std::vector<std::size_t>{1, 1, 5, 8}, std::vector<std::size_t>{2, 1, 5, 8}}) {
      CAPTURE(inter, cs);
      tg::graph f = one_node("RotaryEmbedding", {xs, cs, cs}, {{"interleaved", inter}}, 1, "tessel");
      run_and_check(f, rand_inputs({xs, cs, cs}, 11, -2, 2), 0, bound);
    }
  // Rows of 10 over 15000 elements: the 4096-element blocks start inside a row (in either half of
  // it), and a cos constant along the last axis (stride 0 there) beside a sin that is not.
  const std::vector<std::size_t> xl{3, 5, 100, 10};
  for (std::int64_t inter : {0, 1})
    for (const auto& cs : {std::vector<std::size_t>{100, 10}, std::vector<std::size_t>{100, 1}}) {
      CAPTURE(inter, cs);
      const std::vector<std::size_t> ss{5, 1, 10};
      tg::graph f = one_node("RotaryEmbedding", {xl, cs, ss}, {{"interleaved", inter}}, 1, "tessel");
      run_and_check(f, rand_inputs({xl, cs, ss}, 13, -2, 2), 0, bound);
    }
  // x·cos + Concat(-x[4:], x[:4])·sin as ONNX ops, after optimize(): one RotaryEmbedding, same values.
  tg::graph u("rope_unfused");
  u.add_input("x0", dtype::f32, {2, 3, 5, 8});
  u.add_input("x1", dtype::f32, {5, 8});
  u.add_input("x2", dtype::f32, {5, 8});
  u.add_constant_ints("s0", {0});
  u.add_constant_ints("s4", {4});
  u.add_constant_ints("s8", {8});
  u.add_constant_ints("ax", {-1});
  u.add_node("Slice", "lo", {"x0", "s0", "s4", "ax"}, {"x_lo"});
  u.add_node("Slice", "hi", {"x0", "s4", "s8", "ax"}, {"x_hi"});
  u.add_node("Neg", "neg", {"x_hi"}, {"x_nhi"});
  u.add_node("Concat", "cat", {"x_nhi", "x_lo"}, {"rot"}, {{"axis", std::int64_t{-1}}});
  u.add_node("Mul", "mc", {"x0", "x1"}, {"a"});
  u.add_node("Mul", "ms", {"rot", "x2"}, {"b"});
  u.add_node("Add", "add", {"a", "b"}, {"y"});
  u.mark_output("y");
  const auto in = rand_inputs({xs, {5, 8}, {5, 8}}, 12, -2, 2);
  const auto yu = run_and_check(u, in, 0, bound);
  tg::graph fused = u;
  const auto report = tg::optimize(fused);
  CHECK(report.pattern("RotaryEmbedding") == 1);
  CHECK(fused.node_count() == 1);
  const auto yf = run_and_check(fused, in, 0, bound);
  check_close(yf.at("y"), from_host(yu.at("y")), 0, 2 * bound, "fused vs unfused");
}

TEST_CASE("FusedConv equals Conv + Add + activation", "[graph][executor][fused]") {
  for (const char* act : {"", "Relu", "Silu"}) {
    tg::graph f = one_node("FusedConv", {{2, 3, 6, 6}, {4, 3, 3, 3}, {4}, {2, 4, 6, 6}},
                           {{"pads", tg::ints{1, 1, 1, 1}}, {"activation", std::string(act)}}, 1, "tessel");
    tg::graph u("conv_unfused");
    u.add_input("x0", dtype::f32, {2, 3, 6, 6});
    u.add_input("x1", dtype::f32, {4, 3, 3, 3});
    u.add_input("x2", dtype::f32, {4});
    u.add_input("x3", dtype::f32, {2, 4, 6, 6});
    u.add_node("Conv", "c", {"x0", "x1", "x2"}, {"c"}, {{"pads", tg::ints{1, 1, 1, 1}}});
    u.add_node("Add", "z", {"c", "x3"}, {"cz"});
    const std::string a = act;
    if (a.empty())
      u.add_node("Identity", "act", {"cz"}, {"y"});
    else if (a == "Relu")
      u.add_node("Relu", "act", {"cz"}, {"y"});
    else {
      u.add_node("Sigmoid", "sg", {"cz"}, {"sg"});
      u.add_node("Mul", "act", {"cz", "sg"}, {"y"});
    }
    u.mark_output("y");
    const auto in = rand_inputs({{2, 3, 6, 6}, {4, 3, 3, 3}, {4}, {2, 4, 6, 6}}, 7, 0, 1);
    const double tol = gamma(28, u32) + 8 * u32;
    const auto yf = run_and_check(f, in, tol, 1e-6);
    const auto yu = run_and_check(u, in, tol, 1e-6);
    check_close(yf.at("y"), from_host(yu.at("y")), 2 * tol, 2e-6, "fused vs unfused");
  }
}

TEST_CASE("bf16 compute rounds GEMM and attention inputs to bf16 and stays within its bound", "[graph][executor][bf16]") {
  tg::compile_options bf;
  bf.compute = dtype::bf16;
  for (const auto& [a, b] :
       std::vector<std::pair<std::vector<std::size_t>, std::vector<std::size_t>>>{{{9, 64}, {64, 33}}, {{2, 3, 40}, {2, 40, 7}}}) {
    const auto in = rand_inputs({a, b}, 111, 0, 1);
    // both inputs rounded (2 u_bf16, plus its square) then an f32 accumulation: relative, inputs >= 0
    const auto y16 = run_and_check(one_node("MatMul", {a, b}), in, 2 * u16 + u16 * u16 + gamma(a.back(), u32) + u32, 0, bf);
    const auto y32 = run_and_check(one_node("MatMul", {a, b}), in, gamma(a.back(), u32) + u32, 0);
    CHECK(y16.at("y").data != y32.at("y").data);  // bf16 really ran
  }
  run_and_check(one_node("Gemm", {{5, 12}, {7, 12}, {7}}, {{"transB", std::int64_t{1}}}), rand_inputs({{5, 12}, {7, 12}, {7}}, 112, 0, 1),
                2 * u16 + u16 * u16 + gamma(12, u32) + 2 * u32, 0, bf);
  // Conv: image and filter rounded, f32 accumulation of K = C·KH·KW products plus the bias; a wide
  // image (16-pixel runs) and a narrow one, a 3x3 and a strided 1x1
  for (const auto& [x, w, a] : std::vector<std::tuple<std::vector<std::size_t>, std::vector<std::size_t>, tg::attribute_map>>{
           {{1, 8, 5, 20}, {6, 8, 3, 3}, {{"pads", tg::ints{1, 1, 1, 1}}}}, {{2, 5, 7, 6}, {4, 5, 1, 1}, {{"strides", tg::ints{2, 2}}}}}) {
    const std::size_t K = w[1] * w[2] * w[3];
    const auto in = rand_inputs({x, w, {w[0]}}, 113, 0, 1);
    const auto y16 = run_and_check(one_node("Conv", {x, w, {w[0]}}, a), in, 2 * u16 + u16 * u16 + gamma(K + 1, u32) + u32, 0, bf);
    const auto y32 = run_and_check(one_node("Conv", {x, w, {w[0]}}, a), in, gamma(K + 1, u32) + u32, 0);
    CHECK(y16.at("y").data != y32.at("y").data);  // bf16 really ran
  }
  for (std::size_t D : {16, 8}) {  // the fused operator and the by-parts path
    tg::graph f("attn16");
    f.add_input("q", dtype::f32, {1, 2, 5, D});
    f.add_input("k", dtype::f32, {1, 2, 6, D});
    f.add_input("v", dtype::f32, {1, 2, 6, D});
    f.add_node("Attention", "a", {"q", "k", "v"}, {"y"}, {}, "tessel");
    f.mark_output("y");
    const std::map<std::string, rt> in{{"q", rand_rt({1, 2, 5, D}, 1)}, {"k", rand_rt({1, 2, 6, D}, 2)}, {"v", rand_rt({1, 2, 6, D}, 3)}};
    // scores off by at most 2 u_bf16 sqrt(D) (|q|, |k| <= 1, scale 1/sqrt(D)), probabilities by twice that
    // relative; V (and P, by parts) rounded: 2 u_bf16 more; |v| <= 1
    const double tol = 2 * (2 * u16 * std::sqrt(double(D))) + 3 * u16 + 1e-5;
    run_and_check(f, in, 0, tol, bf);
  }
}

// ---- whole models -----------------------------------------------------------------------------------------------

// `g` with every f32 constant refilled with uniform values in +-1/sqrt(its first dim) (fan-in scaled,
// so that activations stay O(1) and the bound below is meaningful), except the scalar "scale".
tg::graph reweighted(const tg::graph& g, std::uint32_t seed) {
  tg::graph r(g.name());
  for (tg::value_id v : g.inputs()) r.add_input(g.get(v).name, *g.get(v).type, g.get(v).shape);
  for (tg::value_id v : g.constants()) {
    const tg::value& x = g.get(v);
    std::vector<std::int64_t> dims;
    for (const auto& d : x.shape.dims) dims.push_back(d.size);
    if (*x.type == dtype::f32 && !dims.empty()) {
      const float a = 1.0f / std::sqrt(static_cast<float>(dims[0]));
      r.add_constant<float>(x.name, dims, randu(count(std::vector<std::size_t>(dims.begin(), dims.end())), seed++, -a, a));
    } else {
      r.add_constant(x.name, *x.type, dims, x.data);
    }
  }
  for (tg::node_id id : g.node_ids()) {
    const tg::node& n = g.get(id);
    std::vector<std::string> ins, outs;
    for (auto v : n.inputs) ins.push_back(v == tg::value_id::none ? "" : g.get(v).name);
    for (auto v : n.outputs) outs.push_back(v == tg::value_id::none ? "" : g.get(v).name);
    r.add_node(n.op, n.name, ins, outs, n.attributes, n.domain);
  }
  for (auto v : g.outputs()) r.mark_output(g.get(v).name);
  return r;
}

// The bound for a model output: each GEMM layer on the path contributes gamma_K (inputs rounded to
// the compute dtype add 2u_in), the norms and softmax a few u; `layers` counts the layers on the
// longest path, K the largest inner dim; relative to the largest reference output plus 1 (the
// activations are O(1) by construction).
double model_bound(std::size_t layers, std::size_t K, double u_in) { return double(layers) * (gamma(K, u32) + 2 * u_in + 16 * u32); }

TEST_CASE("the MLP and the transformer block run end to end within their bound, f32 and bf16", "[graph][executor][models]") {
  for (dtype compute : {dtype::f32, dtype::bf16}) {
    const double u_in = compute == dtype::bf16 ? u16 : 0.0;
    {
      const tg::graph g = reweighted(make_mlp(), 100);
      tg::compile_options o;
      o.symbols = {{"batch", 5}};
      o.compute = compute;
      run_and_check(g, {{"x", rand_rt({5, 16}, 7)}}, 0, model_bound(2, 32, u_in) * 4, o);
    }
    {
      const tg::graph g = reweighted(make_transformer_block(), 200);
      tg::compile_options o;
      o.symbols = {{"batch", 3}};
      o.compute = compute;
      // the path: LN, Q/K/V, scores, P·V, O projection, LN, up, down: 8 layers, K = FF = 128;
      // the output is O(1) + the residual stream, so the bound is absolute at that scale (x4 for the
      // conditioning of LN and softmax on these sizes)
      run_and_check(g, {{"x", rand_rt({3, S, D}, 8)}}, 0, model_bound(8, FF, u_in) * 4, o);
    }
  }
}

// ---- the arena ------------------------------------------------------------------------------------------------------

template <class Dev>
tg::tensor_map run_on(Dev& dev, const tg::graph& g, const tg::tensor_map& in, tg::compile_options o) {
  auto exe = tg::compile(g, dev, o);
  return exe.run(in);
}

void check_same_bits(const tg::tensor_map& a, const tg::tensor_map& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [k, t] : a) {
    INFO(k);
    CHECK(t.shape == b.at(k).shape);
    CHECK(t.data == b.at(k).data);
  }
}

TEST_CASE("a planned run, an unplanned run and a run with poisoned free regions give the same bits, as do host and card, 1 and 2 threads",
          "[graph][executor][arena]") {
  for (const bool block : {false, true}) {
    const tg::graph g = reweighted(block ? make_transformer_block() : make_mlp(), 300);
    tg::compile_options o;
    o.symbols = {{"batch", 4}};
    tg::tensor_map in{{"x", to_host(block ? rand_rt({4, S, D}, 9) : rand_rt({4, 16}, 9))}};
    host_device dev2(2), dev1(1);
    const auto planned = run_on(dev2, g, in, o);
    {
      auto exe = tg::compile(g, dev2, o);
      CHECK(exe.arena_bytes() == exe.activations().plan.arena_bytes);
      CHECK(exe.arena_bytes() < exe.activations().plan.unplanned_bytes);  // the plan saves memory
      CHECK(exe.activations().plan.in_place > 0);
      // the executor's map agrees with the plan's own search
      for (tg::value_id v : exe.activations().values) CHECK(exe.offset_of(v) == exe.activations().offset_of(v));
      // the second run of one executable (the arena reused) gives the same bits
      check_same_bits(exe.run(in), exe.run(in));
    }
    tg::compile_options un = o;
    un.plan_memory = false;
    check_same_bits(planned, run_on(dev2, g, in, un));
    tg::compile_options poison = o;
    poison.poison_freed = true;
    check_same_bits(planned, run_on(dev2, g, in, poison));
    check_same_bits(planned, run_on(dev1, g, in, o));  // 1 vs 2 threads: every op is deterministic
    tessel::executor ex(2);
    tessel::emu::card_spec spec;
    spec.memory_bytes = std::size_t(256) << 20;
    tessel::emu::card card(0, spec, ex, false, nullptr);
    check_same_bits(planned, run_on(card, g, in, o));
    tg::compile_options bf = o;
    bf.compute = dtype::bf16;
    check_same_bits(run_on(dev2, g, in, bf), run_on(card, g, in, bf));
  }
}

TEST_CASE("poisoning really reaches the arena: a free region read as an input would be NaN", "[graph][executor][arena]") {
  // With poison on, the bytes of a value that died are 0xff: the plan puts a later value over them,
  // and the outputs stay finite only because every kernel writes before it reads.
  const tg::graph g = reweighted(make_mlp(), 400);
  tg::compile_options o;
  o.symbols = {{"batch", 3}};
  o.poison_freed = true;
  host_device dev(2);
  auto exe = tg::compile(g, dev, o);
  const auto y = exe.run({{"x", to_host(rand_rt({3, 16}, 10))}}).at("y").values<float>();
  for (float v : y) CHECK(std::isfinite(v));
  CHECK(exe.arena_bytes() > 0);
}

// ---- bad inputs ------------------------------------------------------------------------------------------------------

TEST_CASE("bad inputs are typed graph_errors naming the input", "[graph][executor][errors]") {
  const tg::graph g = make_mlp();
  host_device dev(1);
  tg::compile_options o;
  o.symbols = {{"batch", 2}};
  auto exe = tg::compile(g, dev, o);
  const auto x = tg::host_tensor::of<float>({2, 16}, std::vector<float>(32, 1.0f));
  CHECK_THROWS_MATCHES(exe.run({}), graph_error, is_error(errc::invalid_argument, "graph", "input 'x' is missing"));
  CHECK_THROWS_MATCHES(exe.run({{"x", x}, {"z", x}}), graph_error,
                       is_error(errc::invalid_argument, "graph", "input 'z': the graph has no such input"));
  CHECK_THROWS_MATCHES(exe.run({{"x", tg::host_tensor::of<float>({3, 16}, std::vector<float>(48, 1.0f))}}), graph_error,
                       is_error(errc::invalid_argument, "graph", "input 'x' has shape [3,16], the graph takes [2,16]"));
  CHECK_THROWS_MATCHES(exe.run({{"x", tg::host_tensor::of<double>({2, 16}, std::vector<double>(32, 1.0))}}), graph_error,
                       is_error(errc::invalid_argument, "graph", "input 'x' is f64, the graph takes f32"));
  tg::host_tensor short_x = x;
  short_x.data.resize(8);
  CHECK_THROWS_MATCHES(exe.run({{"x", short_x}}), graph_error, is_error(errc::invalid_argument, "graph", "input 'x' holds 8 bytes"));
  CHECK_THROWS_MATCHES(tg::compile(g, dev), graph_error,
                       is_error(errc::invalid_argument, "graph", "input 'x' [batch,16]: symbol 'batch' is not bound"));
  tg::compile_options neg;
  neg.symbols = {{"batch", -1}};
  CHECK_THROWS_MATCHES(tg::compile(g, dev, neg), graph_error, is_error(errc::invalid_argument, "graph", "input 'x': symbol 'batch' is bound to -1"));
  tg::compile_options f16;
  f16.symbols = {{"batch", 2}};
  f16.compute = dtype::fp16;
  CHECK_THROWS_MATCHES(tg::compile(g, dev, f16), graph_error, is_error(errc::unsupported, "graph", "compute dtype fp16"));
  // a graph whose op the executor has no kernel for, and a computed Reshape shape
  tg::graph h("bad");
  h.add_input("x", dtype::f32, {2});
  h.add_node("Frobnicate", "f", {"x"}, {"y"}, {}, "custom");
  h.mark_output("y");
  CHECK_THROWS_MATCHES(tg::compile(h, dev), graph_error, is_error(errc::unsupported, "graph"));
  tg::graph k("computed");
  k.add_input("x", dtype::f32, {2, 3});
  k.add_input("s", dtype::i64, {2});
  k.add_node("Reshape", "r", {"x", "s"}, {"y"});
  k.mark_output("y");
  CHECK_THROWS_MATCHES(tg::compile(k, dev), graph_error, is_error(errc::unsupported, "graph", "value 'y'"));
}

// ---- CNN ops on ops/: the packed filter, the fallbacks, bf16 constants -----------------------------------------

// A graph whose Conv (or FusedConv) filter and bias are constants (packed once at compile time) and
// the same graph with them as inputs (the plain ops::conv2d call): same bits, NCHW, any geometry.
TEST_CASE("Conv with a constant filter (prepacked at compile) gives the bits of the filter as an input", "[graph][executor][conv]") {
  struct conv_case {
    std::vector<std::size_t> x, w;
    tg::attribute_map a;
    bool fused;
  };
  const std::vector<conv_case> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {{"pads", tg::ints{1, 1, 1, 1}}}, false},
      {{1, 4, 9, 8}, {6, 2, 3, 2}, {{"group", std::int64_t{2}}, {"pads", tg::ints{1, 0, 2, 1}}, {"strides", tg::ints{2, 1}}}, false},
      {{2, 3, 10}, {5, 3, 4}, {{"pads", tg::ints{1, 2}}, {"strides", tg::ints{3}}}, false},
      {{2, 3, 6, 6}, {4, 3, 3, 3}, {{"pads", tg::ints{1, 1, 1, 1}}, {"activation", std::string("Relu")}}, true},
  };
  host_device dev(2);
  for (const auto& c : cases) {
    const std::vector<std::size_t> ys = c.fused ? std::vector<std::size_t>{2, 4, 6, 6} : std::vector<std::size_t>{};
    const auto in = rand_inputs({c.x, c.w, {c.w[0]}, ys}, 401, -1, 1);
    tg::graph as_inputs = c.fused ? one_node("FusedConv", {c.x, c.w, {c.w[0]}, ys}, c.a, 1, "tessel") : one_node("Conv", {c.x, c.w, {c.w[0]}}, c.a);
    tg::graph as_consts(as_inputs.name());
    {
      tg::tensor_shape xs;
      for (auto d : c.x) xs.dims.emplace_back(d);
      as_consts.add_input("x0", dtype::f32, xs);
      std::vector<float> wv(in.at("x1").v.begin(), in.at("x1").v.end()), bv(in.at("x2").v.begin(), in.at("x2").v.end());
      as_consts.add_constant<float>("x1", i64s(c.w), wv);
      as_consts.add_constant<float>("x2", {static_cast<std::int64_t>(c.w[0])}, bv);
      std::vector<std::string> ins{"x0", "x1", "x2"};
      if (c.fused) {
        as_consts.add_input("x3", dtype::f32, {2, 4, 6, 6});
        ins.push_back("x3");
      }
      as_consts.add_node(c.fused ? "FusedConv" : "Conv", "n", ins, {"y"}, c.a, c.fused ? "tessel" : "");
      as_consts.mark_output("y");
    }
    tg::tensor_map hin{{"x0", to_host(in.at("x0"))}}, all = hin;
    all.emplace("x1", to_host(in.at("x1")));
    all.emplace("x2", to_host(in.at("x2")));
    if (c.fused) {
      hin.emplace("x3", to_host(in.at("x3")));
      all.emplace("x3", to_host(in.at("x3")));
    }
    check_same_bits(run_on(dev, as_consts, hin, {}), run_on(dev, as_inputs, all, {}));
    tg::compile_options bf;  // bf16: the filter rounded and packed at compile time, or rounded per run
    bf.compute = dtype::bf16;
    check_same_bits(run_on(dev, as_consts, hin, bf), run_on(dev, as_inputs, all, bf));
  }
}

TEST_CASE("pools whose windows ops/pool.hpp refuses run on the fallback loop, as does batch norm with epsilon 0", "[graph][executor][conv]") {
  // pads as large as the kernel: the first and last windows lie wholly in the padding (max: -inf;
  // average counting the padding: 0). ops::max_pool2d refuses such a window, the fallback takes it.
  for (const char* op : {"MaxPool", "AveragePool"}) {
    tg::attribute_map a{{"kernel_shape", tg::ints{2, 2}}, {"pads", tg::ints{2, 2, 2, 2}}, {"strides", tg::ints{1, 1}}};
    if (std::string(op) == "AveragePool") a["count_include_pad"] = std::int64_t{1};
    const auto out = run_and_check(one_node(op, {{1, 2, 3, 4}}, a), rand_inputs({{1, 2, 3, 4}}, 411), 4 * u32, 1e-7);
    const auto y = out.at("y").values<float>();
    REQUIRE(out.at("y").shape == std::vector<std::int64_t>{1, 2, 6, 7});
    CHECK(y[0] == (std::string(op) == "MaxPool" ? -INFINITY : 0.0f));  // window (0, 0): padding only
  }
  // dilations and a 1-D pool go through ops (H = 1)
  run_and_check(
      one_node("MaxPool", {{2, 3, 9, 8}}, {{"kernel_shape", tg::ints{2, 3}}, {"dilations", tg::ints{2, 2}}, {"pads", tg::ints{1, 1, 1, 1}}}),
      rand_inputs({{2, 3, 9, 8}}, 412), 0, 0);
  run_and_check(one_node("AveragePool", {{2, 3, 11}}, {{"kernel_shape", tg::ints{3}}, {"strides", tg::ints{2}}, {"ceil_mode", std::int64_t{1}}}),
                rand_inputs({{2, 3, 11}}, 413), 4 * u32, 1e-7);
  for (double eps : {0.0, 1e-3}) {
    tg::graph g = one_node("BatchNormalization", {{2, 3, 4, 5}, {3}, {3}, {3}, {3}}, {{"epsilon", eps}});
    auto in = rand_inputs({{2, 3, 4, 5}, {3}, {3}, {3}, {3}}, 414);
    for (double& v : in["x4"].v) v = std::fabs(v) + 0.1;
    run_and_check(g, in, 1e-5, 1e-6);
  }
  // 3-D batch norm input (N, C, L) and global pools of a 1-D input
  tg::graph g3 = one_node("BatchNormalization", {{2, 3, 7}, {3}, {3}, {3}, {3}});
  auto in3 = rand_inputs({{2, 3, 7}, {3}, {3}, {3}, {3}}, 415);
  for (double& v : in3["x4"].v) v = std::fabs(v) + 0.1;
  run_and_check(g3, in3, 1e-5, 1e-6);
  for (const char* op : {"GlobalAveragePool", "GlobalMaxPool"}) run_and_check(one_node(op, {{2, 3, 7}}), rand_inputs({{2, 3, 7}}, 416), 2 * u32, 0);
}

TEST_CASE("bf16 compute converts constant weights once at compile time, with the bits of converting them each run", "[graph][executor][bf16]") {
  // MatMul and Gemm with B a constant vs B an input: the same rounding, so the same bits
  host_device dev(2);
  tg::compile_options bf;
  bf.compute = dtype::bf16;
  const rt a = rand_rt({5, 24}, 421), b = rand_rt({24, 7}, 422);
  for (const char* op : {"MatMul", "Gemm"}) {
    tg::graph with_input = one_node(op, {{5, 24}, {24, 7}});
    tg::graph with_const(op);
    with_const.add_input("x0", dtype::f32, {5, 24});
    with_const.add_constant<float>("x1", {24, 7}, std::vector<float>(b.v.begin(), b.v.end()));
    with_const.add_node(op, "n", {"x0", "x1"}, {"y"});
    with_const.mark_output("y");
    const auto yc = run_on(dev, with_const, {{"x0", to_host(a)}}, bf);
    check_same_bits(yc, run_on(dev, with_input, {{"x0", to_host(a)}, {"x1", to_host(b)}}, bf));
    // and it is bf16: it differs from the f32 run (inputs with more than 8 significant bits)
    CHECK(yc.at("y").data != run_on(dev, with_const, {{"x0", to_host(a)}}, {}).at("y").data);
  }
}

// ---- Resize ------------------------------------------------------------------------------------------------------

// The fp64 reference of ONNX Resize (opset 13 to 17), written from the operator's definition: each
// output coordinate maps back through coordinate_transformation_mode; nearest picks one input
// index by nearest_mode, linear interpolates between the two neighbours of the clamped coordinate.
rt resize_reference(const rt& x, const std::vector<std::size_t>& ys, const std::vector<double>& scales, const std::string& mode,
                    const std::string& ctm, const std::string& nearest_mode) {
  const std::size_t r = x.s.size();
  auto source = [&](std::size_t a, std::size_t o) {
    const double s = scales[a], xo = double(o), in = double(x.s[a]), out = double(ys[a]);
    if (ctm == "asymmetric") return xo / s;
    if (ctm == "align_corners") return out == 1 ? 0.0 : xo * (in - 1) / (out - 1);
    if (ctm == "pytorch_half_pixel" && out == 1) return 0.0;
    return (xo + 0.5) / s - 0.5;  // half_pixel, pytorch_half_pixel
  };
  auto pick = [&](double v, std::size_t n) {
    double k;
    const double fl = std::floor(v);
    if (nearest_mode == "floor")
      k = fl;
    else if (nearest_mode == "ceil")
      k = std::ceil(v);
    else if (v - fl == 0.5)
      k = nearest_mode == "round_prefer_ceil" ? fl + 1 : fl;
    else
      k = std::floor(v + 0.5);
    return static_cast<std::size_t>(std::clamp(k, 0.0, double(n - 1)));
  };
  rt y{x.t, ys, std::vector<double>(count(ys))};
  std::vector<std::size_t> xstride(r, 1);
  for (std::size_t a = r - 1; a-- > 0;) xstride[a] = xstride[a + 1] * x.s[a + 1];
  for (std::size_t i = 0; i < y.v.size(); ++i) {
    std::vector<std::size_t> o(r);
    std::size_t rem = i;
    for (std::size_t a = r; a-- > 0;) o[a] = rem % ys[a], rem /= ys[a];
    if (mode == "nearest") {
      std::size_t off = 0;
      for (std::size_t a = 0; a < r; ++a) off += pick(source(a, o[a]), x.s[a]) * xstride[a];
      y.v[i] = x.v[off];
      continue;
    }
    // linear over every axis: sum over the 2^r corners of the product of the axis weights
    double acc = 0;
    for (std::size_t corner = 0; corner < (std::size_t{1} << r); ++corner) {
      double w = 1;
      std::size_t off = 0;
      for (std::size_t a = 0; a < r; ++a) {
        const double c = std::clamp(source(a, o[a]), 0.0, double(x.s[a] - 1));
        const auto lo = static_cast<std::size_t>(std::floor(c));
        const std::size_t hi = std::min(lo + 1, x.s[a] - 1);
        const double f = c - double(lo);
        const bool up = (corner >> a) & 1;
        w *= up ? f : 1 - f;
        off += (up ? hi : lo) * xstride[a];
      }
      acc += w * x.v[off];
    }
    y.v[i] = acc;
  }
  return y;
}

tg::graph resize_graph(const std::vector<std::size_t>& xs, const std::vector<float>& scales, const std::vector<std::int64_t>& sizes,
                       tg::attribute_map a) {
  tg::graph g("resize");
  tg::tensor_shape s;
  for (auto d : xs) s.dims.emplace_back(d);
  g.add_input("x", dtype::f32, s);
  g.add_constant<float>("roi", {0}, std::vector<float>{});
  if (!scales.empty()) {
    g.add_constant<float>("scales", {static_cast<std::int64_t>(scales.size())}, scales);
    g.add_node("Resize", "rs", {"x", "roi", "scales"}, {"y"}, std::move(a));
  } else {
    g.add_constant<float>("scales", {0}, std::vector<float>{});
    g.add_constant<std::int64_t>("sizes", {static_cast<std::int64_t>(sizes.size())}, sizes);
    g.add_node("Resize", "rs", {"x", "roi", "scales", "sizes"}, {"y"}, std::move(a));
  }
  g.mark_output("y");
  return g;
}

TEST_CASE("Resize: nearest and linear, every coordinate mode PyTorch exports, scales or sizes, against fp64", "[graph][executor][resize]") {
  host_device dev(2);
  struct mode_case {
    std::string mode, ctm, nearest;
  };
  const std::vector<mode_case> modes = {
      {"nearest", "asymmetric", "floor"},  // nn.Upsample(mode="nearest")
      {"nearest", "half_pixel", "round_prefer_floor"},
      {"nearest", "half_pixel", "round_prefer_ceil"},
      {"nearest", "align_corners", "round_prefer_floor"},
      {"nearest", "pytorch_half_pixel", "ceil"},
      {"linear", "half_pixel", ""},
      {"linear", "pytorch_half_pixel", ""},  // bilinear, align_corners=False
      {"linear", "align_corners", ""},
      {"linear", "asymmetric", ""},
  };
  const std::vector<std::size_t> xs = {2, 3, 5, 4};
  const rt x = rand_rt(xs, 431);
  // (scales, sizes): upsampling by 2, a fractional up and down scale, an output of one pixel
  const std::vector<std::pair<std::vector<float>, std::vector<std::int64_t>>> shapes = {
      {{1, 1, 2, 2}, {}}, {{1, 1, 1.5f, 0.5f}, {}}, {{}, {2, 3, 7, 3}}, {{}, {2, 3, 1, 9}}};
  for (const auto& m : modes)
    for (const auto& [sc, sz] : shapes) {
      tg::attribute_map a{{"mode", m.mode}, {"coordinate_transformation_mode", m.ctm}};
      if (!m.nearest.empty()) a["nearest_mode"] = m.nearest;
      const tg::graph g = resize_graph(xs, sc, sz, a);
      auto exe = tg::compile(g, dev);
      const auto out = exe.run({{"x", to_host(x)}});
      std::vector<std::size_t> ys;
      std::vector<double> scales;
      for (std::size_t k = 0; k < xs.size(); ++k) {
        ys.push_back(sc.empty() ? std::size_t(sz[k]) : std::size_t(std::floor(double(xs[k]) * sc[k])));
        scales.push_back(sc.empty() ? double(ys[k]) / double(xs[k]) : double(sc[k]));
      }
      // nearest copies an input element: exact. Linear: a few f32 roundings of values in [-1, 1].
      check_close(out.at("y"), resize_reference(x, ys, scales, m.mode, m.ctm, m.nearest), 0, m.mode == "nearest" ? 0.0 : 8 * u32,
                  m.mode + "/" + m.ctm + "/" + m.nearest + nm(" ys[2]=", ys[2]));
    }
  // nearest on every axis, a rank-3 input and an i64 tensor (copied, any dtype)
  {
    tg::graph g("resize_i64");
    g.add_input("x", dtype::i64, {2, 3, 2});
    g.add_constant<float>("roi", {0}, std::vector<float>{});
    g.add_constant<float>("scales", {3}, std::vector<float>{2, 1, 3});
    g.add_node(
        "Resize", "rs", {"x", "roi", "scales"}, {"y"},
        {{"mode", std::string("nearest")}, {"coordinate_transformation_mode", std::string("asymmetric")}, {"nearest_mode", std::string("floor")}});
    g.mark_output("y");
    std::vector<std::int64_t> xv(12);
    for (std::size_t i = 0; i < 12; ++i) xv[i] = std::int64_t(i) * 7 - 20;
    const auto y = tg::compile(g, dev).run({{"x", tg::host_tensor::of<std::int64_t>({2, 3, 2}, xv)}}).at("y");
    REQUIRE(y.shape == std::vector<std::int64_t>{4, 3, 6});
    const auto yv = y.values<std::int64_t>();
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t j = 0; j < 3; ++j)
        for (std::size_t k = 0; k < 6; ++k) CHECK(yv[(i * 3 + j) * 6 + k] == xv[((i / 2) * 3 + j) * 2 + k / 3]);
  }
}

TEST_CASE("Resize's unsupported attribute values are graph_error(unsupported) naming the node", "[graph][executor][resize][errors]") {
  host_device dev(1);
  const std::vector<std::size_t> xs = {1, 1, 4, 4};
  const std::vector<std::pair<tg::attribute_map, std::string>> bad = {
      {{{"mode", std::string("cubic")}}, "mode 'cubic'"},
      {{{"coordinate_transformation_mode", std::string("tf_crop_and_resize")}}, "coordinate_transformation_mode 'tf_crop_and_resize'"},
      {{{"coordinate_transformation_mode", std::string("half_pixel_symmetric")}}, "coordinate_transformation_mode 'half_pixel_symmetric'"},
      {{{"nearest_mode", std::string("round_half_even")}}, "nearest_mode 'round_half_even'"},
      {{{"antialias", std::int64_t{1}}}, "antialias"},
  };
  for (const auto& [a, what] : bad)
    CHECK_THROWS_MATCHES(tg::compile(resize_graph(xs, {1, 1, 2, 2}, {}, a), dev), graph_error,
                         is_error(errc::unsupported, "graph", "Resize 'rs': " + what));
  // linear on a leading axis is not bilinear on the last two
  CHECK_THROWS_MATCHES(tg::compile(resize_graph(xs, {1, 2, 2, 2}, {}, {{"mode", std::string("linear")}}), dev), graph_error,
                       is_error(errc::unsupported, "graph", "Resize 'rs': linear resize of axis 1"));
}

}  // namespace tessel_test_graph_executor
