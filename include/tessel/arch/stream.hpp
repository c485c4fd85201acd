// Streaming vector helpers for memory-bound operators (optimizers, norms, activations, losses):
// bf16 <-> f32 lane conversions done with integer RNE (bit-identical to tessel::bf16(float)),
// seeded counter-based random bits and stochastic rounding to bf16, non-temporal stores.
// Every vector helper has a scalar twin so tails and references produce the same bits.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <tessel/arch/target.hpp>

// GCC 12 reports (maybe-)uninitialized `__Y` inside its AVX-512 shift intrinsics when they are
// inlined here at -O1/-O2 (the _mm512_undefined_* idiom); the diagnostics are false positives.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace tessel::arch::stream {

using vf = xsimd::batch<float>;
using vu = xsimd::batch<std::uint32_t>;
inline constexpr std::size_t width = vf::size;

// ---- scalar twins -----------------------------------------------------------------------------
inline float bf16_bits_to_f32(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t(h) << 16); }

// RNE with tessel::bf16's NaN rule (payload kept, quiet bit set when the kept payload is zero).
inline std::uint16_t f32_to_bf16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    const std::uint32_t payload = (a >> 16) & 0x7Fu;
    return std::uint16_t(((u >> 16) & 0x8000u) | 0x7F80u | (payload ? payload : 0x40u));
  }
  return std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// 32-bit integer hash with full avalanche (Wellons' "lowbias32"), the mixing step of the counter RNG.
inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
// Key of one (seed, stream) pair: distinct tensors/steps get independent streams.
inline std::uint32_t rng_key(std::uint64_t seed, std::uint64_t stream) {
  std::uint32_t k = mix32(std::uint32_t(seed) ^ 0x9E3779B9u);
  k = mix32(k ^ std::uint32_t(seed >> 32));
  k = mix32(k ^ std::uint32_t(stream) ^ 0x85EBCA6Bu);
  return mix32(k ^ std::uint32_t(stream >> 32));
}
// Random bits of element `i` under `key`: a pure function of (key, i), so any split of the work
// over threads draws the same numbers (two mixing rounds keep neighbouring counters independent).
inline std::uint32_t random_bits(std::uint32_t key, std::uint32_t i) { return mix32(mix32(i ^ key) + key); }

// Stochastic rounding to bf16: add 16 random bits below the kept part and truncate, so the value
// rounds up with probability equal to its distance from the lower neighbour (unbiased).
inline std::uint16_t f32_to_bf16_bits_sr(float f, std::uint32_t rnd) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) return f32_to_bf16_bits(f);  // Inf/NaN as RNE
  return std::uint16_t((u + (rnd & 0xFFFFu)) >> 16);
}

// ---- vector -----------------------------------------------------------------------------------
inline vf load(const float* p) { return vf::load_unaligned(p); }
inline void store(vf v, float* p) { v.store_unaligned(p); }

// Non-temporal store where the address allows it (write-only output streams far above the cache).
inline void store_nt(vf v, float* p) {
#if defined(__AVX512F__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 63u) == 0) {
    _mm512_stream_ps(p, v);
    return;
  }
#elif defined(__AVX__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 31u) == 0) {
    _mm256_stream_ps(p, v);
    return;
  }
#endif
  v.store_unaligned(p);
}
// After a run of non-temporal stores, before another thread reads the data.
inline void nt_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// xsimd's default batch is as wide as the best compiled target: 16 lanes with AVX-512, 8 with AVX2.
inline vf load_bf16(const std::uint16_t* p) {
#if defined(__AVX512F__)
  static_assert(width == 16);
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return vf(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#elif defined(__AVX2__)
  static_assert(width == 8);
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return vf(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#else
  alignas(64) float t[width];
  for (std::size_t i = 0; i < width; ++i) t[i] = bf16_bits_to_f32(p[i]);
  return vf::load_aligned(t);
#endif
}

// Narrows u32 lanes that hold 16-bit values and stores them (non-temporally if asked and aligned).
inline void store_u16(vu v, std::uint16_t* p, bool nt = false) {
#if defined(__AVX512F__)
  const __m256i h = _mm512_cvtepi32_epi16(v);
  if (nt && (reinterpret_cast<std::uintptr_t>(p) & 31u) == 0)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
#elif defined(__AVX2__)
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  const __m128i h = _mm256_castsi256_si128(packed);
  if (nt && (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0)
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
#else
  (void)nt;
  alignas(64) std::uint32_t t[width];
  v.store_aligned(t);
  for (std::size_t i = 0; i < width; ++i) p[i] = std::uint16_t(t[i]);
#endif
}

inline vu bits(vf v) { return xsimd::bitwise_cast<vu>(v); }
inline vf from_bits(vu v) { return xsimd::bitwise_cast<vf>(v); }

// Lane-wise f32_to_bf16_bits (in u32 lanes). Blends go through float batches: xsimd 8.1's
// integer select does not compile for AVX-512 at -O0.
inline vu bf16_rne_lanes(vf f) {
  const vu u = bits(f);
  const vu rne = (u + vu(0x7FFFu) + ((u >> 16) & vu(1u))) >> 16;
  const auto is_nan = !(f == f);  // xsimd 8.1 lowers != to an ordered compare (false for NaN)
  if (xsimd::any(is_nan)) {
    const vu payload = (u >> 16) & vu(0x7Fu);
    const vu nonzero = ((payload + vu(0x7Fu)) >> 7) & vu(1u);  // 1 iff payload != 0
    const vu nan = ((u >> 16) & vu(0x8000u)) | vu(0x7F80u) | payload | ((vu(1u) - nonzero) << 6);
    return bits(xsimd::select(is_nan, from_bits(nan), from_bits(rne)));
  }
  return rne;
}
inline void store_bf16(vf f, std::uint16_t* p, bool nt = false) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  static_assert(width == 16);
  // vcvtneps2bf16 rounds to nearest even exactly like f32_to_bf16_bits for every other class, but
  // reads subnormal inputs as zero and quiets every NaN its own way, so vectors holding a NaN
  // (0x01 quiet, 0x80 signalling) or a subnormal (0x20) take the integer path below.
  if (_mm512_fpclass_ps_mask(f, 0x01 | 0x20 | 0x80) == 0) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
    if (nt && (reinterpret_cast<std::uintptr_t>(p) & 31u) == 0)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return;
  }
#endif
  store_u16(bf16_rne_lanes(f), p, nt);
}

// store_bf16 of two vectors to p[0 .. 2·width): with AVX512-BF16 one vcvtne2ps2bf16 and one full
// 64-byte store, so a non-temporal output stream hands the write-combining buffers whole lines
// (two half-line stores per line, from several rows at once, can run out of them). Same bits as
// two store_bf16 calls.
inline void store_bf16x2(vf lo, vf hi, std::uint16_t* p, bool nt = false) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if ((_mm512_fpclass_ps_mask(lo, 0x01 | 0x20 | 0x80) | _mm512_fpclass_ps_mask(hi, 0x01 | 0x20 | 0x80)) == 0) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    if (nt && (reinterpret_cast<std::uintptr_t>(p) & 63u) == 0)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(p), h);
    else
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(p), h);
    return;
  }
#endif
  store_bf16(lo, p, nt);
  store_bf16(hi, p + width, nt);
}

inline vu mix32(vu x) {
  x ^= x >> 16;
  x *= vu(0x7FEB352Du);
  x ^= x >> 15;
  x *= vu(0x846CA68Bu);
  x ^= x >> 16;
  return x;
}
// random_bits for lanes i0, i0+1, ... (wrapping at 2^32)
inline vu random_bits_v(std::uint32_t key, std::uint32_t i0) {
  alignas(64) static constexpr std::uint32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(width <= 16);
  const vu idx = vu(i0) + vu::load_aligned(iota);
  return mix32(mix32(idx ^ vu(key)) + vu(key));
}
inline vu bf16_sr_lanes(vf f, vu rnd) {
  const vu u = bits(f);
  const auto special = !(xsimd::abs(f) < vf(std::numeric_limits<float>::infinity()));  // Inf or NaN
  const vu sr = (u + (rnd & vu(0xFFFFu))) >> 16;
  if (xsimd::any(special)) return bits(xsimd::select(special, from_bits(bf16_rne_lanes(f)), from_bits(sr)));
  return sr;
}

// ---- one vocabulary for scalar and vector lanes (operators write their math once as a template)
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
// xsimd 8.1 has no AVX-512 fma kernel (its generic fallback is a*b+c, two roundings), so the fused
// instruction is called directly: vector and scalar lanes must round alike.
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return vf(_mm512_fmadd_ps(a, b, c));
#elif defined(__FMA__)
  return vf(_mm256_fmadd_ps(a, b, c));
#else
  return xsimd::fma(a, b, c);
#endif
}
inline float sqrt(float a) { return std::sqrt(a); }
inline vf sqrt(vf a) { return xsimd::sqrt(a); }
// a > b ? a : b lane by lane, which is exactly vmaxps/vminps (the second operand for a NaN or for
// two zeros): one instruction instead of a compare and a blend.
inline float max(float a, float b) { return a > b ? a : b; }
inline vf max(vf a, vf b) {
#if defined(__AVX512F__)
  return vf(_mm512_max_ps(a, b));
#elif defined(__AVX__)
  return vf(_mm256_max_ps(a, b));
#else
  return xsimd::select(a > b, a, b);
#endif
}
inline float min(float a, float b) { return a < b ? a : b; }
inline vf min(vf a, vf b) {
#if defined(__AVX512F__)
  return vf(_mm512_min_ps(a, b));
#elif defined(__AVX__)
  return vf(_mm256_min_ps(a, b));
#else
  return xsimd::select(a < b, a, b);
#endif
}
inline float abs(float a) { return std::fabs(a); }
inline vf abs(vf a) { return xsimd::abs(a); }
// -1, 0 or +1 (NaN -> 0).
inline float sign(float a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f); }
inline vf sign(vf a) { return xsimd::select(a > vf(0.0f), vf(1.0f), xsimd::select(a < vf(0.0f), vf(-1.0f), vf(0.0f))); }
inline float exp(float a) { return std::exp(a); }
inline vf exp(vf a) { return xsimd::exp(a); }

// ---- exp for streaming kernels (softmax, cross-entropy, SiLU) -----------------------------------
// Cody-Waite reduction x = n·ln2 + r (|r| <= ln2/2), Cephes' degree-5 minimax polynomial for e^r,
// then 2^n applied in two exact halves so subnormal results and overflow round once, like expf.
// Within 2 ulp of the correctly rounded result; exp(-inf) = 0, exp(+inf) = inf, NaN stays NaN.
// The scalar twin performs the same operations, so tails and vector lanes agree bit for bit.
namespace detail_exp {
inline constexpr float lo = -104.0f, hi = 88.8f, log2e = 1.44269504088896341f;
inline constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
inline constexpr float c0 = 1.9875691500e-4f, c1 = 1.3981999507e-3f, c2 = 8.3334519073e-3f, c3 = 4.1665795894e-2f, c4 = 1.6666665459e-1f,
                       c5 = 5.0000001201e-1f;
}  // namespace detail_exp

inline float exp_fast(float x) {
  using namespace detail_exp;
  if (x != x) return x;
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  const float n = std::nearbyint(xc * log2e);
  float r = std::fma(n, -ln2_hi, xc);
  r = std::fma(n, -ln2_lo, r);
  float p = std::fma(c0, r, c1);
  p = std::fma(p, r, c2);
  p = std::fma(p, r, c3);
  p = std::fma(p, r, c4);
  p = std::fma(p, r, c5);
  const float r2 = r * r;
  p = std::fma(p, r2, r) + 1.0f;
  const int ni = int(n), e1 = ni >> 1, e2 = ni - e1;  // floor halving (arithmetic shift)
  return p * std::bit_cast<float>(std::uint32_t(e1 + 127) << 23) * std::bit_cast<float>(std::uint32_t(e2 + 127) << 23);
}

inline vf exp_fast(vf x) {
  using namespace detail_exp;
  // max/min return their second operand for a NaN lane; the final select restores NaN.
  const vf xc = xsimd::min(xsimd::max(x, vf(lo)), vf(hi));
  const vf n = xsimd::nearbyint(xc * vf(log2e));
  vf r = fma(n, vf(-ln2_hi), xc);
  r = fma(n, vf(-ln2_lo), r);
  vf p = fma(vf(c0), r, vf(c1));
  p = fma(p, r, vf(c2));
  p = fma(p, r, vf(c3));
  p = fma(p, r, vf(c4));
  p = fma(p, r, vf(c5));
  const vf r2 = r * r;
  p = fma(p, r2, r) + vf(1.0f);
#if defined(__AVX512F__)
  // p·2^n rounded once, exactly what the two exact half-scalings of the scalar twin give.
  const vf y = vf(_mm512_scalef_ps(p, n));
#else
  using vi = xsimd::batch<std::int32_t>;
  const vi ni = xsimd::batch_cast<std::int32_t>(n);
  const vi e1 = ni >> 1, e2 = ni - e1;
  const vf s1 = xsimd::bitwise_cast<vf>((e1 + vi(127)) << 23), s2 = xsimd::bitwise_cast<vf>((e2 + vi(127)) << 23);
  const vf y = p * s1 * s2;
#endif
  return xsimd::select(!(x == x), x, y);
}

// Hint that the cache line at `p` is read soon (the next row of a row-streaming kernel), so its
// transfer overlaps the arithmetic on the current row.
inline void prefetch(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// Same, into the L2 cache only: for a whole row requested ahead (tens of KiB), which would
// otherwise push the current row's working set out of L1.
inline void prefetch_l2(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  (void)p;
#endif
}

// Horizontal sum in a fixed lane order (pairwise halving), so results never depend on the target's
// reduce instruction sequence: equals detail::hsum_ref on the stored lanes.
inline float hsum(vf v) {
  alignas(64) float t[width];
  v.store_aligned(t);
  for (std::size_t h = width / 2; h >= 1; h /= 2)
    for (std::size_t i = 0; i < h; ++i) t[i] += t[i + h];
  return t[0];
}
inline float hmax(vf v) {
  alignas(64) float t[width];
  v.store_aligned(t);
  float m = t[0];
  for (std::size_t i = 1; i < width; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

}  // namespace tessel::arch::stream

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
