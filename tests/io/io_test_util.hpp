// Helpers shared by the io tests: a scratch directory removed at scope exit, and a check that a
// call throws io_error with a given code and message text (any other exception fails the test).
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <filesystem>
#include <string>
#include <string_view>
#include <unistd.h>

#include <tessel/io/errors.hpp>

namespace io_test {

class temp_dir {
 public:
  temp_dir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() / ("tessel_io_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

template <class F>
void require_io_error(F&& f, tessel::errc code, std::string_view text) {
  try {
    f();
  } catch (const tessel::io::io_error& e) {
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.area()) == "io");
    CHECK_THAT(e.what(), Catch::Contains(std::string(text)));
    return;
  }
  FAIL("no io_error thrown; expected one containing: " << text);
}

}  // namespace io_test
