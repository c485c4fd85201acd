// The model layer's error family: nn_error (area "nn"), a tessel::error. Codes used:
// errc::invalid_argument (a call the model cannot take: token ids out of range, a batch shape that
// does not match the buffers), errc::out_of_range (an unknown parameter name), errc::format (a
// checkpoint tensor of the wrong shape or element type, a missing or unexpected tensor),
// errc::unsupported (a configuration this layer does not build yet), errc::overflow (sizes).
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

struct nn_error : error_of<nn_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "nn";
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
