// arch/copy.hpp: the streaming-store copy equals memcpy for every length and every alignment of
// source and destination (head, vector body and tail paths), and leaves the bytes around the
// destination alone; the fused streaming sum equals the scalar rank-order sum bit for bit.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <tessel/arch/copy.hpp>

TEST_CASE("copy_streaming equals memcpy for every length and alignment", "[arch][copy]") {
  std::vector<unsigned char> src(4096 + 128), dst(4096 + 256), want(dst.size());
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  int bad = 0;
  const std::size_t lens[] = {0, 1, 7, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 1000, 4096};
  for (std::size_t len : lens)
    for (std::size_t so = 0; so < 64; so += 5)
      for (std::size_t d0 = 0; d0 < 64; d0 += 3) {
        std::memset(dst.data(), 0xA5, dst.size());
        want = dst;
        std::memcpy(want.data() + 64 + d0, src.data() + so, len);
        tessel::arch::copy_streaming(dst.data() + 64 + d0, src.data() + so, len);
        tessel::arch::store_fence();
        bad += dst != want;
      }
  CHECK(bad == 0);
  for (int i = 0; i < 100; ++i) tessel::arch::cpu_relax();  // a hint only: must simply return
}

TEST_CASE("copy_streaming of a buffer larger than the cache", "[arch][copy]") {
  const std::size_t n = std::size_t{48} << 20;
  std::vector<std::byte> a(n), b(n + 64);
  for (std::size_t i = 0; i < n; i += 4096) a[i] = static_cast<std::byte>(i >> 12);
  a[n - 1] = std::byte{42};
  tessel::arch::copy_streaming(b.data() + 3, a.data(), n);
  tessel::arch::store_fence();
  CHECK(std::memcmp(b.data() + 3, a.data(), n) == 0);
}

TEMPLATE_TEST_CASE("sum_streaming equals the rank-order scalar sum bit for bit, any alignment, in place too", "[arch][copy]", float, double) {
  using T = TestType;
  const std::size_t cap = 700;
  std::vector<std::vector<T>> src(5, std::vector<T>(cap + 16)), dst(4, std::vector<T>(cap + 16));
  std::uint32_t x = 12345;
  auto rnd = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<T>(static_cast<std::int32_t>(x) >> 8) * static_cast<T>(1.0 / 4099.0);  // inexact sums
  };
  int bad = 0;
  for (int nsrc = 1; nsrc <= 5; ++nsrc)
    for (int ndst = 1; ndst <= 4; ++ndst)
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{64}, std::size_t{333}, cap})
        for (std::size_t shift = 0; shift < 3; ++shift)
          for (bool in_place : {false, true}) {
            for (auto& v : src)
              for (auto& e : v) e = rnd();
            std::vector<const T*> s(static_cast<std::size_t>(nsrc));
            std::vector<T*> d(static_cast<std::size_t>(ndst));
            for (int k = 0; k < nsrc; ++k) s[k] = src[k].data() + (static_cast<std::size_t>(k) * shift) % 5;
            // destination k misaligned by k*shift elements: mixed alignments when shift > 0
            for (int k = 0; k < ndst; ++k) d[k] = dst[k].data() + static_cast<std::size_t>(k) * shift;
            std::vector<T> want(count);
            for (std::size_t i = 0; i < count; ++i) {
              T acc = s[0][i];
              for (int k = 1; k < nsrc; ++k) acc = acc + s[k][i];
              want[i] = acc;
            }
            if (in_place) d[0] = const_cast<T*>(s[0]);
            tessel::arch::sum_streaming(s.data(), nsrc, d.data(), ndst, count);
            tessel::arch::store_fence();
            for (int k = 0; k < ndst; ++k) bad += count && std::memcmp(d[k], want.data(), count * sizeof(T)) != 0;  // want.data() may be null at 0
          }
  CHECK(bad == 0);
}
