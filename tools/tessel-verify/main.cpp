// tessel-verify: checks the library's operators against independent fp64 references (tessel/verify/ops.hpp).
//   tessel-verify --all                 every operator
//   tessel-verify --list                their names and what each checks
//   tessel-verify gemm/f32 softmax ...  the named ones (a name ending in '/' or a prefix selects a family)
// Options: --threads N (default 2; determinism compares 1 thread with N), --seed S, --quick (fewer
// shapes), --verbose (every check's line, not only failures). Exit 0 when every check passes,
// 1 when one fails (or an entry breaks the entries' contract: fewer than 4 checks, a mistrusted
// check, a report not named after its entry, two entries of one name), 2 on bad arguments.
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include <tessel/verify/ops.hpp>

#include "../common/args.hpp"

namespace {

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "tessel-verify: %s\n"
               "usage: tessel-verify (--all | --list | NAME...) [--threads N] [--seed S] [--quick] [--verbose]\n"
               "  NAME: an operator's entry (see --list), or a prefix of several (gemm selects gemm/f32, gemm/bf16, ...)\n",
               msg.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tessel;
  verify::run_options o;
  bool all = false, list = false, verbose = false;
  std::vector<std::string> names;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) usage(a + " needs a value");
        return argv[++i];
      };
      if (a == "--all")
        all = true;
      else if (a == "--list")
        list = true;
      else if (a == "--quick")
        o.quick = true;
      else if (a == "--verbose" || a == "-v")
        verbose = true;
      else if (a == "--threads" || a == "-t")
        o.threads = static_cast<unsigned>(tessel_tools::parse_int(a, value(), 1, 1024));
      else if (a == "--seed")
        o.seed = static_cast<std::uint64_t>(tessel_tools::parse_int(a, value(), 0, std::numeric_limits<long long>::max()));
      else if (a == "--help" || a == "-h") {
        std::printf("tessel-verify: the library's operators against independent fp64 references\n");
        std::printf("usage: tessel-verify (--all | --list | NAME...) [--threads N] [--seed S] [--quick] [--verbose]\n");
        return 0;
      } else if (!a.empty() && a[0] == '-')
        usage("unknown option " + a);
      else
        names.push_back(a);
    }
  } catch (const std::invalid_argument& e) { usage(e.what()); }
  const auto& lib = verify::library();
  if (list) {
    for (const auto& e : lib) std::printf("%-16s %s\n", e.name.c_str(), e.what.c_str());
    return 0;
  }
  if (!all && names.empty()) usage("say which operators: --all, --list or names");
  if (all && !names.empty()) usage("--all and names together");
  std::vector<const verify::entry*> chosen;
  for (const auto& e : lib)
    if (all) chosen.push_back(&e);
  for (const auto& n : names) {
    std::size_t found = 0;
    for (const auto& e : lib)
      if (e.name == n || e.name.rfind(n, 0) == 0) {
        chosen.push_back(&e);
        ++found;
      }
    if (!found) usage("no operator named '" + n + "' (tessel-verify --list)");
  }
  std::size_t failed_ops = 0, checks = 0, failed = 0, mistrusted = 0;
  // The library's own entries keep a contract beyond passing: unique names, at least 4 checks
  // (the shape sweep), reports named after their entry, and no check that cannot discriminate.
  std::set<std::string> seen;
  bool contract_ok = true;
  for (const auto& e : lib)
    if (!seen.insert(e.name).second) {
      std::printf("two entries are named '%s'\n", e.name.c_str());
      contract_ok = false;
    }
  for (const auto* e : chosen) {
    const auto t0 = std::chrono::steady_clock::now();
    const verify::suite s = verify::run(*e, o);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    checks += s.reports.size();
    failed += s.failed();
    mistrusted += s.mistrusted();
    std::string broken;
    if (s.reports.size() < 4) broken += " fewer than 4 checks;";
    if (s.mistrusted() != 0) broken += " a check that cannot discriminate (mistrusted);";
    for (const auto& r : s.reports)
      if (r.name.rfind(e->name + ": ", 0) != 0) broken += " report '" + r.name + "' not named after its entry;";
    const bool ok = s.passed() && broken.empty();
    if (!ok) ++failed_ops;
    for (const auto& r : s.reports)
      if (verbose || !r.passed() || r.mistrusted) std::printf("  %s\n", r.to_string().c_str());
    if (!broken.empty()) std::printf("  %s:%s\n", e->name.c_str(), broken.c_str());
    std::printf("%-16s %s  %zu checks, %zu failed, %zu mistrusted  (%.2f s)\n", e->name.c_str(), ok ? "ok  " : "FAIL", s.reports.size(), s.failed(),
                s.mistrusted(), secs);
    std::fflush(stdout);
  }
  std::printf("%zu of %zu operators passed (%zu checks, %zu failed, %zu mistrusted; %u threads, seed %llu%s)\n", chosen.size() - failed_ops,
              chosen.size(), checks, failed, mistrusted, o.threads, static_cast<unsigned long long>(o.seed), o.quick ? ", quick" : "");
  return failed_ops == 0 && contract_ok ? 0 : 1;
}
