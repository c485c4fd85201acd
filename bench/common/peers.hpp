// Which peer libraries this benchmark binary was built with. A peer whose package is missing or
// whose CMake config is broken is left out at configure time (tools/cmake/tesselOptionalPeer.cmake);
// the binary then says so in its context ("peers": ...), so a reader of a run or its JSON knows
// whether an absent peer row means "not measured" rather than "not run".
#pragma once

#include <benchmark/benchmark.h>

#include <string>

namespace tessel_bench {

inline std::string peer_list() {
  std::string s;
  auto add = [&](const char* name, bool have) {
    s += s.empty() ? "" : ", ";
    s += name;
    s += have ? "" : " (absent)";
  };
#if defined(TESSEL_HAVE_OPENBLAS)
  add("openblas", true);
#else
  add("openblas", false);
#endif
#if defined(TESSEL_HAVE_ONEDNN)
  add("onednn", true);
#else
  add("onednn", false);
#endif
  add("eigen", true);  // required by bench/CMakeLists.txt
  return s;
}

// Registers the context line once per binary, before BENCHMARK_MAIN's Initialize runs.
inline const bool peers_context_registered = [] {
  benchmark::AddCustomContext("peers", peer_list());
  return true;
}();

}  // namespace tessel_bench
