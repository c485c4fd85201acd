// The GEMM tuner: times the bit-neutral plans (gemm_tune.hpp) of each given problem on this
// machine and records the fastest in the process's plan table, from where save_gemm_tune writes the
// cache that later processes load. Every candidate's result is compared bit for bit with the
// heuristic's: a plan that changed a bit would be a library bug, and the tuner throws rather than
// record it.
//
//   std::vector<tessel::gemm_tune_problem> ps = {{transpose::none, transpose::yes, 4096, 4096, 1024}};
//   auto report = tessel::gemm_autotune<float, float, float>(dev, ps);
//   tessel::save_gemm_tune(tessel::gemm_tune_path());
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <tessel/ops/gemm.hpp>

namespace tessel {
inline namespace v0 {

struct gemm_tune_problem {
  transpose ta = transpose::none, tb = transpose::none;
  std::size_t M = 0, N = 0, K = 0;
};

struct gemm_tune_options {
  int rounds = 5;            // timed rounds; each runs every candidate once, in turn
  double min_gain = 0.03;    // a plan replaces the heuristic only when its fastest round is this much faster
  double max_seconds = 3.0;  // per problem: fewer rounds when one call is long (at least 2)
  bool record = true;        // record the winners (and drop plans the heuristic now beats)
};

struct gemm_tune_result {
  gemm_tune_problem problem;
  gemm_tune_key key;
  bool tunable = false;          // takes the packed path (others have no plan to choose)
  gemm_plan plan;                // the chosen plan, explicit (default: the heuristic's blocking won)
  double heuristic_seconds = 0;  // fastest round of the heuristic's blocking
  double best_seconds = 0;       // fastest round of the chosen plan
  std::size_t candidates = 0;    // distinct blockings timed (the heuristic's included)
  int rounds = 0;
  double speedup() const { return best_seconds > 0 ? heuristic_seconds / best_seconds : 1.0; }
};

}  // namespace v0

namespace detail {

// Candidate plans for one problem: row blocks of 1 to 8 per matrix (whole 72-row slabs, distinct,
// at most 2048 rows), each with or without packing a transposed A once, and, with several workers,
// on the calling thread; a C of at most 256 columns also as its transpose or not. The default plan
// comes first.
inline std::vector<gemm_plan> gemm_tune_candidates(const gemm_tune_key& k) {
  std::vector<gemm_plan> out{gemm_plan{}};
  auto add = [&](const gemm_plan& p) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  };
  const std::size_t slabs = ceil_div(k.M, gemm_mc);
  std::vector<std::size_t> rows;
  for (std::size_t blocks = 1; blocks <= 8 && blocks <= slabs; ++blocks) {
    const std::size_t r = ceil_div(slabs, blocks) * gemm_mc;
    if (r <= gemm_max_block_rows && std::find(rows.begin(), rows.end(), r) == rows.end()) rows.push_back(r);
  }
  const bool a_transposed = k.ta && k.K > 1;
  for (std::size_t r : rows) {
    add({r, -1, false});
    if (a_transposed) {
      add({r, 0, false});
      add({r, 1, false});
    }
    if (k.workers > 1) add({r, -1, true});
  }
  // a narrow-ish C as its transpose, or not (the launch ignores it where the product cannot swap);
  // its packing choices apply to the swapped operands (a transposed op(B)ᵀ when B is not stored transposed)
  if (k.N <= 256) {
    for (int swap : {0, 1}) {
      add({0, -1, false, swap});
      add({0, 0, false, swap});
      add({0, 1, false, swap});
      if (k.workers > 1) add({0, -1, true, swap});
    }
  }
  return out;
}

template <class T>
std::vector<T> gemm_tune_operand(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(rng));
  return v;
}

}  // namespace detail

inline namespace v0 {

// Tunes each problem of element types (TA, TB) -> TC on `dev` (its worker count is part of every
// plan's key). Problems that do not take the packed path (tiny, skinny, matrix-vector: their paths
// have nothing to choose) are reported as not tunable. Throws gemm_error for bad problems, and
// gemm_error(errc::unsupported) if a candidate plan changed a result's bits.
template <gemm_input TA, gemm_input TB, gemm_output TC, class Dev>
std::vector<gemm_tune_result> gemm_autotune(Dev& dev, std::span<const gemm_tune_problem> problems, const gemm_tune_options& opt = {}) {
  if (opt.rounds < 1 || !(opt.min_gain >= 0) || !(opt.max_seconds > 0))
    throw gemm_error(errc::invalid_argument, "gemm_autotune: rounds must be >= 1, min_gain >= 0 and max_seconds > 0");
  using clock = std::chrono::steady_clock;
  std::vector<gemm_tune_result> out;
  for (const gemm_tune_problem& p : problems) {
    gemm_tune_result r;
    r.problem = p;
    const bool ta = p.ta == transpose::yes, tb = p.tb == transpose::yes;
    const std::size_t M = p.M, N = p.N, K = p.K;
    if (M == 0 || N == 0 || K == 0) {
      out.push_back(r);
      continue;
    }
    const std::size_t lda = ta ? M : K, ldb = tb ? K : N;
    const auto a = detail::gemm_tune_operand<TA>(detail::mul_checked(M, K, "gemm_autotune size"), 1);
    const auto b = detail::gemm_tune_operand<TB>(detail::mul_checked(K, N, "gemm_autotune size"), 2);
    std::vector<TC> ref(detail::mul_checked(M, N, "gemm_autotune size")), c(ref.size());
    // The key as the launch computes it (from the operands' strides).
    const auto av = detail::op_view(a.data(), p.ta, M, K, lda);
    const auto bv = detail::op_view(b.data(), p.tb, K, N, ldb);
    r.key = gemm_tune_key{
        dtype_of<TA>, dtype_of<TB>, dtype_of<TC>, av.col_stride() != 1, bv.col_stride() != 1, M, N, K, std::max(1u, dev.capabilities().workers)};
    struct unforce {
      ~unforce() { detail::gemm_plan_forced = nullptr; }
    } guard;
    auto call = [&](const gemm_plan& plan, std::vector<TC>& dst) {
      detail::gemm_plan_forced = &plan;
      gemm(dev, p.ta, p.tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, dst.data(), N);
      dev.synchronize();
      detail::gemm_plan_forced = nullptr;
    };
    const gemm_plan heuristic{};
    const auto t0 = clock::now();
    call(heuristic, ref);
    const double first = std::chrono::duration<double>(clock::now() - t0).count();
    r.tunable = detail::gemm_plan_consulted;
    if (!r.tunable) {
      out.push_back(r);
      continue;
    }
    const gemm_plan heuristic_applied = detail::gemm_plan_applied;
    // Warm-up and the bit check: every candidate must reproduce the heuristic's result. Candidates
    // are kept by what they do (the applied plan): two spellings of one blocking are timed once.
    std::vector<gemm_plan> cands{heuristic_applied};
    for (const gemm_plan& plan : detail::gemm_tune_candidates(r.key)) {
      std::fill(c.begin(), c.end(), TC(0.0f));
      call(plan, c);
      if (std::memcmp(c.data(), ref.data(), c.size() * sizeof(TC)) != 0)
        throw gemm_error(errc::unsupported, "gemm_autotune: plan {block_rows " + std::to_string(plan.block_rows) + ", pack_a " +
                                                std::to_string(plan.pack_a) + ", swap " + std::to_string(plan.swap) +
                                                "} changed the result's bits, " + detail::gemm_shape(M, N, K) + " (a library bug)");
      if (std::find(cands.begin(), cands.end(), detail::gemm_plan_applied) == cands.end()) cands.push_back(detail::gemm_plan_applied);
    }
    r.candidates = cands.size();
    const double per_round = std::max(first, 1e-9) * double(cands.size());
    r.rounds = std::max(2, std::min(opt.rounds, static_cast<int>(opt.max_seconds / per_round)));
    // The fastest of the rounds: on a shared machine a slow round says more about the neighbours
    // than about the blocking.
    std::vector<double> best_time(cands.size(), 1e300);
    for (int round = 0; round < r.rounds; ++round)
      for (std::size_t i = 0; i < cands.size(); ++i) {
        const std::size_t j = (i + std::size_t(round)) % cands.size();  // rotate the order: no candidate always runs first
        const auto t = clock::now();
        call(cands[j], c);
        best_time[j] = std::min(best_time[j], std::chrono::duration<double>(clock::now() - t).count());
      }
    const std::size_t best = static_cast<std::size_t>(std::min_element(best_time.begin(), best_time.end()) - best_time.begin());
    r.heuristic_seconds = best_time[0];
    r.best_seconds = best_time[0];
    if (best != 0 && best_time[best] < best_time[0] * (1.0 - opt.min_gain)) {
      r.plan = cands[best];
      r.best_seconds = best_time[best];
    }
    if (opt.record) set_gemm_plan(r.key, r.plan);
    out.push_back(r);
  }
  return out;
}

template <gemm_input TA, gemm_input TB, gemm_output TC, class Dev>
std::vector<gemm_tune_result> gemm_autotune(Dev& dev, const std::vector<gemm_tune_problem>& problems, const gemm_tune_options& opt = {}) {
  return gemm_autotune<TA, TB, TC>(dev, std::span<const gemm_tune_problem>(problems), opt);
}

}  // namespace v0
}  // namespace tessel
