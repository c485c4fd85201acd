// Typed errors of the io layer (safetensors files, sharded checkpoints, Hugging Face configs).
// One type, io_error, derived from tessel::error with area "io"; its code says what went wrong
// and what() reads "tessel::io: <file>: [tensor 'x': | field 'y': ]<detail>".
#pragma once

#include <string>
#include <string_view>

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {
namespace io {

// Codes used: errc::format (the bytes break the file's rules), errc::io (the OS refused an open,
// read, map or write), errc::config (a config.json field that cannot describe a model),
// errc::overflow (size arithmetic that would wrap), errc::out_of_range (an unknown tensor name),
// errc::invalid_argument (a caller's request the file cannot satisfy: wrong element type),
// errc::unsupported (well-formed but not handled: an unknown model_type or rope type).
struct io_error : error {
  io_error(errc code, std::string_view file, std::string_view detail) : error(code, "io", std::string(file) + ": " + std::string(detail)) {}
};

namespace detail {
inline std::string tensor_context(std::string_view name) { return "tensor '" + std::string(name) + "': "; }
inline std::string field_context(std::string_view name) { return "field '" + std::string(name) + "': "; }
}  // namespace detail

}  // namespace io
}  // namespace v0
}  // namespace tessel
