// Memory-movement atoms for code outside the SIMD layers (collectives, transports): a copy with
// non-temporal (streaming) stores for results far larger than the cache, and the spin-wait hint.
// Light on purpose: no xsimd, only the intrinsics header, each path with a portable fallback.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The same guard as target.hpp's: when this header is the first to include the intrinsics (a TU
// that includes collectives before ops), the pragma state here is what GCC 12 uses for the
// AVX-512 headers' `__Y = __Y` idiom in every later inlined GEMM atom.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace tessel::arch {

// One step of a busy-wait loop: tells the core it is spinning (x86 `pause`, Arm `yield`), which
// saves power and lets a sibling hyperthread run.
inline void cpu_relax() noexcept {
#if defined(__SSE2__)
  _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

// dst[0, bytes) = src[0, bytes) with streaming stores: the destination lines are written without
// being read first (no write-allocate), so a copy of B bytes costs 2B of memory traffic, not 3B,
// and does not evict the working set. Worth it only when the destination will not be read again
// soon. The stores are weakly ordered: call store_fence() before another thread may read dst.
// Buffers must not overlap; any alignment works (the head is copied up to a 64-byte destination
// boundary, then whole vectors, then the tail).
inline void copy_streaming(void* dst, const void* src, std::size_t bytes) noexcept {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
  const std::size_t head = std::min<std::size_t>(bytes, (64 - (reinterpret_cast<std::uintptr_t>(d) & 63u)) & 63u);
  if (head) std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  std::size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 128 <= bytes; i += 128) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
  }
#elif defined(__AVX__)
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
#else
  for (; i + 64 <= bytes; i += 64)
    for (std::size_t k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + k), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + k)));
#endif
  if (i < bytes) std::memcpy(d + i, s + i, bytes - i);
#else
  if (bytes) std::memcpy(d, s, bytes);  // no streaming stores on this target: an ordinary copy
#endif
}

// dst[k][i] = (...((src[0][i] + src[1][i]) + src[2][i]) ...) + src[nsrc-1][i] for every k < ndst and
// i < count: the sum in source order (each lane does exactly the scalar additions, so the bits are
// those of the scalar loop), written to every destination with streaming stores. Loading every
// source and storing every destination in one pass keeps reads and writes in flight together,
// which a fold into cache followed by streaming copies does not (measured on 2 threads: 13.1 vs
// 9.6 GiB/s, the fused loop matching a streaming copy of the same bytes). A destination may be
// one of the sources (in place) but must not otherwise overlap them. Destinations whose address
// is not vector-aligned where the first one is get ordinary stores. Call store_fence() after.
template <class T>
requires(std::is_same_v<T, float> || std::is_same_v<T, double>) inline void sum_streaming(const T* const* src, int nsrc, T* const* dst, int ndst,
                                                                                          std::size_t count) noexcept {
  auto scalar = [&](std::size_t i) {
    T acc = src[0][i];
    for (int k = 1; k < nsrc; ++k) acc = acc + src[k][i];
    for (int k = 0; k < ndst; ++k) dst[k][i] = acc;
  };
  std::size_t i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
  constexpr std::size_t vbytes = 64;
#else
  constexpr std::size_t vbytes = 32;
#endif
  constexpr std::size_t lanes = vbytes / sizeof(T);
  if (ndst > 0) {
    // align the first destination; the others stream only if they are aligned at the same index
    while (i < count && (reinterpret_cast<std::uintptr_t>(dst[0] + i) & (vbytes - 1)) != 0) scalar(i++);
    std::uint64_t nt = 0;  // bit k: dst[k] is aligned here
    for (int k = 0; k < ndst && k < 64; ++k)
      if ((reinterpret_cast<std::uintptr_t>(dst[k] + i) & (vbytes - 1)) == 0) nt |= std::uint64_t{1} << k;
    for (; i + lanes <= count; i += lanes) {
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        __m512 acc = _mm512_loadu_ps(src[0] + i);
        for (int k = 1; k < nsrc; ++k) acc = _mm512_add_ps(acc, _mm512_loadu_ps(src[k] + i));
        for (int k = 0; k < ndst; ++k)
          if (k < 64 && (nt >> k & 1))
            _mm512_stream_ps(dst[k] + i, acc);
          else
            _mm512_storeu_ps(dst[k] + i, acc);
      } else {
        __m512d acc = _mm512_loadu_pd(src[0] + i);
        for (int k = 1; k < nsrc; ++k) acc = _mm512_add_pd(acc, _mm512_loadu_pd(src[k] + i));
        for (int k = 0; k < ndst; ++k)
          if (k < 64 && (nt >> k & 1))
            _mm512_stream_pd(dst[k] + i, acc);
          else
            _mm512_storeu_pd(dst[k] + i, acc);
      }
#else
      if constexpr (std::is_same_v<T, float>) {
        __m256 acc = _mm256_loadu_ps(src[0] + i);
        for (int k = 1; k < nsrc; ++k) acc = _mm256_add_ps(acc, _mm256_loadu_ps(src[k] + i));
        for (int k = 0; k < ndst; ++k)
          if (k < 64 && (nt >> k & 1))
            _mm256_stream_ps(dst[k] + i, acc);
          else
            _mm256_storeu_ps(dst[k] + i, acc);
      } else {
        __m256d acc = _mm256_loadu_pd(src[0] + i);
        for (int k = 1; k < nsrc; ++k) acc = _mm256_add_pd(acc, _mm256_loadu_pd(src[k] + i));
        for (int k = 0; k < ndst; ++k)
          if (k < 64 && (nt >> k & 1))
            _mm256_stream_pd(dst[k] + i, acc);
          else
            _mm256_storeu_pd(dst[k] + i, acc);
      }
#endif
    }
  }
#endif
  for (; i < count; ++i) scalar(i);
}

// Orders earlier streaming stores before later stores (and the lock release that publishes them).
inline void store_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace tessel::arch
