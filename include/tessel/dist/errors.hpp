// The distributed layer's error family: dist_error (area "dist"), a tessel::error. Codes used:
// errc::config (a parallel layout that cannot describe the world or the model: a world size that
// is not dp·tp·…, tp not dividing the heads), errc::invalid_argument (a call the layer cannot take:
// shapes that do not match the shard), errc::out_of_range (a token id or label outside the
// vocabulary), errc::unsupported (a layout this layer does not build yet: pp, ep or a ZeRO stage
// above 0).
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {
namespace dist {

struct dist_error : error_of<dist_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "dist";
};

}  // namespace dist
}  // namespace v0
}  // namespace tessel
