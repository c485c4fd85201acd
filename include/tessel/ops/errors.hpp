// The operators' error families, one per operator group, all tessel::error: a caller can catch
// one group (gemm_error) or every library error (tessel::error) and switch on code().
#pragma once

#include <tessel/error.hpp>

namespace tessel {
inline namespace v0 {

// A GEMM argument error (bad shape, leading dimension, null pointer, scale layout).
struct gemm_error : error_of<gemm_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "gemm";
};

// Bad attention input (shapes, head counts, buffers, block tables).
struct attention_error : error_of<attention_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "attention";
};

// Bad optimizer input (tensor lists, hyper-parameters, loss-scaler settings).
struct optim_error : error_of<optim_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "optim";
};

// Bad norm/activation/softmax/loss/rope input (shapes, null data, eps, scales, labels).
struct layer_error : error_of<layer_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "layers";
};

// Bad convolution or pooling input (shapes, strides, padding, groups, layouts, buffers).
struct conv_error : error_of<conv_error> {
  using error_of::error_of;
  static constexpr const char area_name[] = "conv";
};

}  // namespace v0
}  // namespace tessel
