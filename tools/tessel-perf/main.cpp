// tessel-perf: collective benchmarks in the style of nccl-tests.
//   tessel-perf all_reduce -b 8 -e 256M -f 2 -n 20 --transport threads -g 2 [--algo ring] [--check]
// Prints size, count, type, redop, root, then time/algbw/busbw/#wrong for out-of-place and in-place.
// `tessel-perf moe` (moe.cpp) measures MoE dispatch/combine bandwidth on the emulated cluster.
// busbw = algbw * factor (nccl-tests): all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all,
// gather, scatter (n-1)/n; broadcast, reduce, sendrecv 1. On the emulated transport times are simulated,
// the cluster is the default UBL128 super-nodes or `--cluster FILE` (the emulator's config format),
// and a last column gives the busbw of emu::comm_model's closed form for the default algorithms.
// `--algo all` or a comma list runs the sweep once per algorithm; `--plot FILE.svg` draws the
// out-of-place busbw curves (one per algorithm, plus the closed form dashed); `--progress` (or a
// terminal on stderr) reports long sweeps on stderr.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <concepts>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <tessel/collectives.hpp>
#include <tessel/emulator/comm_model.hpp>
#include <tessel/emulator/config.hpp>
#include <tessel/emulator/plot.hpp>

#include "../common/args.hpp"
#if TESSEL_HAVE_MPI
#include <tessel/collectives/transport/mpi.hpp>
#endif
#if __has_include(<tessel/collectives/transport/emulated.hpp>)
#include <tessel/collectives/transport/emulated.hpp>
#define TESSEL_PERF_EMULATED 1
#endif

using namespace tessel;
using tessel_tools::parse_int;
using tessel_tools::parse_real;
using tessel_tools::parse_size;

namespace {

constexpr long long max_ranks = 1 << 20;      // beyond any cluster the emulator models
constexpr long long max_thread_ranks = 1024;  // one OS thread per rank on the threads transport

enum class coll { all_reduce, reduce, broadcast, all_gather, reduce_scatter, gather, scatter, all_to_all, sendrecv };

struct opts {
  coll kind = coll::all_reduce;
  std::string name = "all_reduce";
  std::size_t minb = 8, maxb = std::size_t{32} << 20;
  double factor = 2;
  std::size_t step = 0;
  int ranks = 2;
  int iters = 20, warmup = 5;
  dtype dt = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  bool check = false;
  std::string transport = "threads";
  algorithm algo = algorithm::automatic;               // the one being run
  std::vector<algorithm> algos{algorithm::automatic};  // --algo: one, a comma list, or all
  std::string compress = "none";
  bool ranks_given = false;
  std::string cluster_path;  // --cluster: the emulated machine
  std::optional<emu::cluster_config> cluster;
  std::string plot;       // --plot: busbw curves as SVG
  bool progress = false;  // --progress, or stderr is a terminal
  int node_size = 0;
  std::size_t segment = 0;  // pipelining unit of the ring/direct algorithms; 0: see main()
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "tessel-perf: %s\n"
               "usage: tessel-perf <all_reduce|reduce|broadcast|all_gather|reduce_scatter|gather|scatter|all_to_all|sendrecv>\n"
               "       tessel-perf moe ... (MoE dispatch/combine on the emulated cluster; tessel-perf moe --help)\n"
               "  -b/--minbytes SIZE  -e/--maxbytes SIZE  -f/--stepfactor F  -i/--stepbytes SIZE\n"
               "  -g/--ranks N (threads, emulated)  -n/--iters N  -w/--warmup_iters N\n"
               "  -d/--datatype f64|f32|bf16|fp16|e4m3|e5m2|i32|i64|u8  -o/--op sum|prod|min|max|avg  -r/--root R\n"
               "  -c/--check  --transport threads|emulated|mpi  --algo auto|ring|direct|halving_doubling|tree|hierarchical\n"
               "  --compress none|bf16|e4m3|e5m2|int4  --node-size G  --segment SIZE (pipelining unit)\n"
               "  --algo all|A,B,...: one sweep per algorithm  --plot FILE.svg: busbw vs size  --progress: on stderr\n"
               "  --cluster FILE (emulated: the cluster to model; -g defaults to its card count)\n"
               "  --cluster-keys: print the cluster config keys and exit\n",
               msg);
  std::exit(2);
}

coll parse_coll(const std::string& s) {
  const std::pair<const char*, coll> names[] = {
      {"all_reduce", coll::all_reduce},         {"reduce", coll::reduce},    {"broadcast", coll::broadcast}, {"all_gather", coll::all_gather},
      {"reduce_scatter", coll::reduce_scatter}, {"gather", coll::gather},    {"scatter", coll::scatter},     {"all_to_all", coll::all_to_all},
      {"alltoall", coll::all_to_all},           {"sendrecv", coll::sendrecv}};
  for (auto& [n, c] : names)
    if (s == n) return c;
  usage(("unknown collective '" + s + "'").c_str());
}

opts parse(int argc, char** argv) {
  opts o;
  if (argc < 2) usage("missing collective");
  o.name = argv[1];
  if (o.name == "--cluster-keys") {
    std::fputs(emu::describe_cluster_keys().c_str(), stdout);
    std::exit(0);
  }
  o.kind = parse_coll(o.name);
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    try {
      if (a == "-b" || a == "--minbytes")
        o.minb = parse_size(a, val());
      else if (a == "-e" || a == "--maxbytes")
        o.maxb = parse_size(a, val());
      else if (a == "-f" || a == "--stepfactor")
        o.factor = parse_real(a, val(), 1.0, 1e6);
      else if (a == "-i" || a == "--stepbytes")
        o.step = parse_size(a, val());
      else if (a == "-g" || a == "--ranks") {
        o.ranks = static_cast<int>(parse_int(a, val(), 1, max_ranks));
        o.ranks_given = true;
      } else if (a == "-n" || a == "--iters")
        o.iters = static_cast<int>(parse_int(a, val(), 1, 1000000));
      else if (a == "-w" || a == "--warmup_iters")
        o.warmup = static_cast<int>(parse_int(a, val(), 0, 1000000));
      else if (a == "-d" || a == "--datatype") {
        auto v = val();
        if (v == "float") v = "f32";
        if (v == "double") v = "f64";
        if (v == "int32") v = "i32";
        o.dt = dtype_from_name(v);
      } else if (a == "-o" || a == "--op")
        o.op = reduce_op_from_name(val());
      else if (a == "-r" || a == "--root")
        o.root = static_cast<int>(parse_int(a, val(), 0, max_ranks - 1));
      else if (a == "-c" || a == "--check") {
        if (i + 1 < argc && (std::string(argv[i + 1]) == "0" || std::string(argv[i + 1]) == "1"))
          o.check = std::string(argv[++i]) == "1";
        else
          o.check = true;
      } else if (a == "--transport")
        o.transport = val();
      else if (a == "--algo") {
        const std::string v = val();
        o.algos.clear();
        if (v == "all") {
          o.algos = {algorithm::ring, algorithm::direct, algorithm::halving_doubling, algorithm::tree, algorithm::hierarchical};
        } else {
          std::size_t at = 0;
          while (true) {
            const auto comma = v.find(',', at);
            const algorithm al = algorithm_from_name(v.substr(at, comma - at));
            if (std::find(o.algos.begin(), o.algos.end(), al) != o.algos.end())
              usage(("--algo names '" + v.substr(at, comma - at) + "' twice").c_str());
            o.algos.push_back(al);
            if (comma == std::string::npos) break;
            at = comma + 1;
          }
        }
        o.algo = o.algos.front();
      } else if (a == "--cluster")
        o.cluster_path = val();
      else if (a == "--cluster-keys") {
        std::fputs(emu::describe_cluster_keys().c_str(), stdout);
        std::exit(0);
      } else if (a == "--plot")
        o.plot = val();
      else if (a == "--progress")
        o.progress = true;
      else if (a == "--compress")
        o.compress = val();
      else if (a == "--node-size")
        o.node_size = static_cast<int>(parse_int(a, val(), 0, max_ranks));
      else if (a == "--segment")
        o.segment = parse_size(a, val());
      else
        usage(("unknown option " + a).c_str());
    } catch (const std::exception& e) {  // a bad number (std::stoi) or name (tessel::error)
      usage(e.what());
    }
  }
  if (o.factor <= 1 && o.step == 0) usage("step factor must be > 1");
  if (!o.cluster_path.empty()) {
    if (o.transport != "emulated")
      usage(("--cluster describes an emulated machine: it needs --transport emulated (got '" + o.transport + "')").c_str());
    try {
      o.cluster = emu::load_cluster_config(o.cluster_path);
    } catch (const tessel::error& e) { usage(e.what()); }
    const std::size_t cards = o.cluster->cards();
    if (!o.ranks_given)
      o.ranks = static_cast<int>(std::min<std::size_t>(cards, static_cast<std::size_t>(max_ranks)));
    else if (static_cast<std::size_t>(o.ranks) > cards)
      usage(("-g " + std::to_string(o.ranks) + " is more ranks than the " + std::to_string(cards) + " cards of " + o.cluster_path).c_str());
  }
  if (!o.plot.empty()) {  // refuse an unwritable path now, not after a long sweep
    std::error_code ec;
    const bool existed = std::filesystem::exists(o.plot, ec);
    std::FILE* f = std::fopen(o.plot.c_str(), "a");
    if (!f) usage(("--plot: cannot write '" + o.plot + "': " + std::strerror(errno)).c_str());
    std::fclose(f);
    if (!existed) std::filesystem::remove(o.plot, ec);
  }
  if (!o.progress) o.progress = ::isatty(STDERR_FILENO) == 1;
  if (o.minb > o.maxb)
    usage(("-b (" + std::to_string(o.minb) + " bytes) is larger than -e (" + std::to_string(o.maxb) + " bytes): nothing to run").c_str());
  if (o.transport == "threads" && o.ranks > max_thread_ranks)
    usage(("the threads transport runs one thread per rank: -g " + std::to_string(o.ranks) + " is above its " + std::to_string(max_thread_ranks) +
           " (use --transport emulated for large rank counts)")
              .c_str());
  if (o.root >= o.ranks && o.transport != "mpi")
    usage(("-r " + std::to_string(o.root) + " is not a rank of the " + std::to_string(o.ranks) + " ranks").c_str());
  if (o.segment && o.segment < 64) usage("--segment must be at least 64 bytes");
  if (o.transport != "threads" && o.transport != "emulated" && o.transport != "mpi") usage(("unknown transport '" + o.transport + "'").c_str());
  if (o.compress != "none") {
    try {
      (void)wire_format_from_name(o.compress);
    } catch (const tessel::error& e) { usage(e.what()); }
    if (o.kind != coll::all_reduce || o.dt != dtype::f32 || (o.op != reduce_op::sum && o.op != reduce_op::avg))
      usage("--compress applies to all_reduce of f32 with sum or avg");
    if (o.check) usage("--compress results are approximate: --check compares exact bits (see tests/collectives/compression.cpp)");
  }
  return o;
}

double bus_factor(coll k, int n) {
  const double dn = n;
  switch (k) {
    case coll::all_reduce: return 2 * (dn - 1) / dn;
    case coll::all_gather:
    case coll::reduce_scatter:
    case coll::all_to_all:
    case coll::gather:
    case coll::scatter: return (dn - 1) / dn;
    default: return 1;
  }
}

std::uint64_t mixh(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Verifiable data: element i of rank r, any rank can regenerate it. Values stay finite in every dtype.
void fill(std::byte* p, std::size_t count, dtype d, int rank, std::size_t first, reduce_op op) {
  visit_dtype(d, [&]<class T>(std::type_identity<T>) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t h = mixh(static_cast<std::uint64_t>(rank) * 0x9e3779b97f4a7c15ull ^ mixh(first + i));
      T v{};
      if constexpr (std::is_same_v<T, int4x2>)
        v = T{};
      else if constexpr (std::is_integral_v<T>)
        v = static_cast<T>(op == reduce_op::prod ? static_cast<std::int64_t>(h % 3) - 1 : static_cast<std::int64_t>(h % 64));
      else {
        const double u = static_cast<double>(h >> 11) * 0x1.0p-53;
        v = T(op == reduce_op::prod ? 0.5 + u : (u - 0.5) * 8);
      }
      std::memcpy(p + i * sizeof(T), &v, sizeof(T));
    }
  });
}

// Expected reduction of elements [first, first+count): regenerate every rank's data and fold in rank order.
// integers reduce with wrap-around, computed in an unsigned type (no signed-overflow UB)
template <class A>
struct wrap_of {
  using type = A;
};
template <std::integral A>
struct wrap_of<A> {
  using type = std::conditional_t<(sizeof(A) < 4), std::uint32_t, std::make_unsigned_t<A>>;
};

std::vector<std::byte> expected_reduce(std::size_t count, dtype d, reduce_op op, int n, std::size_t first) {
  // the canonical order, written out here: rank 0..n-1 folded into an FP32 (or own-type) accumulator
  std::vector<std::byte> out(count * dtype_size(d));
  visit_dtype(d, [&]<class T>(std::type_identity<T>) {
    if constexpr (!std::is_same_v<T, int4x2>) {
      using A = std::conditional_t<std::is_class_v<T>, float, T>;
      using W = typename wrap_of<A>::type;
      std::vector<std::byte> x(count * sizeof(T));
      std::vector<A> acc(count);
      for (int r = 0; r < n; ++r) {
        fill(x.data(), count, d, r, first, op);
        for (std::size_t i = 0; i < count; ++i) {
          T t;
          std::memcpy(&t, x.data() + i * sizeof(T), sizeof(T));
          const A v = static_cast<A>(t);
          A& a = acc[i];
          if (r == 0) {
            a = v;
            continue;
          }
          switch (op) {
            case reduce_op::sum:
            case reduce_op::avg: a = static_cast<A>(static_cast<W>(static_cast<W>(a) + static_cast<W>(v))); break;
            case reduce_op::prod: a = static_cast<A>(static_cast<W>(static_cast<W>(a) * static_cast<W>(v))); break;
            case reduce_op::min: a = (a != a) ? a : (v != v) ? v : (v < a ? v : a); break;
            case reduce_op::max: a = (a != a) ? a : (v != v) ? v : (a < v ? v : a); break;
          }
        }
      }
      for (std::size_t i = 0; i < count; ++i) {
        A a = acc[i];
        if (op == reduce_op::avg) {
          if constexpr (std::is_integral_v<A> && std::is_signed_v<A>)
            a = static_cast<A>(static_cast<std::int64_t>(a) / n);
          else if constexpr (std::is_integral_v<A>)
            a = static_cast<A>(static_cast<std::uint64_t>(a) / static_cast<std::uint64_t>(n));
          else
            a = a / static_cast<A>(n);
        }
        const T t = static_cast<T>(a);
        std::memcpy(out.data() + i * sizeof(T), &t, sizeof(T));
      }
    }
  });
  return out;
}

std::size_t count_wrong(const std::byte* got, const std::byte* want, std::size_t count, std::size_t es) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i) bad += std::memcmp(got + i * es, want + i * es, es) != 0;
  return bad;
}

struct result {
  double us = 0;
  std::size_t wrong = 0;
};

// One collective call on this rank. `count` follows nccl-tests: per-rank count for all_gather
// (send) and reduce_scatter (recv), per-peer for all_to_all.
void call(communicator& c, const opts& o, std::byte* send, std::byte* recv, std::size_t count, bool inplace) {
  const std::size_t es = dtype_size(o.dt), r = static_cast<std::size_t>(c.rank());
  const call_options co{o.algo};
  switch (o.kind) {
    case coll::all_reduce:
      if (o.compress != "none") {
        auto* in = reinterpret_cast<const float*>(inplace ? recv : send);
        all_reduce_compressed(c, std::span<const float>(in, count), std::span<float>(reinterpret_cast<float*>(recv), count), o.op,
                              {wire_format_from_name(o.compress), 256});
        return;
      }
      return c.all_reduce(inplace ? recv : send, recv, count, o.dt, o.op, co);
    case coll::reduce: return c.reduce(inplace ? recv : send, recv, count, o.dt, o.op, o.root, co);
    case coll::broadcast: return c.broadcast(inplace ? recv : send, recv, count, o.dt, o.root, co);
    case coll::all_gather: return c.all_gather(inplace ? recv + r * count * es : send, recv, count, o.dt, co);
    case coll::reduce_scatter: return c.reduce_scatter(inplace ? recv : send, inplace ? recv + r * count * es : recv, count, o.dt, o.op, co);
    case coll::gather: return c.gather(inplace ? recv + r * count * es : send, recv, count, o.dt, o.root);
    case coll::scatter: return c.scatter(inplace ? recv : send, inplace ? recv + r * count * es : recv, count, o.dt, o.root);
    case coll::all_to_all: return c.all_to_all(send, recv, count, o.dt);  // no in-place form
    case coll::sendrecv: {
      const int n = c.size();
      if (n == 1) return;
      const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
      if (c.rank() % 2 == 0) {
        c.send(send, count, o.dt, next);
        c.recv(recv, count, o.dt, prev);
      } else {
        c.recv(recv, count, o.dt, prev);
        c.send(send, count, o.dt, next);
      }
      return;
    }
  }
}

// Runs one size: returns the max time over ranks and the wrong count summed over ranks.
result measure(communicator& c, const opts& o, std::size_t count, bool inplace) {
  const int n = c.size();
  const std::size_t N = static_cast<std::size_t>(n), es = dtype_size(o.dt), r = static_cast<std::size_t>(c.rank());
  std::size_t sendc = count, recvc = count;
  switch (o.kind) {
    case coll::all_gather:
    case coll::gather: recvc = count * N; break;
    case coll::reduce_scatter:
    case coll::scatter:
      sendc = count * N;
      if (inplace) recvc = count * N;
      break;
    case coll::all_to_all: sendc = recvc = count * N; break;
    default: break;
  }
  if (inplace && (o.kind == coll::reduce_scatter || o.kind == coll::scatter)) recvc = count * N;
  // timing-only (emulated without --check): no buffers at all, the schedule runs on sizes alone
  const bool dry = c.transport_handle().timing_only();
  std::vector<std::byte> sb(dry ? 0 : sendc * es), rb(dry ? 0 : recvc * es);
  result res;
  if (inplace && (o.kind == coll::all_to_all || o.kind == coll::sendrecv)) return {-1, 0};
  auto prepare = [&] {  // inputs (in place: inside recv) hold verifiable data
    const auto op = o.op;
    if (dry) return;
    switch (o.kind) {
      case coll::all_reduce:
      case coll::reduce:
      case coll::broadcast: fill(inplace ? rb.data() : sb.data(), count, o.dt, c.rank(), 0, op); break;
      case coll::all_gather:
      case coll::gather: fill(inplace ? rb.data() + r * count * es : sb.data(), count, o.dt, c.rank(), 0, op); break;
      case coll::reduce_scatter:
      case coll::scatter: fill(inplace ? rb.data() : sb.data(), count * N, o.dt, c.rank(), 0, op); break;
      case coll::all_to_all: fill(sb.data(), count * N, o.dt, c.rank(), 0, op); break;
      case coll::sendrecv: fill(sb.data(), count, o.dt, c.rank(), 0, op); break;
    }
  };
  prepare();
  for (int i = 0; i < o.warmup; ++i) {
    call(c, o, sb.data(), rb.data(), count, inplace);
    if (inplace) prepare();
  }
  c.barrier();
  const double t0 = c.now();
  for (int i = 0; i < o.iters; ++i) call(c, o, sb.data(), rb.data(), count, inplace);
  double dt = (c.now() - t0) / o.iters * 1e6;
  double tmax = 0;
  if (dry) {  // no arithmetic in a timing-only run: time to the end of a closing barrier instead
    c.barrier();
    tmax = (c.now() - t0) / o.iters * 1e6;
  } else {
    c.all_reduce(&dt, &tmax, 1, dtype::f64, reduce_op::max);
  }
  res.us = tmax;
  if (o.check && !dry) {
    prepare();
    call(c, o, sb.data(), rb.data(), count, inplace);
    std::size_t bad = 0;
    std::vector<std::byte> want;
    auto rank_data = [&](int q, std::size_t cnt, std::size_t first) {
      std::vector<std::byte> v(cnt * es);
      fill(v.data(), cnt, o.dt, q, first, o.op);
      return v;
    };
    switch (o.kind) {
      case coll::all_reduce:
        want = expected_reduce(count, o.dt, o.op, n, 0);
        bad = count_wrong(rb.data(), want.data(), count, es);
        break;
      case coll::reduce:
        if (c.rank() == o.root) {
          want = expected_reduce(count, o.dt, o.op, n, 0);
          bad = count_wrong(rb.data(), want.data(), count, es);
        }
        break;
      case coll::broadcast:
        want = rank_data(o.root, count, 0);
        bad = count_wrong(rb.data(), want.data(), count, es);
        break;
      case coll::all_gather:
        for (int q = 0; q < n; ++q) {
          want = rank_data(q, count, 0);
          bad += count_wrong(rb.data() + static_cast<std::size_t>(q) * count * es, want.data(), count, es);
        }
        break;
      case coll::gather:
        if (c.rank() == o.root)
          for (int q = 0; q < n; ++q) {
            want = rank_data(q, count, 0);
            bad += count_wrong(rb.data() + static_cast<std::size_t>(q) * count * es, want.data(), count, es);
          }
        break;
      case coll::reduce_scatter:
        want = expected_reduce(count, o.dt, o.op, n, r * count);
        bad = count_wrong(inplace ? rb.data() + r * count * es : rb.data(), want.data(), count, es);
        break;
      case coll::scatter:
        want = rank_data(o.root, count, r * count);
        bad = count_wrong(inplace ? rb.data() + r * count * es : rb.data(), want.data(), count, es);
        break;
      case coll::all_to_all:
        for (int q = 0; q < n; ++q) {
          want = rank_data(q, count, r * count);
          bad += count_wrong(rb.data() + static_cast<std::size_t>(q) * count * es, want.data(), count, es);
        }
        break;
      case coll::sendrecv:
        if (n > 1) {
          want = rank_data((c.rank() + n - 1) % n, count, 0);
          bad = count_wrong(rb.data(), want.data(), count, es);
        }
        break;
    }
    std::uint64_t b = bad, tot = 0;
    c.all_reduce(&b, &tot, 1, dtype::u64, reduce_op::sum);
    res.wrong = static_cast<std::size_t>(tot);
  }
  return res;
}

// One row of a sweep, for the plot.
struct row {
  std::size_t bytes = 0;
  double busbw = 0;        // out-of-place, GB/s (NaN when there is no time)
  double model_busbw = 0;  // the closed form's, GB/s (NaN when there is none)
};

// The closed-form time (seconds) of one collective of `bytes` (nccl-tests' size) on the emulated
// cluster, from emu::comm_model: the communicator's default algorithms (direct, hierarchical
// across super-nodes). NaN for the collectives it does not model.
double model_seconds(const opts& o, int n, std::size_t bytes) {
  if (!o.cluster) return std::nan("");
  const emu::comm_model m(*o.cluster);
  const std::size_t per = o.cluster->cards_per_supernode, N = static_cast<std::size_t>(n);
  const emu::group_shape g{N, N > per ? per : N};
  const double b = static_cast<double>(bytes);
  const double acc = (o.dt == dtype::bf16 || o.dt == dtype::fp16) ? 2 : 1;
  switch (o.kind) {
    case coll::all_reduce: return m.all_reduce(g, b, acc, true);
    case coll::reduce_scatter: return m.reduce_scatter(g, b);
    case coll::all_gather: return m.all_gather(g, b);
    case coll::all_to_all: return m.all_to_all(g, b);
    case coll::sendrecv: return n > 1 ? m.message(b, N <= per) : std::nan("");
    default: return std::nan("");
  }
}

std::vector<row> run(communicator& c, const opts& o) {
  std::vector<row> rows;
  const int n = c.size();
  const bool print = c.rank() == 0;
  const std::size_t es = dtype_size(o.dt), N = static_cast<std::size_t>(n);
  if (o.root < 0 || o.root >= n) throw std::out_of_range("tessel-perf: root outside the ranks");
  const bool rooted = o.kind == coll::reduce || o.kind == coll::broadcast || o.kind == coll::gather || o.kind == coll::scatter;
  const bool reduces = o.kind == coll::all_reduce || o.kind == coll::reduce || o.kind == coll::reduce_scatter;
  const bool model = o.cluster.has_value();  // the closed-form column (emulated transport)
  if (print) {
    std::printf("# tessel-perf %s: transport %s, %d ranks, algo %s, compress %s, %d iters, %d warmup%s\n", o.name.c_str(), o.transport.c_str(), n,
                std::string(algorithm_name(o.algo)).c_str(), o.compress.c_str(), o.iters, o.warmup,
                c.transport_handle().is_simulated() ? " (simulated time)" : "");
    if (model)
      std::printf(
          "# cluster %s: %zu cards (%zu per super-node), %.4g GB/s per card, %.4g us one-hop latency; model: busbw of "
          "emu::comm_model's closed form (direct, hierarchical across super-nodes)\n",
          o.cluster_path.empty() ? "UBL128 defaults" : o.cluster_path.c_str(), o.cluster->cards(), o.cluster->cards_per_supernode,
          o.cluster->card_bandwidth() / 1e9, o.cluster->direct_latency() * 1e6);
    std::printf("#%72s%32s\n", "out-of-place", "in-place");
    std::printf("#%11s %13s %6s %6s %6s %10s %7s %7s %6s %10s %7s %7s %6s%s\n", "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                "#wrong", "time", "algbw", "busbw", "#wrong", model ? "   model" : "");
    std::printf("#%11s %13s %6s %6s %6s %10s %7s %7s %6s %10s %7s %7s %6s%s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                "(us)", "(GB/s)", "(GB/s)", "", model ? "  (GB/s)" : "");
  }
  std::size_t steps = 0;  // sizes in the sweep, for the progress line
  for (std::size_t size = o.minb; size <= o.maxb; ++steps) {
    const std::size_t next = o.step ? size + o.step : static_cast<std::size_t>(static_cast<double>(size) * o.factor);
    if (next <= size) {
      ++steps;
      break;
    }
    size = next;
  }
  const auto wall0 = std::chrono::steady_clock::now();
  std::size_t step = 0;
  double bw_sum = 0;
  int bw_n = 0;
  std::size_t total_wrong = 0;
  for (std::size_t size = o.minb; size <= o.maxb;) {
    // nccl-tests: size is the total buffer; per-rank counts divide it for the gather/scatter family
    std::size_t count = size / es;
    if (o.kind == coll::all_gather || o.kind == coll::reduce_scatter || o.kind == coll::all_to_all || o.kind == coll::gather ||
        o.kind == coll::scatter)
      count = size / es / N;
    const std::size_t bytes = (o.kind == coll::all_gather || o.kind == coll::reduce_scatter || o.kind == coll::all_to_all || o.kind == coll::gather ||
                               o.kind == coll::scatter)
                                  ? count * N * es
                                  : count * es;
    const result a = measure(c, o, count, false);
    const result b = measure(c, o, count, true);
    if (print) {
      auto cols = [&](const result& x) {
        if (x.us < 0) {
          std::printf(" %10s %7s %7s %6s", "N/A", "N/A", "N/A", "N/A");
          return;
        }
        const double algbw = x.us > 0 ? static_cast<double>(bytes) / (x.us * 1e3) : 0;
        const double busbw = algbw * bus_factor(o.kind, n);
        std::printf(" %10.2f %7.2f %7.2f", x.us, algbw, busbw);
        if (o.check)
          std::printf(" %6zu", x.wrong);
        else
          std::printf(" %6s", "N/A");
      };
      std::printf(" %11zu %13zu %6s %6s %6d", bytes, count, std::string(dtype_name(o.dt)).c_str(),
                  reduces ? std::string(reduce_op_name(o.op)).c_str() : "none", rooted ? o.root : -1);
      cols(a);
      cols(b);
      row r;
      r.bytes = bytes;
      r.busbw = a.us > 0 ? static_cast<double>(bytes) / (a.us * 1e3) * bus_factor(o.kind, n) : std::nan("");
      const double ms = model ? model_seconds(o, n, bytes) : std::nan("");
      r.model_busbw = ms > 0 ? static_cast<double>(bytes) / ms / 1e9 * bus_factor(o.kind, n) : std::nan("");
      if (model) {
        if (std::isfinite(r.model_busbw))
          std::printf(" %7.2f", r.model_busbw);
        else
          std::printf(" %7s", "N/A");
      }
      rows.push_back(r);
      std::printf("\n");
      std::fflush(stdout);
      ++step;
      if (o.progress) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
        std::fprintf(stderr, "%s[%zu/%zu] %s %s %zu B, %.1f s", ::isatty(STDERR_FILENO) == 1 ? "\r\033[K" : "", step, steps, o.name.c_str(),
                     std::string(algorithm_name(o.algo)).c_str(), bytes, secs);
        if (step < steps) std::fprintf(stderr, ", about %.0f s left", secs / static_cast<double>(step) * static_cast<double>(steps - step));
        std::fprintf(stderr, ::isatty(STDERR_FILENO) == 1 && step < steps ? "" : "\n");
        std::fflush(stderr);
      }
      if (a.us > 0) {
        bw_sum += static_cast<double>(bytes) / (a.us * 1e3) * bus_factor(o.kind, n);
        ++bw_n;
      }
    }
    total_wrong += a.wrong + b.wrong;
    const std::size_t next = o.step ? size + o.step : static_cast<std::size_t>(static_cast<double>(size) * o.factor);
    if (next <= size) break;
    size = next;
  }
  if (print) {
    std::printf("# Out of bounds values : %zu %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    std::printf("# Avg bus bandwidth    : %g\n", bw_n ? bw_sum / bw_n : 0.0);
  }
  if (total_wrong) throw std::runtime_error("tessel-perf: wrong results");
  return rows;
}

// The busbw curves of every algorithm's sweep, and the closed form once (dashed), as SVG.
void write_plot(const opts& o, const std::vector<std::pair<algorithm, std::vector<row>>>& sweeps) {
  emu::plot_options po;
  po.title = "tessel-perf " + o.name + ": " + std::to_string(o.ranks) + " ranks, " + o.transport +
             (o.cluster_path.empty() ? std::string() : " (" + std::filesystem::path(o.cluster_path).filename().string() + ")") + ", " +
             std::string(dtype_name(o.dt));
  po.y_label = "busbw, out-of-place (GB/s)";
  emu::line_plot p(po);
  std::vector<double> mx, my;
  for (const auto& [al, rows] : sweeps) {
    std::vector<double> x, y;
    for (const auto& r : rows) {
      x.push_back(static_cast<double>(r.bytes));
      y.push_back(r.busbw);
    }
    if (!x.empty()) p.add(std::string(algorithm_name(al)), x, y);
    if (mx.empty())
      for (const auto& r : rows)
        if (std::isfinite(r.model_busbw)) {
          mx.push_back(static_cast<double>(r.bytes));
          my.push_back(r.model_busbw);
        }
  }
  if (!mx.empty()) p.add("closed form (comm_model)", mx, my, true);
  if (p.skipped()) std::fprintf(stderr, "tessel-perf: --plot: %zu points without a time (N/A) are left out\n", p.skipped());
  p.write(o.plot);
  std::printf("# plot written to %s\n", o.plot.c_str());
}

}  // namespace

int moe_main(int argc, char** argv);  // moe.cpp

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "moe") return moe_main(argc, argv);
  opts o = parse(argc, argv);
#if TESSEL_PERF_EMULATED
  if (o.transport == "emulated" && !o.cluster) {  // the default machine: super-nodes of 128 UBL128 cards
    emu::cluster_config cfg;
    const std::size_t n = static_cast<std::size_t>(o.ranks);
    cfg.cards_per_supernode = std::min<std::size_t>(n, 128);
    if (n % cfg.cards_per_supernode != 0)
      usage(("-g " + std::to_string(n) + ": more than 128 ranks must be a multiple of 128 on the default cluster (or give --cluster)").c_str());
    cfg.scaleout.supernodes = n / cfg.cards_per_supernode;
    o.cluster = cfg;
  }
#endif
  std::vector<std::pair<algorithm, std::vector<row>>> sweeps;
  std::mutex rows_mu;
  auto keep = [&](algorithm al, std::vector<row> rows) {
    if (rows.empty()) return;  // only rank 0 prints and keeps its rows
    std::lock_guard lk(rows_mu);
    sweeps.emplace_back(al, std::move(rows));
  };
  try {
#if TESSEL_HAVE_MPI
    bool mpi_up = false;
#endif
    for (std::size_t ai = 0; ai < o.algos.size(); ++ai) {
      const algorithm al = o.algos[ai];
      o.algo = al;
      if (ai > 0) std::printf("\n");
      comm_options co;
      co.node_size = o.node_size;
      if (o.segment) co.segment_bytes = o.segment;
      if (o.transport == "threads") {
        threads_world::run(o.ranks, [&](threads_transport t) {
          communicator c(std::move(t), co);
          auto rows = run(c, o);
          if (c.rank() == 0) keep(al, std::move(rows));
        });
      } else if (o.transport == "mpi") {
#if TESSEL_HAVE_MPI
        if (!mpi_up) {
          int provided = 0;
          MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
          mpi_up = true;
        }
        int rc = 0;
        {
          communicator c(mpi_transport(MPI_COMM_WORLD), co);
          try {
            auto rows = run(c, o);
            if (c.rank() == 0) keep(al, std::move(rows));
          } catch (const std::exception& e) {
            std::fprintf(stderr, "tessel-perf: %s\n", e.what());
            rc = 1;
          }
        }
        if (rc) {
          MPI_Finalize();
          return rc;
        }
#else
        usage("this tessel-perf was built without MPI (tessel::mpi not found)");
#endif
      } else if (o.transport == "emulated") {
#if TESSEL_PERF_EMULATED
        // Fewer, larger messages simulate faster, and the direct algorithms lose nothing by them: the
        // fabric model overlaps every posted transfer. A ring is a chain of hops that pipelines only
        // by its segments (one 8 MiB segment on 16 cards took 6x the time of 512 KiB ones), so it
        // keeps the library's unit.
        if (!o.segment && al != algorithm::ring) co.segment_bytes = std::size_t{64} << 20;
        emu::cluster_config cfg = *o.cluster;
        cfg.timing_only = !o.check;  // payloads only when they are checked
        // large transfers queue behind each other for long in big runs
        cfg.faults.op_timeout = std::max(cfg.faults.op_timeout, 1.0);
        emu::cluster cl(cfg, 1);
        std::vector<std::size_t> cards(static_cast<std::size_t>(o.ranks));
        std::iota(cards.begin(), cards.end(), std::size_t{0});
        emulated_world(cl, cards).run([&](emulated_transport t) {
          communicator c(std::move(t), co);
          auto rows = run(c, o);
          if (c.rank() == 0) keep(al, std::move(rows));
        });
#else
        usage("the emulated transport is not available in this build");
#endif
      } else {
        usage(("unknown transport '" + o.transport + "'").c_str());
      }
    }
#if TESSEL_HAVE_MPI
    int rank = 0;
    if (mpi_up) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (!o.plot.empty() && rank == 0) write_plot(o, sweeps);
    if (mpi_up) MPI_Finalize();
#else
    if (!o.plot.empty()) write_plot(o, sweeps);
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-perf: %s\n", e.what());
    return 1;
  }
  return 0;
}
