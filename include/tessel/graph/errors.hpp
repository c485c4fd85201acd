// The graph layer's error family: graph_error (area "graph"), a tessel::error. Every message names
// what it is about: a node by op and name ("MatMul 'fc1': inner dims 64 and 48 differ") or a value
// by name ("value 'x': ..."). Codes used: errc::invalid_argument (a graph that breaks the IR's rules
// or an op's: an undefined input, two producers, a duplicate name, a cycle, contradicting shapes, an
// attribute of the wrong type), errc::out_of_range (an unknown name or id, an index past a dim),
// errc::unsupported (an op without a shape rule, an ONNX feature this layer does not take yet),
// errc::overflow (element or byte counts that would wrap).
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {
namespace graph {

struct graph_error : error_of<graph_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "graph";
};

}  // namespace graph
}  // namespace v0
}  // namespace tessel
