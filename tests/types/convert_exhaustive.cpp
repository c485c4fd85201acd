// All 2^32 floats, for each narrow type and both overflow modes: the scalar conversion equals the
// independent search-table reference (tests/reference/types_ref.hpp), the bulk (vector) path equals
// the scalar path, and bf16/fp16 agree with Eigen::bfloat16 / Eigen::half. Multi-threaded.
#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <bit>
#include <catch2/catch.hpp>
#include <mutex>
#include <reference/types_ref.hpp>
#include <sstream>
#include <string>
#include <tessel/types.hpp>
#include <thread>
#include <vector>

using tessel::overflow;

namespace {

constexpr std::uint32_t chunk = 1u << 14;

// Splits the 2^31 magnitudes [0, 2^31) into contiguous ranges, one per thread, and calls
// body(first, count) chunk by chunk; collects failure messages (Catch is not thread-safe).
struct sweep_result {
  std::atomic<std::uint64_t> failures{0};
  std::mutex m;
  std::vector<std::string> examples;
  void fail(const std::string& what) {
    if (failures++ < 8) {
      std::lock_guard<std::mutex> lock(m);
      examples.push_back(what);
    }
  }
};

template <class Body>
void sweep_magnitudes(Body make_body, sweep_result& r) {
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t total = 1ull << 31;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < nt; ++t) {
    const std::uint64_t lo = total * t / nt / chunk * chunk, hi = t + 1 == nt ? total : total * (t + 1) / nt / chunk * chunk;
    threads.emplace_back([=, &r] {
      auto body = make_body(std::uint32_t(lo));
      for (std::uint64_t a = lo; a < hi; a += chunk) body(std::uint32_t(a), std::uint32_t(std::min<std::uint64_t>(chunk, hi - a)), r);
    });
  }
  for (auto& th : threads) th.join();
}

std::string hex(std::uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// The documented NaN policy, restated: IEEE-like formats keep the top mantissa bits of the
// payload (the quiet bit when those are all zero), E4M3 has the single NaN code.
std::uint32_t ref_nan(const tessel_ref::encoder& enc, std::uint32_t float_bits) {
  const bool neg = float_bits >> 31;
  if (enc.f.fn) return enc.nan_code(neg);
  const std::uint32_t payload = (float_bits & 0x7FFFFFu) >> (23 - enc.f.man_bits);
  const std::uint32_t sign = neg ? 1u << (enc.f.total_bits() - 1) : 0u;
  return sign | (((1u << enc.f.exp_bits) - 1) << enc.f.man_bits) | (payload ? payload : 1u << (enc.f.man_bits - 1));
}

template <class T>
void exhaustive_against_reference(const tessel_ref::format_spec& spec) {
  using Fmt = typename T::format;
  const tessel_ref::encoder enc(spec);
  sweep_result r;
  sweep_magnitudes(
      [&](std::uint32_t first) {
        // Per-thread state: the reference's floor index only moves forward as magnitudes grow.
        struct state {
          const tessel_ref::encoder* enc;
          std::size_t idx;
          std::vector<float> pos, neg;
          std::vector<T> bp, bps, bn, bns;
          void operator()(std::uint32_t a0, std::uint32_t n, sweep_result& res) {
            pos.resize(n), neg.resize(n), bp.resize(n), bps.resize(n), bn.resize(n), bns.resize(n);
            for (std::uint32_t i = 0; i < n; ++i) {
              pos[i] = std::bit_cast<float>(a0 + i);
              neg[i] = std::bit_cast<float>((a0 + i) | 0x80000000u);
            }
            tessel::convert(std::span<const float>(pos), std::span<T>(bp), overflow::propagate);
            tessel::convert(std::span<const float>(pos), std::span<T>(bps), overflow::saturate);
            tessel::convert(std::span<const float>(neg), std::span<T>(bn), overflow::propagate);
            tessel::convert(std::span<const float>(neg), std::span<T>(bns), overflow::saturate);
            const std::uint32_t sign = 1u << (enc->f.total_bits() - 1);
            for (std::uint32_t i = 0; i < n; ++i) {
              const std::uint32_t a = a0 + i;
              std::uint32_t rp, rs, rnp, rns;  // reference: +a propagate, +a saturate, -a both
              if (a > 0x7F800000u) {
                rp = rs = ref_nan(*enc, a);
                rnp = rns = ref_nan(*enc, a | 0x80000000u);
              } else {
                const double v = double(pos[i]);
                if (v <= enc->max_finite)
                  while (idx + 1 < enc->values.size() && enc->values[idx + 1] <= v) ++idx;
                rp = enc->encode_magnitude(v, false, idx);
                rs = enc->encode_magnitude(v, true, idx);
                rnp = rp | sign;
                rns = rs | sign;
              }
              const std::uint32_t sp = tessel::detail::encode<Fmt, overflow::propagate>(pos[i]);
              const std::uint32_t ss = tessel::detail::encode<Fmt, overflow::saturate>(pos[i]);
              const std::uint32_t snp = T(neg[i]).bits();
              const std::uint32_t sns = tessel::detail::encode<Fmt, overflow::saturate>(neg[i]);
              const bool ok = sp == rp && ss == rs && snp == rnp && sns == rns && bp[i].bits() == sp && bps[i].bits() == ss && bn[i].bits() == snp &&
                              bns[i].bits() == sns;
              if (!ok)
                res.fail("float " + hex(a) + ": scalar " + hex(sp) + "/" + hex(ss) + "/" + hex(snp) + "/" + hex(sns) + " reference " + hex(rp) + "/" +
                         hex(rs) + "/" + hex(rnp) + "/" + hex(rns) + " bulk " + hex(bp[i].bits()) + "/" + hex(bps[i].bits()) + "/" +
                         hex(bn[i].bits()) + "/" + hex(bns[i].bits()));
            }
          }
        };
        const double v0 = double(std::bit_cast<float>(first));
        return state{&enc, v0 <= enc.max_finite ? enc.floor_index(v0) : enc.values.size() - 1, {}, {}, {}, {}, {}, {}};
      },
      r);
  for (const auto& e : r.examples) FAIL_CHECK(e);
  CHECK(r.failures == 0);
}

// Eigen peer: same bits for every non-NaN float; for NaN both give a NaN of the same sign
// (Eigen 3.4 canonicalizes bf16 NaN to 0x7FC0|sign; Eigen::half uses F16C, which keeps payload).
template <class T, class E>
void exhaustive_against_eigen() {
  sweep_result r;
  sweep_magnitudes(
      [](std::uint32_t) {
        return [](std::uint32_t a0, std::uint32_t n, sweep_result& res) {
          for (std::uint32_t i = 0; i < n; ++i)
            for (std::uint32_t s : {0u, 0x80000000u}) {
              const std::uint32_t u = (a0 + i) | s;
              const float f = std::bit_cast<float>(u);
              const std::uint16_t ours = T(f).bits();
              const std::uint16_t theirs = Eigen::numext::bit_cast<std::uint16_t>(E(f));
              const bool ok = (u & 0x7FFFFFFFu) > 0x7F800000u
                                  ? isnan(T::from_bits(ours)) && isnan(T::from_bits(theirs)) && (ours >> 15) == (theirs >> 15)
                                  : ours == theirs;
              if (!ok) res.fail("float " + hex(u) + ": tessel " + hex(ours) + " eigen " + hex(theirs));
            }
        };
      },
      r);
  for (const auto& e : r.examples) FAIL_CHECK(e);
  CHECK(r.failures == 0);
}

}  // namespace

TEST_CASE("all floats -> e4m3 match the reference, bulk == scalar", "[types][convert][exhaustive]") {
  exhaustive_against_reference<tessel::e4m3>(tessel_ref::e4m3_spec);
}
TEST_CASE("all floats -> e5m2 match the reference, bulk == scalar", "[types][convert][exhaustive]") {
  exhaustive_against_reference<tessel::e5m2>(tessel_ref::e5m2_spec);
}
TEST_CASE("all floats -> fp16 match the reference, bulk == scalar", "[types][convert][exhaustive]") {
  exhaustive_against_reference<tessel::fp16>(tessel_ref::fp16_spec);
}
TEST_CASE("all floats -> bf16 match the reference, bulk == scalar", "[types][convert][exhaustive]") {
  exhaustive_against_reference<tessel::bf16>(tessel_ref::bf16_spec);
}
TEST_CASE("all floats -> bf16 agree with Eigen::bfloat16", "[types][convert][exhaustive][eigen]") {
  exhaustive_against_eigen<tessel::bf16, Eigen::bfloat16>();
}
TEST_CASE("all floats -> fp16 agree with Eigen::half", "[types][convert][exhaustive][eigen]") {
  exhaustive_against_eigen<tessel::fp16, Eigen::half>();
}
