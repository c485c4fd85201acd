// Strict positional arguments for the examples: a number must be a whole number in its range
// (no trailing garbage, no wrap of -5 into a huge size), and extra arguments are an error. Bad input
// prints what is wrong and the usage, and exits with status 2.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

#include "../tools/common/args.hpp"

namespace example_args {

class positional {
 public:
  // `usage`: the arguments after the program name, e.g. "[cards 1..128] [steps >= 1]".
  positional(int argc, char** argv, const char* usage, int max_args) : argc_(argc), argv_(argv), usage_(usage) {
    if (argc_ - 1 > max_args) fail("too many arguments (" + std::to_string(argc_ - 1) + ", at most " + std::to_string(max_args) + ")");
  }
  int count() const { return argc_ - 1; }
  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\nusage: %s %s\n", argv_[0], why.c_str(), argv_[0], usage_);
    std::exit(2);
  }
  // Argument i (1-based) as an integer in [lo, hi], or `fallback` when it is absent.
  long long integer(int i, const char* name, long long lo, long long hi, long long fallback) const {
    if (i >= argc_) return fallback;
    try {
      return tessel_tools::parse_int(name, argv_[i], lo, hi);
    } catch (const std::invalid_argument& e) { fail(e.what()); }
  }
  std::string text(int i, const std::string& fallback) const { return i < argc_ ? std::string(argv_[i]) : fallback; }
  // Argument i as a file the example will write: checked before any work (an unwritable path is a
  // bad argument, not a crash after minutes of running).
  std::string output(int i, const char* name, const std::string& fallback) const {
    const std::string path = text(i, fallback);
    std::ofstream f(path, std::ios::app);
    if (!f) fail(std::string(name) + ": cannot write '" + path + "'");
    return path;
  }

 private:
  int argc_;
  char** argv_;
  const char* usage_;
};

}  // namespace example_args
