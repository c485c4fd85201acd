// arch/copy.hpp: the streaming-store copy equals memcpy for every length and every alignment of
// source and destination (head, vector body and tail paths), and leaves the bytes around the
// destination alone.
#include <catch2/catch.hpp>

#include <cstddef>
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
