// Embedding lookup and gradient (tessel/ops/embedding.hpp): gathers rows exactly, adds positions,
// the gradient equals a token-order scatter-add bitwise on any thread count, bad ids are errors.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <tessel/device/host_device.hpp>
#include <tessel/ops/embedding.hpp>

#include "error_match.hpp"
#include "reference/train_ref.hpp"

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_ops_embedding {

using namespace tessel;
using tessel_test::is_error;

TEST_CASE("embedding gathers rows and adds a second table", "[ops][embedding]") {
  host_device dev(2);
  const std::size_t V = 50, D = 37, T = 300;
  auto table = train_ref::randn(V * D, 1), pos = train_ref::randn(T * D, 2);
  std::vector<std::int64_t> ids(T), p(T);
  for (std::size_t t = 0; t < T; ++t) ids[t] = std::int64_t((t * 31 + 7) % V), p[t] = std::int64_t(t);
  std::vector<float> out(T * D);
  embedding_forward(dev, ids, tensor<const float, 2>(table.data(), V, D), tensor<float, 2>(out.data(), T, D));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t j = 0; j < D; ++j) REQUIRE(out[t * D + j] == table[std::size_t(ids[t]) * D + j]);
  embedding_forward(dev, p, tensor<const float, 2>(pos.data(), T, D), tensor<float, 2>(out.data(), T, D), true);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t j = 0; j < D; ++j) REQUIRE(out[t * D + j] == table[std::size_t(ids[t]) * D + j] + pos[t * D + j]);
  std::vector<bf16> outh(T * D);
  embedding_forward(dev, ids, tensor<const float, 2>(table.data(), V, D), tensor<bf16, 2>(outh.data(), T, D));
  for (std::size_t i = 0; i < outh.size(); ++i) REQUIRE(outh[i].bits() == bf16(table[std::size_t(ids[i / D]) * D + i % D]).bits());
}

TEST_CASE("embedding gradient is a token-order scatter-add, the same bits on 1 and 2 threads", "[ops][embedding]") {
  host_device d1(1), d2(2);
  const std::size_t V = 20, D = 1000, T = 257;  // repeated ids, several column blocks
  auto dout = train_ref::randn(T * D, 3);
  std::vector<std::int64_t> ids(T);
  for (std::size_t t = 0; t < T; ++t) ids[t] = std::int64_t((t * t + 3) % V);
  auto init = train_ref::randn(V * D, 4);
  std::vector<float> want = init, g1 = init, g2 = init;
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t j = 0; j < D; ++j) want[std::size_t(ids[t]) * D + j] += dout[t * D + j];
  embedding_backward(d1, ids, tensor<const float, 2>(dout.data(), T, D), tensor<float, 2>(g1.data(), V, D));
  embedding_backward(d2, ids, tensor<const float, 2>(dout.data(), T, D), tensor<float, 2>(g2.data(), V, D));
  CHECK(g1 == want);
  CHECK(g2 == want);
}

TEST_CASE("embedding ids outside the table are typed errors naming the token", "[ops][embedding]") {
  host_device dev(1);
  std::vector<float> table(4 * 3), out(2 * 3);
  std::vector<std::int64_t> ids{1, 4};
  CHECK_THROWS_MATCHES(embedding_forward(dev, ids, tensor<const float, 2>(table.data(), 4, 3), tensor<float, 2>(out.data(), 2, 3)), layer_error,
                       is_error(errc::out_of_range, "layers", "id 4 of token 1"));
  ids[1] = -1;
  CHECK_THROWS_MATCHES(embedding_backward(dev, ids, tensor<const float, 2>(out.data(), 2, 3), tensor<float, 2>(table.data(), 4, 3)), layer_error,
                       is_error(errc::out_of_range, "layers", "id -1 of token 1"));
  ids[1] = 0;
  CHECK_THROWS_AS(embedding_forward(dev, ids, tensor<const float, 2>(table.data(), 4, 3), tensor<float, 2>(out.data(), 2, 2)), layer_error);
}

}  // namespace tessel_test_ops_embedding
