// graph/onnx.hpp: the committed tiny models (tests/graph/onnx/, written by tools/torch/onnx_models.py
// --tiny) import with their ops, symbolic batch and every shape inferred; an opset-11 model goes
// through ONNX's version converter; initializers in every storage form; and every malformed or
// hostile model is a graph_error with the expected code naming the node or tensor.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/graph/onnx.hpp>
#include "error_match.hpp"

namespace tessel_test_onnx_import {

namespace tg = tessel::graph;
namespace fs = std::filesystem;
using tessel::dtype;
using tessel::errc;
using tessel_test::is_error;

const fs::path data_dir = TESSEL_ONNX_TEST_DATA;

std::string type_of(const tg::graph& g, const std::string& v) { return g.get(g.value_named(v)).type_info().to_string(); }

// Every live value has a dtype and a fully known shape, except the symbolic batch dims.
void require_all_shapes(const tg::graph& g) {
  std::size_t checked = 0;
  for (tg::node_id id : g.node_ids())
    for (tg::value_id v : g.get(id).outputs) {
      if (v == tg::value_id::none) continue;
      const tg::value& x = g.get(v);
      INFO(x.name << ": " << x.type_info().to_string());
      REQUIRE(x.type.has_value());
      REQUIRE(x.shape.rank_known);
      for (const tg::dim& d : x.shape.dims) REQUIRE((d.known() || d.symbol == "batch"));
      ++checked;
    }
  REQUIRE(checked > 0);
}

// ---- a model built here, so that each test can break one thing ----------------------------------

onnx::ModelProto tiny_model(int opset = 17) {
  onnx::ModelProto m;
  m.set_ir_version(8);
  m.set_producer_name("tessel-test");
  auto* imp = m.add_opset_import();
  imp->set_domain("");
  imp->set_version(opset);
  auto* g = m.mutable_graph();
  g->set_name("mlp");
  auto* x = g->add_input();
  x->set_name("x");
  auto* tt = x->mutable_type()->mutable_tensor_type();
  tt->set_elem_type(onnx::TensorProto::FLOAT);
  tt->mutable_shape()->add_dim()->set_dim_param("batch");
  tt->mutable_shape()->add_dim()->set_dim_value(4);
  auto* w = g->add_initializer();  // raw_data
  w->set_name("w");
  w->set_data_type(onnx::TensorProto::FLOAT);
  w->add_dims(4);
  w->add_dims(3);
  std::vector<float> wv(12);
  for (int i = 0; i < 12; ++i) wv[static_cast<std::size_t>(i)] = 0.5f * static_cast<float>(i);
  w->set_raw_data(std::string(reinterpret_cast<const char*>(wv.data()), wv.size() * sizeof(float)));
  auto* b = g->add_initializer();  // float_data
  b->set_name("b");
  b->set_data_type(onnx::TensorProto::FLOAT);
  b->add_dims(3);
  for (float v : {1.0f, 2.0f, 3.0f}) b->add_float_data(v);
  auto* mm = g->add_node();
  mm->set_op_type("MatMul");
  mm->set_name("fc");
  mm->add_input("x");
  mm->add_input("w");
  mm->add_output("h");
  auto* add = g->add_node();
  add->set_op_type("Add");
  add->set_name("bias");
  add->add_input("h");
  add->add_input("b");
  add->add_output("z");
  auto* relu = g->add_node();
  relu->set_op_type("Relu");
  relu->set_name("act");
  relu->add_input("z");
  relu->add_output("y");
  auto* y = g->add_output();
  y->set_name("y");
  auto* yt = y->mutable_type()->mutable_tensor_type();
  yt->set_elem_type(onnx::TensorProto::FLOAT);
  yt->mutable_shape()->add_dim()->set_dim_param("batch");
  yt->mutable_shape()->add_dim()->set_dim_value(3);
  return m;
}

std::string bytes_of(const onnx::ModelProto& m) {
  std::string s;
  REQUIRE(m.SerializeToString(&s));
  return s;
}

tg::graph import(const onnx::ModelProto& m, tg::onnx_options o = {}) { return tg::import_onnx_bytes(bytes_of(m), o); }

onnx::NodeProto* node_named(onnx::ModelProto& m, const std::string& name) {
  for (auto& n : *m.mutable_graph()->mutable_node())
    if (n.name() == name) return &n;
  FAIL("no node " << name);
  return nullptr;
}

onnx::TensorProto* initializer(onnx::ModelProto& m, const std::string& name) {
  for (auto& t : *m.mutable_graph()->mutable_initializer())
    if (t.name() == name) return &t;
  FAIL("no initializer " << name);
  return nullptr;
}

std::vector<float> floats_of(const tg::graph& g, const std::string& name) {
  const tg::value& x = g.get(g.value_named(name));
  REQUIRE(x.data);
  std::vector<float> v(x.data->size() / 4);
  std::memcpy(v.data(), x.data->data(), x.data->size());
  return v;
}

// A scratch directory per test (external data files).
struct scratch {
  fs::path dir;
  explicit scratch(const std::string& name) : dir(fs::temp_directory_path() / ("tessel_onnx_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~scratch() { fs::remove_all(dir); }
  void write(const std::string& file, const std::string& bytes) const {
    std::ofstream(dir / file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
};

// ---- the committed models --------------------------------------------------------------------------

TEST_CASE("onnx: the committed tiny models import with every shape inferred", "[onnx][import]") {
  struct expect {
    const char* file;
    std::size_t nodes;
    std::map<std::string, std::size_t> ops;  // a few counts that must match exactly
    const char* input;
    const char* input_type;
    const char* output_type;
  };
  const std::vector<expect> cases = {
      // Counts from ONNX's own Python reader; Constant nodes (11, 17, 36, 2) are constants here.
      {"gpt2_tiny_op17.onnx",
       43,
       {{"LayerNormalization", 3}, {"MatMul", 7}, {"Softmax", 1}, {"Tanh", 1}, {"Split", 1}},
       "ids",
       "i64[batch,4]",
       "f32[batch,4,11]"},
      {"gpt2_tiny_op14.onnx", 67, {{"ReduceMean", 6}, {"Softmax", 1}, {"Sqrt", 3}}, "ids", "i64[batch,4]", "f32[batch,4,11]"},
      {"llama_tiny_op17.onnx",
       65,
       {{"Softmax", 1}, {"Sigmoid", 1}, {"Neg", 2}, {"Slice", 4}, {"MatMul", 10}},
       "ids",
       "i64[batch,4]",
       "f32[batch,4,11]"},
      {"unet_tiny_op17.onnx", 27, {{"Conv", 11}, {"Resize", 2}, {"MaxPool", 2}, {"Concat", 2}}, "image", "f32[batch,3,8,8]", "f32[batch,2,8,8]"},
  };
  for (const expect& e : cases) {
    INFO(e.file);
    tg::onnx_import_info info;
    tg::onnx_options o;
    o.info = &info;
    const tg::graph g = tg::import_onnx(data_dir / e.file, o);
    const auto hist = g.count_by_op();
    CHECK(hist.count("Constant") == 0);  // Constant nodes become graph constants
    for (const auto& [op, n] : e.ops) {
      INFO(op);
      CHECK((hist.count(op) ? hist.at(op) : 0) == n);
    }
    CHECK(g.node_count() == e.nodes);
    REQUIRE(g.inputs().size() == 1);
    CHECK(g.get(g.inputs()[0]).name == e.input);
    CHECK(type_of(g, e.input) == e.input_type);
    REQUIRE(g.outputs().size() == 1);
    CHECK(g.get(g.outputs()[0]).type_info().to_string() == e.output_type);
    CHECK_FALSE(info.converted);
    CHECK(info.producer.rfind("pytorch", 0) == 0);
    require_all_shapes(g);
  }
}

TEST_CASE("onnx: an opset-11 model is converted to 13 and says so", "[onnx][import]") {
  tg::onnx_import_info info;
  tg::onnx_options o;
  o.info = &info;
  const tg::graph g = tg::import_onnx(data_dir / "unet_tiny_op11.onnx", o);
  CHECK(info.opset == 11);
  CHECK(info.imported_opset == 13);
  CHECK(info.converted);
  REQUIRE_FALSE(info.notes.empty());
  CHECK(info.notes[0].find("converted from opset 11 to 13") != std::string::npos);
  CHECK(g.count_by_op().at("Resize") == 2);
  CHECK(g.get(g.outputs()[0]).type_info().to_string() == "f32[batch,2,8,8]");
  require_all_shapes(g);
}

// ---- storage forms ---------------------------------------------------------------------------------

TEST_CASE("onnx: the model built here imports, raw_data and float_data alike", "[onnx][import]") {
  const tg::graph g = import(tiny_model());
  CHECK(g.name() == "mlp");
  CHECK(type_of(g, "x") == "f32[batch,4]");
  CHECK(type_of(g, "y") == "f32[batch,3]");
  CHECK(floats_of(g, "w")[11] == 5.5f);
  CHECK(floats_of(g, "b") == std::vector<float>{1, 2, 3});
  for (int opset : {13, 14, 15, 16, 17}) CHECK(import(tiny_model(opset)).node_count() == 3);
}

TEST_CASE("onnx: typed fields of every integer and 16-bit type", "[onnx][import]") {
  struct row {
    int code;
    dtype t;
    std::vector<std::int64_t> in;
  };
  for (const row& r : std::vector<row>{{onnx::TensorProto::INT8, dtype::i8, {-128, 127}},
                                       {onnx::TensorProto::UINT8, dtype::u8, {0, 255}},
                                       {onnx::TensorProto::INT16, dtype::i16, {-32768, 32767}},
                                       {onnx::TensorProto::INT32, dtype::i32, {-5, 7}},
                                       {onnx::TensorProto::FLOAT16, dtype::fp16, {0x3c00, 0xc000}},
                                       {onnx::TensorProto::BFLOAT16, dtype::bf16, {0x3f80, 0x4000}},
                                       {onnx::TensorProto::BOOL, dtype::u8, {0, 1}}}) {
    INFO(r.code);
    onnx::ModelProto m = tiny_model();
    auto* t = m.mutable_graph()->add_initializer();
    t->set_name("extra");
    t->set_data_type(r.code);
    t->add_dims(2);
    for (std::int64_t v : r.in) t->add_int32_data(static_cast<std::int32_t>(v));
    auto* out = m.mutable_graph()->add_output();
    out->set_name("extra");
    const tg::graph g = import(m);
    const tg::value& x = g.get(g.value_named("extra"));
    CHECK(x.type == r.t);
    CHECK(x.data->size() == 2 * tessel::dtype_size(r.t));
  }
  onnx::ModelProto m = tiny_model();
  auto* t = m.mutable_graph()->add_initializer();
  t->set_name("i64s");
  t->set_data_type(onnx::TensorProto::INT64);
  t->add_dims(3);
  for (std::int64_t v : tg::ints{-1, 0, std::int64_t{1} << 40}) t->add_int64_data(v);
  m.mutable_graph()->add_output()->set_name("i64s");
  const tg::graph g = import(m);
  CHECK(g.constant_ints(g.value_named("i64s")) == tg::ints{-1, 0, 1LL << 40});
}

TEST_CASE("onnx: Constant nodes of every value kind become constants", "[onnx][import]") {
  onnx::ModelProto m = tiny_model();
  auto add_const = [&](const std::string& out, auto fill) {
    auto* n = m.mutable_graph()->add_node();
    n->set_op_type("Constant");
    n->set_name("c_" + out);
    n->add_output(out);
    fill(n->add_attribute());
    m.mutable_graph()->add_output()->set_name(out);
  };
  add_const("vi", [](onnx::AttributeProto* a) {
    a->set_name("value_int");
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(7);
  });
  add_const("vis", [](onnx::AttributeProto* a) {
    a->set_name("value_ints");
    a->set_type(onnx::AttributeProto::INTS);
    a->add_ints(1);
    a->add_ints(2);
  });
  add_const("vf", [](onnx::AttributeProto* a) {
    a->set_name("value_float");
    a->set_type(onnx::AttributeProto::FLOAT);
    a->set_f(0.25f);
  });
  add_const("vfs", [](onnx::AttributeProto* a) {
    a->set_name("value_floats");
    a->set_type(onnx::AttributeProto::FLOATS);
    a->add_floats(1.5f);
  });
  add_const("vt", [](onnx::AttributeProto* a) {
    a->set_name("value");
    a->set_type(onnx::AttributeProto::TENSOR);
    auto* t = a->mutable_t();
    t->set_data_type(onnx::TensorProto::DOUBLE);
    t->add_dims(2);
    t->add_double_data(1.0);
    t->add_double_data(-2.0);
  });
  const tg::graph g = import(m);
  CHECK(type_of(g, "vi") == "i64[]");
  CHECK(g.constant_ints(g.value_named("vis")) == tg::ints{1, 2});
  CHECK(floats_of(g, "vf") == std::vector<float>{0.25f});
  CHECK(type_of(g, "vfs") == "f32[1]");
  CHECK(type_of(g, "vt") == "f64[2]");
}

TEST_CASE("onnx: a graph input that is also an initializer is a constant", "[onnx][import]") {
  onnx::ModelProto m = tiny_model();
  auto* in = m.mutable_graph()->add_input();
  in->set_name("w");
  in->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
  tg::onnx_import_info info;
  tg::onnx_options o;
  o.info = &info;
  const tg::graph g = import(m, o);
  CHECK(g.inputs().size() == 1);
  CHECK(g.get(g.value_named("w")).role == tg::value_role::constant);
  CHECK(info.notes.size() == 1);
}

TEST_CASE("onnx: attributes of every kind the IR holds", "[onnx][import]") {
  onnx::ModelProto m = tiny_model();
  auto* n = node_named(m, "act");
  auto attr = [&](const std::string& name, onnx::AttributeProto::AttributeType t) {
    auto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(t);
    return a;
  };
  attr("i", onnx::AttributeProto::INT)->set_i(-3);
  attr("f", onnx::AttributeProto::FLOAT)->set_f(0.5f);
  attr("s", onnx::AttributeProto::STRING)->set_s("text");
  auto* is = attr("is", onnx::AttributeProto::INTS);
  is->add_ints(1);
  is->add_ints(2);
  attr("fs", onnx::AttributeProto::FLOATS)->add_floats(2.5f);
  attr("ss", onnx::AttributeProto::STRINGS)->add_strings("a");
  const tg::graph g = import(m);
  const tg::node& act = g.get(g.node_named("act"));
  CHECK(act.get_int("i") == -3);
  CHECK(act.get_float("f") == 0.5);
  CHECK(act.get_string("s") == "text");
  CHECK(act.get_ints("is") == tg::ints{1, 2});
  CHECK(act.get_floats("fs") == tg::floats{2.5});
  CHECK(act.get_strings("ss") == tg::strings{"a"});
}

TEST_CASE("onnx: external data next to the model, with offset and length", "[onnx][import]") {
  scratch s("external");
  onnx::ModelProto m = tiny_model();
  auto* w = initializer(m, "w");
  const std::string raw = w->raw_data();
  w->clear_raw_data();
  w->set_data_location(onnx::TensorProto::EXTERNAL);
  auto kv = [&](const std::string& k, const std::string& v) {
    auto* e = w->add_external_data();
    e->set_key(k);
    e->set_value(v);
  };
  kv("location", "weights.bin");
  kv("offset", "16");
  kv("length", std::to_string(raw.size()));
  s.write("weights.bin", std::string(16, 'x') + raw + "tail");
  s.write("model.onnx", bytes_of(m));
  const tg::graph g = tg::import_onnx(s.dir / "model.onnx");
  CHECK(floats_of(g, "w")[11] == 5.5f);

  SECTION("from bytes, the directory must be given") {
    CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "initializer 'w'"));
    tg::onnx_options o;
    o.external_data_dir = s.dir;
    CHECK(floats_of(import(m, o), "w")[0] == 0.0f);
  }
  SECTION("a file too short") {
    s.write("weights.bin", std::string(16, 'x') + raw.substr(0, 20));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error,
                         is_error(errc::out_of_range, "graph", "initializer 'w': external data file 'weights.bin' is too short"));
  }
  SECTION("an offset past the end, or one that is not a number") {
    w->mutable_external_data(1)->set_value("100000");
    s.write("model.onnx", bytes_of(m));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error, is_error(errc::out_of_range, "graph", "initializer 'w'"));
    w->mutable_external_data(1)->set_value("99999999999999999999999");
    s.write("model.onnx", bytes_of(m));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error, is_error(errc::format, "graph", "initializer 'w'"));
  }
  SECTION("a length that is not the tensor's") {
    w->mutable_external_data(2)->set_value("8");
    s.write("model.onnx", bytes_of(m));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error,
                         is_error(errc::format, "graph", "initializer 'w': external data holds 8 bytes"));
  }
  SECTION("paths that leave the model's directory") {
    for (const char* bad : {"../weights.bin", "/etc/passwd", "sub/../../x"}) {
      INFO(bad);
      w->mutable_external_data(0)->set_value(bad);
      s.write("model.onnx", bytes_of(m));
      CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error,
                           is_error(errc::invalid_argument, "graph", "initializer 'w': external data location"));
    }
    fs::create_directory_symlink(fs::temp_directory_path(), s.dir / "link");
    w->mutable_external_data(0)->set_value("link/weights.bin");
    s.write("model.onnx", bytes_of(m));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error,
                         is_error(errc::invalid_argument, "graph", "resolves outside the model's directory"));
  }
  SECTION("a missing file") {
    w->mutable_external_data(0)->set_value("nothere.bin");
    s.write("model.onnx", bytes_of(m));
    CHECK_THROWS_MATCHES(tg::import_onnx(s.dir / "model.onnx"), tg::graph_error, is_error(errc::io, "graph", "nothere.bin"));
  }
}

// ---- malformed and hostile models -------------------------------------------------------------------

TEST_CASE("onnx: bytes that are not a model", "[onnx][malformed]") {
  const std::string good = bytes_of(tiny_model());
  for (std::size_t cut : {good.size() / 3, good.size() / 2, good.size() - 1}) {
    INFO(cut);
    CHECK_THROWS_MATCHES(tg::import_onnx_bytes(good.substr(0, cut)), tg::graph_error, is_error(errc::format, "graph", "not an ONNX ModelProto"));
  }
  CHECK_THROWS_MATCHES(tg::import_onnx_bytes("\xff\xff\xff\xff this is not protobuf"), tg::graph_error,
                       is_error(errc::format, "graph", "not an ONNX ModelProto"));
  CHECK_THROWS_MATCHES(tg::import_onnx_bytes(""), tg::graph_error, is_error(errc::unsupported, "graph", "IR version 0"));
  CHECK_THROWS_MATCHES(tg::import_onnx("/nonexistent/model.onnx"), tg::graph_error, is_error(errc::io, "graph", "/nonexistent/model.onnx"));
}

TEST_CASE("onnx: opsets outside 13..17", "[onnx][malformed]") {
  CHECK_THROWS_MATCHES(import(tiny_model(18)), tg::graph_error, is_error(errc::unsupported, "graph", "opset 18 is newer"));
  onnx::ModelProto m = tiny_model();
  m.mutable_opset_import(0)->set_domain("com.example");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "imports no opset of the default domain"));
  // An old model the checker rejects (a node without its required input) is an error, not a crash.
  onnx::ModelProto old = tiny_model(9);
  node_named(old, "fc")->mutable_input()->RemoveLast();
  CHECK_THROWS_MATCHES(import(old), tg::graph_error, is_error(errc::format, "graph", "ONNX's checker rejects"));
  // A valid old one converts.
  tg::onnx_import_info info;
  tg::onnx_options o;
  o.info = &info;
  CHECK(import(tiny_model(9), o).node_count() == 3);
  CHECK(info.converted);
}

TEST_CASE("onnx: wrong and overflowing tensor sizes name the tensor", "[onnx][malformed]") {
  onnx::ModelProto m = tiny_model();
  initializer(m, "w")->mutable_raw_data()->resize(40);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "initializer 'w': raw_data holds 40 bytes"));

  m = tiny_model();
  initializer(m, "b")->add_float_data(4.0f);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "initializer 'b': float_data holds 4 values"));

  m = tiny_model();
  auto* w = initializer(m, "w");
  w->clear_dims();
  for (int k = 0; k < 4; ++k) w->add_dims(1LL << 40);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::overflow, "graph", "initializer 'w'"));

  m = tiny_model();
  w = initializer(m, "w");
  w->clear_dims();
  w->add_dims(std::int64_t{1} << 62);  // the element count fits, the byte count does not
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::overflow, "graph", "initializer 'w': its byte size overflows"));

  m = tiny_model();
  initializer(m, "w")->set_dims(0, -4);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "initializer 'w': dim -4"));

  m = tiny_model();
  initializer(m, "b")->set_data_type(onnx::TensorProto::STRING);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "initializer 'b': ONNX STRING"));

  m = tiny_model();
  auto* t = m.mutable_graph()->add_initializer();
  t->set_name("small");
  t->set_data_type(onnx::TensorProto::INT8);
  t->add_dims(1);
  t->add_int32_data(300);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "initializer 'small': int32_data value 300"));
}

TEST_CASE("onnx: unknown ops, control flow and tensor attributes", "[onnx][malformed]") {
  onnx::ModelProto m = tiny_model();
  node_named(m, "act")->set_op_type("Mystery");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "Mystery 'act': unknown op 'Mystery'"));
  tg::onnx_options o;
  o.allow_unknown_ops = true;
  const tg::graph g = import(m, o);
  CHECK(g.get(g.value_named("y")).type_info().to_string() == "f32[batch,3]");  // the declared output type stands

  m = tiny_model();
  node_named(m, "act")->set_domain("com.example");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "unknown op 'com.example::Relu'"));

  m = tiny_model();
  auto* n = node_named(m, "act");
  n->set_op_type("If");
  auto* a = n->add_attribute();
  a->set_name("then_branch");
  a->set_type(onnx::AttributeProto::GRAPH);
  a->mutable_g()->set_name("sub");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "If 'act': attribute 'then_branch' is a subgraph"));

  m = tiny_model();
  a = node_named(m, "act")->add_attribute();
  a->set_name("t");
  a->set_type(onnx::AttributeProto::TENSOR);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "Relu 'act': attribute 't' is a tensor"));

  m = tiny_model();
  a = node_named(m, "act")->add_attribute();
  a->set_name("nokind");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "Relu 'act': attribute 'nokind' has no attribute type"));
}

TEST_CASE("onnx: graphs that break the IR's rules", "[onnx][malformed]") {
  onnx::ModelProto m = tiny_model();
  node_named(m, "fc")->set_input(0, "nothing");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "MatMul 'fc': input 'nothing' is not defined"));

  m = tiny_model();  // fc reads y, which act makes from fc's output: a cycle
  node_named(m, "fc")->set_input(0, "y");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "graph has a cycle: MatMul 'fc'"));

  m = tiny_model();  // inner dims 4 against 5
  initializer(m, "w")->set_dims(0, 5);
  initializer(m, "w")->mutable_raw_data()->resize(5 * 3 * 4);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "MatMul 'fc': inner dims 4 and 5 differ"));

  m = tiny_model();  // the declared output contradicts inference
  m.mutable_graph()->mutable_output(0)->mutable_type()->mutable_tensor_type()->mutable_shape()->mutable_dim(1)->set_dim_value(7);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "Relu 'act': output 'y' is declared f32[batch,7]"));

  m = tiny_model();  // two producers of h
  node_named(m, "bias")->set_output(0, "h");
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "output 'h'"));

  m = tiny_model();  // a graph input of a type tessel lacks
  m.mutable_graph()->mutable_input(0)->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::COMPLEX64);
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "graph input 'x': ONNX COMPLEX64"));

  m = tiny_model();  // a sequence input
  m.mutable_graph()->mutable_input(0)->mutable_type()->mutable_sequence_type();
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::unsupported, "graph", "graph input 'x' is not a tensor"));

  m = tiny_model();  // a Constant with two values
  auto* c = m.mutable_graph()->add_node();
  c->set_op_type("Constant");
  c->set_name("two");
  c->add_output("k");
  for (const char* key : {"value_int", "value_float"}) {
    auto* a = c->add_attribute();
    a->set_name(key);
    a->set_type(onnx::AttributeProto::INT);
  }
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::format, "graph", "Constant 'two': a Constant has exactly one value attribute"));
}

}  // namespace tessel_test_onnx_import

namespace tessel_test_onnx_import {

TEST_CASE("onnx: ONNX's checker on request", "[onnx][import]") {
  tg::onnx_options o;
  o.onnx_checker = true;
  CHECK(import(tiny_model(), o).node_count() == 3);
  onnx::ModelProto m = tiny_model();
  node_named(m, "fc")->mutable_input()->RemoveLast();  // MatMul with one input
  CHECK_THROWS_MATCHES(import(m, o), tg::graph_error, is_error(errc::format, "graph", "ONNX's checker rejects the model"));
  // Without it, the IR's own rule says the same, naming the node.
  CHECK_THROWS_MATCHES(import(m), tg::graph_error, is_error(errc::invalid_argument, "graph", "MatMul 'fc': takes 2 inputs, not 1"));
}

}  // namespace tessel_test_onnx_import
