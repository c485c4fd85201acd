// libFuzzer target: arbitrary bytes as an ONNX model, through import_onnx_bytes (unknown ops allowed,
// so that inference runs over as much of the graph as possible; no external data directory). Any
// tessel::error is a refusal (fine); any other exception, a crash, a hang or a sanitizer report is a
// bug. A model that imports must print, and every constant must hold exactly its bytes.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <tessel/graph/onnx.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace tg = tessel::graph;
  try {
    tg::onnx_options o;
    o.allow_unknown_ops = true;
    const tg::graph g = tg::import_onnx_bytes(std::string_view(reinterpret_cast<const char*>(data), size), o);
    if (g.to_string().empty()) __builtin_trap();
    for (tg::value_id c : g.constants()) {
      const auto bytes = g.byte_size(c);
      if (!bytes || !g.get(c).data || *bytes != g.get(c).data->size()) __builtin_trap();
    }
  } catch (const tessel::error&) {}
  return 0;
}
