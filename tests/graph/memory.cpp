// graph/memory.hpp: the activation plan of the transformer block and the MLP. Checked by brute force,
// not by the planner's own structures: two values live at the same op never share bytes unless one
// took the other's buffer in place; lifetimes are the topological positions of producer and last
// reader; elementwise ops reuse a dying input; the arena beats one buffer per tensor; unknown sizes
// are left out; sizes that overflow are errc::overflow naming the value.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <tessel/graph.hpp>
#include "error_match.hpp"
#include "graph/graph_models.hpp"

namespace tessel_test_graph_memory {

using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;
using namespace tessel_test_graph;
using tg::graph_error;

struct check_result {
  std::size_t overlaps = 0, misaligned = 0, in_place_moved = 0;
  std::string first_overlap;
};

// Every pair of planned values: if their lifetimes meet and their byte ranges meet, one must have
// taken the other's buffer in place (the same in-place chain).
check_result brute_force(const tg::activation_plan& a, std::size_t alignment, bool allow_in_place = true) {
  check_result r;
  const auto& t = a.tensors;
  const std::size_t n = t.size();
  std::vector<std::size_t> chain(n);
  for (std::size_t i = 0; i < n; ++i) {
    chain[i] = allow_in_place && t[i].bytes > 0 && t[i].reuse_input ? chain[*t[i].reuse_input] : i;
    if (chain[i] != i && a.plan.offset[i] != a.plan.offset[*t[i].reuse_input]) ++r.in_place_moved;
    if (a.plan.offset[i] % alignment != 0) ++r.misaligned;
  }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j) {
      if (t[i].bytes == 0 || t[j].bytes == 0 || chain[i] == chain[j]) continue;
      const bool live_together = t[i].first <= t[j].last && t[j].first <= t[i].last;
      const std::size_t oi = a.plan.offset[i], oj = a.plan.offset[j];
      const bool share = oi < oj + t[j].bytes && oj < oi + t[i].bytes;
      if (live_together && share) {
        if (r.overlaps++ == 0) r.first_overlap = t[i].name + " and " + t[j].name;
      }
    }
  return r;
}

std::size_t position(const tg::graph& g, const tg::activation_plan& a, const std::string& node) {
  const tg::node_id id = g.node_named(node);
  for (std::size_t i = 0; i < a.order.size(); ++i)
    if (a.order[i] == id) return i;
  FAIL("node " << node << " is not in the order");
  return 0;
}

const tessel::tensor_life& life_of(const tg::graph& g, const tg::activation_plan& a, const std::string& v) {
  const tg::value_id id = g.value_named(v);
  for (std::size_t i = 0; i < a.values.size(); ++i)
    if (a.values[i] == id) return a.tensors[i];
  FAIL("value " << v << " is not planned");
  return a.tensors.front();
}

TEST_CASE("graph: the transformer block's activation plan is valid and reuses buffers", "[graph][memory]") {
  tg::graph g = make_transformer_block();
  g.infer_shapes();
  const tessel::plan_options opt{};
  const tg::activation_plan a = tg::plan_activations(g, opt, {{"batch", 2}});

  // Every node output but the graph output y: 29 nodes, one output each.
  CHECK(a.values.size() == 28);
  CHECK(a.unknown_size == 0);
  CHECK(a.order == g.topological_order());
  for (tg::value_id v : a.values) {
    CHECK(g.get(v).role == tg::value_role::node_output);
    CHECK(!g.get(v).is_output);
  }
  CHECK(!a.offset_of(g.value_named("x")));
  CHECK(!a.offset_of(g.value_named("y")));
  CHECK(!a.offset_of(g.value_named("wq")));

  // Sizes: batch 2, f32.
  CHECK(life_of(g, a, "n1").bytes == 2 * 6 * 32 * 4);
  CHECK(life_of(g, a, "s").bytes == 2 * 4 * 6 * 6 * 4);
  CHECK(life_of(g, a, "u_act").bytes == 2 * 6 * 128 * 4);
  // Lifetimes: from the producer to the last reader, in topological positions.
  CHECK(life_of(g, a, "n1").first == position(g, a, "ln1"));
  CHECK(life_of(g, a, "n1").last == position(g, a, "proj_v"));
  CHECK(life_of(g, a, "r").first == position(g, a, "residual1"));
  CHECK(life_of(g, a, "r").last == position(g, a, "residual2"));
  CHECK(life_of(g, a, "p").last == position(g, a, "context"));

  const check_result c = brute_force(a, opt.alignment);
  CHECK(c.overlaps == 0);
  INFO(c.first_overlap);
  CHECK(c.misaligned == 0);
  CHECK(c.in_place_moved == 0);

  // In place: the bias Adds over their MatMul, Gelu, the Reshapes, the scaling Mul, the residual Add
  // over attn (x is a graph input, not planned).
  CHECK(a.plan.in_place > 0);
  for (const char* v : {"q", "k", "v", "q_heads", "s_scaled", "u_act", "r", "attn", "d", "cm"}) {
    INFO(v);
    CHECK(life_of(g, a, v).reuse_input.has_value());
  }
  CHECK(a.offset_of(g.value_named("u_act")) == a.offset_of(g.value_named("u")));
  // Not in place: Softmax, MatMul, Transpose, LayerNormalization.
  for (const char* v : {"p", "s", "qt", "n1", "n2"}) {
    INFO(v);
    CHECK(!life_of(g, a, v).reuse_input.has_value());
  }
  CHECK(a.plan.arena_bytes < a.plan.unplanned_bytes);
  CHECK(a.plan.arena_bytes >= a.plan.lower_bound_bytes);
  std::size_t sum = 0;
  for (const auto& t : a.tensors) sum += (t.bytes + opt.alignment - 1) / opt.alignment * opt.alignment;
  CHECK(a.plan.unplanned_bytes == sum);

  const std::string report = a.report();
  CHECK(report.rfind(std::string("activations: 28 tensors (") + std::to_string(a.plan.in_place) + " in place, 0 of unknown size): peak ", 0) == 0);
  CHECK(report.find(" planned vs ") != std::string::npos);
  CHECK(report.find(" one buffer per tensor vs lower bound ") != std::string::npos);

  // The same graph plans the same way.
  const tg::activation_plan b = tg::plan_activations(g, opt, {{"batch", 2}});
  CHECK(b.plan.offset == a.plan.offset);
  CHECK(b.plan.arena_bytes == a.plan.arena_bytes);
}

TEST_CASE("graph: without in-place reuse the plan stays valid and is no smaller", "[graph][memory]") {
  tg::graph g = make_transformer_block();
  g.infer_shapes();
  tessel::plan_options opt;
  opt.allow_in_place = false;
  opt.alignment = 256;
  const tg::activation_plan off = tg::plan_activations(g, opt, {{"batch", 3}});
  CHECK(off.plan.in_place == 0);
  const check_result c = brute_force(off, opt.alignment, false);
  CHECK(c.overlaps == 0);
  CHECK(c.misaligned == 0);
  opt.allow_in_place = true;
  const tg::activation_plan on = tg::plan_activations(g, opt, {{"batch", 3}});
  CHECK(brute_force(on, opt.alignment).overlaps == 0);
  CHECK(on.plan.arena_bytes <= off.plan.arena_bytes);
  CHECK(on.plan.arena_bytes < on.plan.unplanned_bytes);
}

TEST_CASE("graph: values of unknown size are left out of the plan", "[graph][memory]") {
  tg::graph g = make_transformer_block();
  g.infer_shapes();
  const tg::activation_plan a = tg::plan_activations(g);  // batch unbound
  CHECK(a.values.empty());
  CHECK(a.unknown_size == 28);
  CHECK(a.plan.arena_bytes == 0);
  CHECK(a.report().find("0 tensors (0 in place, 28 of unknown size)") != std::string::npos);
  const tg::activation_plan wrong = tg::plan_activations(g, {}, {{"seq", 2}});
  CHECK(wrong.unknown_size == 28);
  CHECK_THROWS_MATCHES(tg::plan_activations(g, {}, {{"batch", -2}}), graph_error,
                       is_error(errc::invalid_argument, "graph", "value 'n1': symbol 'batch' is bound to -2"));
}

TEST_CASE("graph: in place only over an input of the same size that dies at the op", "[graph][memory]") {
  tg::graph g;
  g.add_input("x", dtype::f32, {4, 8});
  g.add_input("row", dtype::f32, {1, 8});
  g.add_node("Relu", "r1", {"x"}, {"a"});                   // x is a graph input: a gets its own buffer
  g.add_node("Exp", "e", {"row"}, {"small"});               // [1,8]
  g.add_node("Add", "bcast", {"small", "a"}, {"b"});        // small is smaller: b may take a (dies here), not small
  g.add_node("Neg", "n", {"b"}, {"c"});                     // b dies here: c takes it
  g.add_node("Relu", "r2", {"c"}, {"d"});                   // c is read again below: d may not take it
  g.add_node("Add", "sum", {"c", "d"}, {"e2"});             // both die here: e2 takes the first that fits
  g.add_node("Cast", "half", {"e2"}, {"h"}, {{"to", 10}});  // fp16 is half as wide: no reuse
  g.add_node("Identity", "out", {"h"}, {"y"});
  g.mark_output("y");
  g.infer_shapes();
  const tg::activation_plan a = tg::plan_activations(g);
  CHECK(!life_of(g, a, "a").reuse_input);
  CHECK(!life_of(g, a, "small").reuse_input);
  const auto index_of = [&](const std::string& v) {
    for (std::size_t i = 0; i < a.values.size(); ++i)
      if (a.values[i] == g.value_named(v)) return i;
    return static_cast<std::size_t>(-1);
  };
  CHECK(life_of(g, a, "b").reuse_input == index_of("a"));
  CHECK(life_of(g, a, "c").reuse_input == index_of("b"));
  CHECK(!life_of(g, a, "d").reuse_input);
  CHECK(life_of(g, a, "e2").reuse_input == index_of("c"));
  CHECK(!life_of(g, a, "h").reuse_input);
  CHECK(a.plan.in_place == 3);
  CHECK(brute_force(a, 64).overlaps == 0);
  CHECK(a.offset_of(g.value_named("e2")) == a.offset_of(g.value_named("a")));
}

TEST_CASE("graph: the MLP's plan", "[graph][memory]") {
  tg::graph g = make_mlp();
  g.infer_shapes();
  const tg::activation_plan a = tg::plan_activations(g, {}, {{"batch", 16}});
  REQUIRE(a.values.size() == 3);  // h, a, z
  CHECK(life_of(g, a, "h").bytes == 16 * 32 * 4);
  CHECK(life_of(g, a, "a").reuse_input == std::size_t{0});  // Relu over h
  CHECK(!life_of(g, a, "z").reuse_input);                   // MatMul
  CHECK(a.plan.arena_bytes == 16 * 32 * 4 + 16 * 4 * 4);    // h/a and z live together at fc2
  CHECK(brute_force(a, 64).overlaps == 0);
}

TEST_CASE("graph: an activation whose size overflows is errc::overflow naming it", "[graph][memory]") {
  tg::graph g;
  const std::int64_t big = std::int64_t{1} << 31;
  g.add_input("x", dtype::f64, {big, big});  // 2^62 elements fit a size_t, their bytes do not
  g.add_node("Relu", "r1", {"x"}, {"t"});
  g.add_node("Relu", "r2", {"t"}, {"y"});
  g.mark_output("y");
  g.infer_shapes();
  CHECK(g.get(g.value_named("t")).shape.to_string() == "[2147483648,2147483648]");
  CHECK_THROWS_MATCHES(tg::plan_activations(g), graph_error,
                       is_error(errc::overflow, "graph", "value 't': f64[2147483648,2147483648]: size tessel::size: graph: bytes overflows"));
  tg::graph s;
  s.add_input("x", dtype::f32, {"n", big});
  s.add_node("Relu", "r1", {"x"}, {"t"});
  s.add_node("Relu", "r2", {"t"}, {"y"});
  s.mark_output("y");
  s.infer_shapes();
  CHECK_THROWS_MATCHES(tg::plan_activations(s, {}, {{"n", std::int64_t{1} << 40}}), graph_error, is_error(errc::overflow, "graph", "value 't'"));
}

}  // namespace tessel_test_graph_memory
