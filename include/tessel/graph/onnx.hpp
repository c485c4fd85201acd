// ONNX import: a ModelProto (a file, or its bytes) becomes a graph::graph of the typed IR, verified
// and shape-inferred. Needs ONNX's own protobuf classes and version converter: link the CMake target
// tessel::onnx (Debian: libonnx-dev, libprotobuf-dev), which defines TESSEL_HAVE_ONNX.
//
// What the importer takes: opsets 13 to 17 of the default domain (older models are converted to 13
// by ONNX's version converter, and import_info says so; newer ones are errc::unsupported), ops of
// domain "tessel" (the fused ops), initializers in every storage form (raw_data, the typed repeated
// fields, external data files next to the model), Constant nodes (they become graph constants, not
// nodes), dim_param symbols (symbolic dims), value_info and output types (declared: inference checks
// against them). Every problem is a graph_error naming the node or tensor; hostile bytes never crash,
// hang or allocate more than the file's own size.
//
// ONNX's checker and shape inference are not run by default: the IR's verify() and infer_shapes()
// check everything this importer reads and name the node or value at fault, they know the fused
// domain, and the declared types of the file are checked against the IR's own inference. The
// checker does run before a version conversion (the converter assumes a valid model), and
// onnx_options::onnx_checker runs it always.
#pragma once

#ifndef TESSEL_HAVE_ONNX
#error \
    "tessel/graph/onnx.hpp needs ONNX: link the CMake target tessel::onnx (found when Debian's libonnx-dev and libprotobuf-dev are installed), which defines TESSEL_HAVE_ONNX=1"
#endif

#include <bit>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
// <sys/mman.h> (tessel's file mapping) defines MAP_TYPE, a name ONNX's parser.h uses as an enumerator:
// hide the macro while ONNX's headers are read, so the include order does not matter.
#pragma push_macro("MAP_TYPE")
#undef MAP_TYPE
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>
#include <onnx/version_converter/convert.h>
#pragma pop_macro("MAP_TYPE")

#include <tessel/detail/checked.hpp>
#include <tessel/graph/ir.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

// What an import found out about the file (filled when onnx_options::info points somewhere).
struct onnx_import_info {
  std::int64_t ir_version = 0;
  std::int64_t opset = 0;           // the default domain's opset of the file
  std::int64_t imported_opset = 0;  // after a version conversion (== opset when none ran)
  bool converted = false;
  std::string producer;            // producer_name and producer_version
  std::vector<std::string> notes;  // what the importer changed or chose, one line each
};

struct onnx_options {
  // false: an op without a shape rule (or of a domain other than ONNX's and "tessel") is a
  // graph_error (errc::unsupported) naming it; true: it is imported and its outputs stay unknown.
  bool allow_unknown_ops = false;
  // Where external data files are looked up: import_onnx uses the model's directory when this is
  // empty; import_onnx_bytes needs it for a model with external data.
  std::filesystem::path external_data_dir;
  // Also run ONNX's checker on every model (it always runs before a version conversion).
  bool onnx_checker = false;
  onnx_import_info* info = nullptr;
};

inline constexpr std::int64_t onnx_min_opset = 13;
inline constexpr std::int64_t onnx_max_opset = 17;

namespace detail {

static_assert(std::endian::native == std::endian::little, "ONNX's raw_data is little-endian; the importer copies it as it is");

[[noreturn]] inline void onnx_fail(errc code, const std::string& msg) { throw graph_error(code, "ONNX import: " + msg); }

inline std::string onnx_dtype_label(std::int32_t code) {
  static constexpr const char* names[] = {"UNDEFINED", "FLOAT",   "UINT8",  "INT8",   "UINT16", "INT16",     "INT32",      "INT64",   "STRING",
                                          "BOOL",      "FLOAT16", "DOUBLE", "UINT32", "UINT64", "COMPLEX64", "COMPLEX128", "BFLOAT16"};
  if (code >= 0 && code < static_cast<std::int32_t>(std::size(names))) return names[code];
  return "element type " + std::to_string(code);
}

struct onnx_tensor_data {
  dtype type{};
  std::vector<std::int64_t> dims;
  std::shared_ptr<std::vector<std::byte>> bytes;
};

// A relative path below `base`, with no '..' and no absolute root, resolved through symlinks and
// still below `base`: where an external data file may be.
inline std::filesystem::path onnx_external_path(const std::filesystem::path& base, const std::string& location, const std::string& what) {
  namespace fs = std::filesystem;
  if (location.empty()) onnx_fail(errc::format, what + ": external data without a 'location'");
  if (location.find('\0') != std::string::npos) onnx_fail(errc::format, what + ": external data location holds a NUL byte");
  const fs::path rel(location);
  if (rel.is_absolute() || rel.has_root_name() || rel.has_root_directory())
    onnx_fail(errc::invalid_argument, what + ": external data location '" + location + "' is absolute; it must be relative to the model's directory");
  for (const fs::path& part : rel)
    if (part == "..") onnx_fail(errc::invalid_argument, what + ": external data location '" + location + "' leaves the model's directory ('..')");
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(base, ec);
  if (ec) onnx_fail(errc::io, what + ": the model directory '" + base.string() + "': " + ec.message());
  const fs::path full = fs::weakly_canonical(root / rel, ec);
  if (ec) onnx_fail(errc::io, what + ": external data '" + location + "': " + ec.message());
  // A symlink may still point outside: the resolved path must keep the directory as its prefix.
  auto r = root.begin();
  auto f = full.begin();
  for (; r != root.end(); ++r, ++f)
    if (f == full.end() || *r != *f)
      onnx_fail(errc::invalid_argument, what + ": external data location '" + location + "' resolves outside the model's directory");
  return full;
}

inline std::uint64_t onnx_parse_u64(const std::string& s, const std::string& what) {
  if (s.empty() || s.size() > 20) onnx_fail(errc::format, what + " '" + s + "' is not a byte count");
  std::uint64_t v = 0;
  for (char ch : s) {
    if (ch < '0' || ch > '9') onnx_fail(errc::format, what + " '" + s + "' is not a byte count");
    const std::uint64_t d = static_cast<std::uint64_t>(ch - '0');
    if (v > (UINT64_MAX - d) / 10) onnx_fail(errc::overflow, what + " '" + s + "' overflows 64 bits");
    v = v * 10 + d;
  }
  return v;
}

inline void onnx_read_external(const onnx::TensorProto& t, const std::filesystem::path* base, std::size_t need, const std::string& what,
                               std::vector<std::byte>& out) {
  std::string location;
  std::uint64_t offset = 0;
  std::optional<std::uint64_t> length;
  for (const auto& kv : t.external_data()) {
    if (kv.key() == "location")
      location = kv.value();
    else if (kv.key() == "offset")
      offset = onnx_parse_u64(kv.value(), what + ": external data offset");
    else if (kv.key() == "length")
      length = onnx_parse_u64(kv.value(), what + ": external data length");
  }
  if (!base || base->empty())
    onnx_fail(errc::invalid_argument, what + ": stored in external file '" + location +
                                          "', but no directory to find it in (import_onnx_bytes: set onnx_options::external_data_dir)");
  const std::filesystem::path file = onnx_external_path(*base, location, what);
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec) onnx_fail(errc::io, what + ": external data file '" + location + "': " + ec.message());
  if (offset > size)
    onnx_fail(errc::out_of_range, what + ": external data offset " + std::to_string(offset) + " is past the end of '" + location + "' (" +
                                      std::to_string(size) + " bytes)");
  const std::uint64_t len = length ? *length : size - offset;
  if (len != need)
    onnx_fail(errc::format, what + ": external data holds " + std::to_string(len) + " bytes, its dtype and dims need " + std::to_string(need));
  if (len > size - offset)
    onnx_fail(errc::out_of_range, what + ": external data file '" + location + "' is too short: " + std::to_string(size) +
                                      " bytes, the tensor needs " + std::to_string(len) + " from offset " + std::to_string(offset));
  std::ifstream in(file, std::ios::binary);
  if (!in) onnx_fail(errc::io, what + ": cannot open external data file '" + location + "'");
  out.resize(need);
  in.seekg(static_cast<std::streamoff>(offset));
  if (need && !in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(need)))
    onnx_fail(errc::io, what + ": reading " + std::to_string(need) + " bytes of '" + location + "' failed");
}

// Typed values of a repeated field into `out`, each checked to fit T.
template <class T, class Field>
void onnx_copy_typed(const Field& field, std::size_t numel, const std::string& what, const char* field_name, std::vector<std::byte>& out) {
  if (static_cast<std::size_t>(field.size()) != numel)
    onnx_fail(errc::format, what + ": " + field_name + " holds " + std::to_string(field.size()) + " values, its dims need " + std::to_string(numel));
  out.resize(numel * sizeof(T));
  for (std::size_t i = 0; i < numel; ++i) {
    const auto x = field.Get(static_cast<int>(i));
    T y;
    if constexpr (std::is_integral_v<T> && std::is_integral_v<decltype(x)>) {
      if (!std::in_range<T>(x))
        onnx_fail(errc::format,
                  what + ": " + field_name + " value " + std::to_string(x) + " at " + std::to_string(i) + " does not fit the tensor's element type");
      y = static_cast<T>(x);
    } else {
      y = static_cast<T>(x);
    }
    std::memcpy(out.data() + i * sizeof(T), &y, sizeof(T));
  }
}

// A TensorProto's dtype, dims and bytes; `what` names it in every error ("initializer 'w'").
inline onnx_tensor_data onnx_read_tensor(const onnx::TensorProto& t, const std::filesystem::path* base, const std::string& what) {
  onnx_tensor_data r;
  const auto dt = dtype_from_onnx(t.data_type());
  if (!dt) onnx_fail(errc::unsupported, what + ": ONNX " + onnx_dtype_label(t.data_type()) + " has no tessel dtype");
  r.type = *dt;
  if (t.has_segment()) onnx_fail(errc::unsupported, what + ": segmented tensors are not supported");
  std::size_t numel = 1;
  for (std::int64_t d : t.dims()) {
    if (d < 0) onnx_fail(errc::format, what + ": dim " + std::to_string(d) + " is negative");
    try {
      numel = tessel::detail::mul_checked(numel, static_cast<std::size_t>(d), "element count");
    } catch (const overflow_error&) { onnx_fail(errc::overflow, what + ": the element count of its dims overflows"); }
    r.dims.push_back(d);
  }
  std::size_t need = 0;
  try {
    need = tessel::detail::mul_checked(numel, dtype_size(r.type), "byte size");
  } catch (const overflow_error&) { onnx_fail(errc::overflow, what + ": its byte size overflows"); }
  r.bytes = std::make_shared<std::vector<std::byte>>();
  auto& out = *r.bytes;
  if (t.data_location() == onnx::TensorProto::EXTERNAL) {
    onnx_read_external(t, base, need, what, out);
    return r;
  }
  if (t.has_raw_data()) {
    if (t.raw_data().size() != need)
      onnx_fail(errc::format, what + ": raw_data holds " + std::to_string(t.raw_data().size()) + " bytes, " + std::string(dtype_name(r.type)) +
                                  " with dims " + ints_to_string(r.dims) + " needs " + std::to_string(need));
    out.resize(need);
    if (need) std::memcpy(out.data(), t.raw_data().data(), need);
    return r;
  }
  switch (t.data_type()) {
    case onnx::TensorProto::FLOAT: onnx_copy_typed<float>(t.float_data(), numel, what, "float_data", out); break;
    case onnx::TensorProto::DOUBLE: onnx_copy_typed<double>(t.double_data(), numel, what, "double_data", out); break;
    case onnx::TensorProto::INT64: onnx_copy_typed<std::int64_t>(t.int64_data(), numel, what, "int64_data", out); break;
    case onnx::TensorProto::UINT32: onnx_copy_typed<std::uint32_t>(t.uint64_data(), numel, what, "uint64_data", out); break;
    case onnx::TensorProto::UINT64: onnx_copy_typed<std::uint64_t>(t.uint64_data(), numel, what, "uint64_data", out); break;
    case onnx::TensorProto::INT32: onnx_copy_typed<std::int32_t>(t.int32_data(), numel, what, "int32_data", out); break;
    case onnx::TensorProto::INT16: onnx_copy_typed<std::int16_t>(t.int32_data(), numel, what, "int32_data", out); break;
    case onnx::TensorProto::INT8: onnx_copy_typed<std::int8_t>(t.int32_data(), numel, what, "int32_data", out); break;
    case onnx::TensorProto::BOOL:
    case onnx::TensorProto::UINT8: onnx_copy_typed<std::uint8_t>(t.int32_data(), numel, what, "int32_data", out); break;
    // 16-bit and 8-bit floats sit in int32_data as their bit patterns.
    case onnx::TensorProto::UINT16:
    case onnx::TensorProto::FLOAT16:
    case onnx::TensorProto::BFLOAT16: onnx_copy_typed<std::uint16_t>(t.int32_data(), numel, what, "int32_data", out); break;
    default: onnx_copy_typed<std::uint8_t>(t.int32_data(), numel, what, "int32_data", out); break;  // e4m3, e5m2
  }
  return r;
}

// A declared value type (graph input, output, value_info). `keep_symbols` false turns dim_param
// names into anonymous unknown dims (exporters name intermediate dims freely).
inline std::pair<std::optional<dtype>, tensor_shape> onnx_value_type(const onnx::ValueInfoProto& vi, bool keep_symbols, const std::string& what) {
  if (!vi.has_type()) return {std::nullopt, tensor_shape::unknown_rank()};
  if (!vi.type().has_tensor_type())
    onnx_fail(errc::unsupported, what + " is not a tensor (sequences, maps, optionals and sparse tensors are not supported)");
  const auto& tt = vi.type().tensor_type();
  std::optional<dtype> t;
  if (tt.elem_type() != 0) {
    t = dtype_from_onnx(tt.elem_type());
    if (!t) onnx_fail(errc::unsupported, what + ": ONNX " + onnx_dtype_label(tt.elem_type()) + " has no tessel dtype");
  }
  if (!tt.has_shape()) return {t, tensor_shape::unknown_rank()};
  tensor_shape s;
  for (const auto& d : tt.shape().dim()) {
    if (d.has_dim_value()) {
      if (d.dim_value() < 0) onnx_fail(errc::format, what + ": dim " + std::to_string(d.dim_value()) + " is negative");
      s.dims.emplace_back(d.dim_value());
    } else if (d.has_dim_param() && !d.dim_param().empty() && keep_symbols) {
      s.dims.emplace_back(d.dim_param());
    } else {
      s.dims.emplace_back();
    }
  }
  return {t, s};
}

inline attribute onnx_attribute(const onnx::NodeProto& n, const onnx::AttributeProto& a, const std::string& label) {
  const std::string what = label + ": attribute '" + a.name() + "'";
  if (!a.ref_attr_name().empty()) onnx_fail(errc::unsupported, what + " refers to a function attribute; functions are not supported");
  auto floats_of = [](const auto& f) {
    floats v;
    v.reserve(static_cast<std::size_t>(f.size()));
    for (float x : f) v.push_back(x);
    return v;
  };
  switch (a.type()) {
    case onnx::AttributeProto::FLOAT: return static_cast<double>(a.f());
    case onnx::AttributeProto::INT: return static_cast<std::int64_t>(a.i());
    case onnx::AttributeProto::STRING: return a.s();
    case onnx::AttributeProto::FLOATS: return floats_of(a.floats());
    case onnx::AttributeProto::INTS: return ints(a.ints().begin(), a.ints().end());
    case onnx::AttributeProto::STRINGS: return strings(a.strings().begin(), a.strings().end());
    case onnx::AttributeProto::GRAPH:
    case onnx::AttributeProto::GRAPHS:
      onnx_fail(errc::unsupported, what + " is a subgraph: control flow (" + n.op_type() + ", If, Loop, Scan) is not supported");
    case onnx::AttributeProto::TENSOR:
    case onnx::AttributeProto::TENSORS:
    case onnx::AttributeProto::SPARSE_TENSOR:
    case onnx::AttributeProto::SPARSE_TENSORS:
      onnx_fail(errc::unsupported, what + " is a tensor, which the IR's attributes do not hold (only Constant's value is taken)");
    case onnx::AttributeProto::TYPE_PROTO:
    case onnx::AttributeProto::TYPE_PROTOS: onnx_fail(errc::unsupported, what + " is a type; not supported");
    default: onnx_fail(errc::format, what + " has no attribute type (" + std::to_string(static_cast<int>(a.type())) + ")");
  }
}

// A Constant node's value as a graph constant named by its output.
inline void onnx_add_constant_node(graph& g, const onnx::NodeProto& n, const std::string& label, const std::filesystem::path* base) {
  if (n.output_size() != 1 || n.output(0).empty())
    onnx_fail(errc::format, label + ": a Constant has one output, not " + std::to_string(n.output_size()));
  if (n.input_size() != 0) onnx_fail(errc::format, label + ": a Constant takes no inputs");
  if (n.attribute_size() != 1)
    onnx_fail(errc::format, label + ": a Constant has exactly one value attribute, not " + std::to_string(n.attribute_size()));
  const auto& a = n.attribute(0);
  const std::string& out = n.output(0);
  const std::string what = label + " (value '" + out + "')";
  auto bytes_of = [](const void* p, std::size_t size) {
    auto b = std::make_shared<std::vector<std::byte>>(size);
    if (size) std::memcpy(b->data(), p, size);
    return b;
  };
  if (a.name() == "value" && a.type() == onnx::AttributeProto::TENSOR) {
    onnx_tensor_data d = onnx_read_tensor(a.t(), base, what);
    g.add_constant(out, d.type, std::move(d.dims), std::move(d.bytes));
  } else if (a.name() == "value_float" && a.type() == onnx::AttributeProto::FLOAT) {
    const float x = a.f();
    g.add_constant(out, dtype::f32, {}, bytes_of(&x, sizeof x));
  } else if (a.name() == "value_floats" && a.type() == onnx::AttributeProto::FLOATS) {
    const std::vector<float> v(a.floats().begin(), a.floats().end());
    g.add_constant(out, dtype::f32, {static_cast<std::int64_t>(v.size())}, bytes_of(v.data(), v.size() * sizeof(float)));
  } else if (a.name() == "value_int" && a.type() == onnx::AttributeProto::INT) {
    const std::int64_t x = a.i();
    g.add_constant(out, dtype::i64, {}, bytes_of(&x, sizeof x));
  } else if (a.name() == "value_ints" && a.type() == onnx::AttributeProto::INTS) {
    const std::vector<std::int64_t> v(a.ints().begin(), a.ints().end());
    g.add_constant(out, dtype::i64, {static_cast<std::int64_t>(v.size())}, bytes_of(v.data(), v.size() * sizeof(std::int64_t)));
  } else {
    onnx_fail(errc::unsupported, label + ": Constant attribute '" + a.name() + "' (type " + std::to_string(static_cast<int>(a.type())) +
                                     ") is not supported (value, value_float(s) and value_int(s) are)");
  }
}

inline bool onnx_default_domain(const std::string& d) { return d.empty() || d == "ai.onnx"; }

// ONNX's version converter assumes a graph whose every name is defined before it is read (its
// checker, run first, does not look at the graph outputs: an undefined one crashes the converter's
// IR builder). So before a conversion the importer checks that itself, naming the node or output.
inline void onnx_check_for_converter(const onnx::GraphProto& gp) {
  std::set<std::string, std::less<>> defined;
  for (const auto& t : gp.initializer()) defined.insert(t.name());
  for (const auto& in : gp.input()) defined.insert(in.name());
  for (int i = 0; i < gp.node_size(); ++i) {
    const onnx::NodeProto& n = gp.node(i);
    std::string label = n.op_type();
    label.append(" '").append(n.name().empty() ? std::string("#").append(std::to_string(i)) : n.name()).append("'");
    for (const auto& a : n.attribute())
      if (a.type() == onnx::AttributeProto::GRAPH || a.type() == onnx::AttributeProto::GRAPHS || a.has_g() || a.graphs_size() > 0)
        onnx_fail(errc::unsupported, label + ": attribute '" + a.name() + "' is a subgraph: control flow is not supported");
    for (const auto& in : n.input())
      if (!in.empty() && !defined.count(in))
        onnx_fail(errc::invalid_argument, label + ": input '" + in + "' is not defined by any earlier node, graph input or initializer");
    for (const auto& out : n.output())
      if (!out.empty() && !defined.insert(out).second) onnx_fail(errc::invalid_argument, label + ": output '" + out + "' is already defined");
  }
  for (const auto& out : gp.output())
    if (!defined.count(out.name()))
      onnx_fail(errc::invalid_argument, "graph output '" + out.name() + "' is not defined by any node, graph input or initializer");
}

inline graph onnx_build(onnx::ModelProto& m, const onnx_options& opt) {
  onnx_import_info info;
  info.ir_version = m.ir_version();
  info.producer = m.producer_name() + (m.producer_version().empty() ? "" : " " + m.producer_version());
  if (m.ir_version() < 3)
    onnx_fail(errc::unsupported, "IR version " + std::to_string(m.ir_version()) + " (below 3, without opset imports) is not supported");
  std::int64_t opset = -1;
  for (const auto& imp : m.opset_import()) {
    if (!onnx_default_domain(imp.domain())) continue;
    if (opset >= 0) onnx_fail(errc::format, "the default domain is imported twice");
    opset = imp.version();
  }
  if (opset < 0) onnx_fail(errc::format, "the model imports no opset of the default domain");
  info.opset = info.imported_opset = opset;
  if (opset > onnx_max_opset)
    onnx_fail(errc::unsupported, "opset " + std::to_string(opset) + " is newer than this importer's " + std::to_string(onnx_min_opset) + " to " +
                                     std::to_string(onnx_max_opset));
  if (opset < onnx_min_opset || opt.onnx_checker) {
    try {
      onnx::checker::check_model(m);
    } catch (const std::exception& e) { onnx_fail(errc::format, std::string("ONNX's checker rejects the model: ") + e.what()); }
  }
  if (opset < onnx_min_opset) {
    onnx_check_for_converter(m.graph());
    try {
      m = onnx::version_conversion::ConvertVersion(m, static_cast<int>(onnx_min_opset));
    } catch (const std::exception& e) {
      onnx_fail(errc::unsupported, "opset " + std::to_string(opset) + " could not be converted to " + std::to_string(onnx_min_opset) +
                                       " by ONNX's version converter: " + e.what());
    }
    info.converted = true;
    info.imported_opset = onnx_min_opset;
    info.notes.push_back("converted from opset " + std::to_string(opset) + " to " + std::to_string(onnx_min_opset) +
                         " with ONNX's version converter");
  }

  const onnx::GraphProto& gp = m.graph();
  graph g(gp.name());
  const std::filesystem::path* base = opt.external_data_dir.empty() ? nullptr : &opt.external_data_dir;
  if (gp.sparse_initializer_size() > 0)
    onnx_fail(errc::unsupported, "sparse initializer '" + gp.sparse_initializer(0).values().name() + "': sparse tensors are not supported");
  std::set<std::string, std::less<>> initializers;
  for (const auto& t : gp.initializer()) {
    const std::string what = "initializer '" + t.name() + "'";
    if (t.name().empty()) onnx_fail(errc::format, "an initializer has no name");
    onnx_tensor_data d = onnx_read_tensor(t, base, what);
    g.add_constant(t.name(), d.type, std::move(d.dims), std::move(d.bytes));
    initializers.insert(t.name());
  }
  std::size_t const_inputs = 0;
  for (const auto& in : gp.input()) {
    if (initializers.count(in.name())) {  // an input with a default value: a constant here
      ++const_inputs;
      continue;
    }
    const std::string what = "graph input '" + in.name() + "'";
    auto [t, s] = onnx_value_type(in, true, what);
    if (!t) onnx_fail(errc::format, what + " has no element type");
    g.add_input(in.name(), *t, std::move(s));
  }
  if (const_inputs) info.notes.push_back(std::to_string(const_inputs) + " graph inputs are initializers: imported as constants");

  std::size_t constants = 0;
  for (int i = 0; i < gp.node_size(); ++i) {
    const onnx::NodeProto& n = gp.node(i);
    const std::string name = n.name().empty() ? n.op_type() + "_" + std::to_string(i) : n.name();
    const std::string label = n.op_type() + " '" + name + "'";
    if (n.op_type().empty()) onnx_fail(errc::format, "node #" + std::to_string(i) + " ('" + n.name() + "') has no op type");
    const bool ours = onnx_default_domain(n.domain());
    if (ours && n.op_type() == "Constant") {
      onnx_add_constant_node(g, n, label, base);
      ++constants;
      continue;
    }
    attribute_map attrs;
    for (const auto& a : n.attribute()) {
      if (a.name().empty()) onnx_fail(errc::format, label + ": an attribute has no name");
      if (!attrs.emplace(a.name(), onnx_attribute(n, a, label)).second)
        onnx_fail(errc::format, label + ": attribute '" + a.name() + "' is given twice");
    }
    node probe;
    probe.op = n.op_type();
    probe.domain = ours ? std::string() : n.domain();
    if (!find_shape_rule(probe) && !opt.allow_unknown_ops)
      onnx_fail(errc::unsupported, label + ": unknown op '" + (ours ? std::string() : n.domain() + "::") + n.op_type() +
                                       "' (no shape rule; onnx_options::allow_unknown_ops imports it with unknown outputs)");
    g.add_node(n.op_type(), n.name().empty() ? std::string() : n.name(), std::vector<std::string>(n.input().begin(), n.input().end()),
               std::vector<std::string>(n.output().begin(), n.output().end()), std::move(attrs), probe.domain);
  }
  if (constants) info.notes.push_back(std::to_string(constants) + " Constant nodes became graph constants");

  for (const auto& out : gp.output()) {
    const std::string what = "graph output '" + out.name() + "'";
    if (out.name().empty()) onnx_fail(errc::format, "a graph output has no name");
    const value_id v = g.mark_output(out.name());
    auto [t, s] = onnx_value_type(out, true, what);
    const value& x = g.get(v);
    if (x.role == value_role::node_output || x.role == value_role::undefined) g.set_value_type(v, t, std::move(s));
  }
  for (const auto& vi : gp.value_info()) {
    const auto v = g.find_value(vi.name());
    if (!v || g.get(*v).role != value_role::node_output || g.get(*v).is_output) continue;
    auto [t, s] = onnx_value_type(vi, false, "value_info '" + vi.name() + "'");
    g.set_value_type(*v, t, std::move(s));
  }
  g.verify();
  infer_options io;
  io.allow_unknown_ops = opt.allow_unknown_ops;
  g.infer_shapes(io);
  if (opt.info) *opt.info = std::move(info);
  return g;
}

}  // namespace detail

// Imports a serialized ModelProto. External data files are found in options.external_data_dir.
inline graph import_onnx_bytes(std::string_view bytes, const onnx_options& options = {}) {
  if (bytes.size() > static_cast<std::size_t>(INT_MAX))
    detail::onnx_fail(errc::unsupported, "the model is " + std::to_string(bytes.size()) +
                                             " bytes; protobuf reads at most 2 GiB (larger models keep their tensors in external data)");
  onnx::ModelProto m;
  {
    google::protobuf::io::CodedInputStream in(reinterpret_cast<const std::uint8_t*>(bytes.data()), static_cast<int>(bytes.size()));
    in.SetRecursionLimit(64);
    if (!m.ParseFromCodedStream(&in) || !in.ConsumedEntireMessage())
      detail::onnx_fail(errc::format, "the " + std::to_string(bytes.size()) + " bytes are not an ONNX ModelProto (truncated, or not protobuf)");
  }
  try {
    return detail::onnx_build(m, options);
  } catch (const error&) { throw; } catch (const std::bad_alloc&) {
    detail::onnx_fail(errc::capacity, "out of memory");
  } catch (const std::exception& e) { detail::onnx_fail(errc::format, e.what()); }
}

// Imports an .onnx file; external data files are looked up next to it unless options say otherwise.
inline graph import_onnx(const std::filesystem::path& path, onnx_options options = {}) {
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) detail::onnx_fail(errc::io, "'" + path.string() + "': " + ec.message());
  if (size > static_cast<std::uintmax_t>(INT_MAX))
    detail::onnx_fail(errc::unsupported, "'" + path.string() + "' is " + std::to_string(size) +
                                             " bytes; protobuf reads at most 2 GiB (larger models keep their tensors in external data)");
  std::string bytes(static_cast<std::size_t>(size), '\0');
  std::ifstream in(path, std::ios::binary);
  if (!in || (size && !in.read(bytes.data(), static_cast<std::streamsize>(size)))) detail::onnx_fail(errc::io, "cannot read '" + path.string() + "'");
  if (options.external_data_dir.empty()) {
    options.external_data_dir = path.parent_path();
    if (options.external_data_dir.empty()) options.external_data_dir = ".";
  }
  return import_onnx_bytes(bytes, options);
}

}  // namespace graph
}  // namespace v0
}  // namespace tessel
