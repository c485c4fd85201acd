// Catch2 matcher for the library's one error family: a thrown tessel::error must carry the
// expected code and a message that starts with "tessel::<area>: " (and optionally contains a
// fragment), so a test pins the type, the code and the text in one assertion:
//   CHECK_THROWS_MATCHES(gemm(...), gemm_error, is_error(errc::invalid_argument, "gemm", "lda"));
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include <tessel/error.hpp>

namespace tessel_test {

class error_matcher : public Catch::MatcherBase<tessel::error> {
 public:
  error_matcher(tessel::errc code, std::string area, std::string fragment) : code_(code), area_(std::move(area)), fragment_(std::move(fragment)) {}
  bool match(const tessel::error& e) const override {
    const std::string what = e.what();
    return e.code() == code_ && area_ == e.area() && what.rfind("tessel::" + area_ + ": ", 0) == 0 && what.find(fragment_) != std::string::npos;
  }
  std::string describe() const override {
    return "is a tessel error with code '" + std::string(tessel::to_string(code_)) + "', area '" + area_ + "'" +
           (fragment_.empty() ? "" : " and text containing '" + fragment_ + "'");
  }

 private:
  tessel::errc code_;
  std::string area_, fragment_;
};

inline error_matcher is_error(tessel::errc code, std::string area, std::string fragment = {}) { return {code, std::move(area), std::move(fragment)}; }

}  // namespace tessel_test
