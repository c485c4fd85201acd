// Internals of the io layer: read-only file mappings, whole-file reads, atomic file writes (temp
// file + fsync + rename, so a crash never leaves a half-written checkpoint under the final name),
// checked size arithmetic that raises io_error, and the strict JSON parse both formats share.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <tessel/detail/checked.hpp>
#include <tessel/io/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace io {
namespace detail {

[[noreturn]] inline void throw_os(std::string_view file, std::string_view what, int err) {
  throw io_error(errc::io, file, std::string(what) + ": " + std::strerror(err));
}

// detail/checked.hpp reports tessel::overflow_error; here it becomes an io_error naming the file,
// tensor or field, so a caller (and the fuzzers) see the io family.
inline std::size_t mul_checked(std::size_t a, std::size_t b, std::string_view file, const std::string& ctx) {
  try {
    return tessel::detail::mul_checked(a, b, "size");
  } catch (const tessel::overflow_error& e) { throw io_error(errc::overflow, file, ctx + e.what()); }
}
inline std::size_t add_checked(std::size_t a, std::size_t b, std::string_view file, const std::string& ctx) {
  try {
    return tessel::detail::add_checked(a, b, "size");
  } catch (const tessel::overflow_error& e) { throw io_error(errc::overflow, file, ctx + e.what()); }
}

// A whole file mapped read-only. An empty file maps nothing (mmap refuses length 0).
class mapped_file {
 public:
  explicit mapped_file(const std::filesystem::path& path) {
    const std::string name = path.string();
    const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw_os(name, "cannot open", errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw_os(name, "cannot stat", err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw io_error(errc::io, name, "not a regular file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw_os(name, "cannot map " + std::to_string(size_) + " bytes", err);
      }
      data_ = static_cast<const std::byte*>(p);
    }
    ::close(fd);  // the mapping keeps the file open
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file() {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  }
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }

 private:
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// Reads a whole (small) file; `limit` guards against a config path that names a huge file.
inline std::string read_file(const std::filesystem::path& path, std::size_t limit) {
  const std::string name = path.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_os(name, "cannot open", errno);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      throw_os(name, "cannot read", err);
    }
    if (n == 0) break;
    if (out.size() + static_cast<std::size_t>(n) > limit) {
      ::close(fd);
      throw io_error(errc::format, name, "larger than the " + std::to_string(limit) + "-byte limit");
    }
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// Writes to "<path>.tmp" and renames it over `path` on commit(); an uncommitted file is removed.
class atomic_file {
 public:
  explicit atomic_file(const std::filesystem::path& path) : path_(path.string()), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw_os(tmp_, "cannot create", errno);
  }
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  void write(std::span<const std::byte> bytes) {
    const std::byte* p = bytes.data();
    std::size_t left = bytes.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_os(tmp_, "cannot write", errno);
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) throw_os(tmp_, "cannot sync", errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      throw_os(tmp_, "cannot close", err);
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      throw_os(path_, "cannot rename " + tmp_ + " to it", err);
    }
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

inline std::span<const std::byte> as_bytes(std::string_view s) noexcept { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }

// Parses JSON text, rejecting what nlohmann accepts but the formats forbid: duplicate keys in any
// object (nlohmann would keep the last one silently) and nesting deeper than `max_depth`. Invalid
// UTF-8, trailing garbage and bad numbers are nlohmann's own parse errors. All become
// io_error(errc::format).
inline nlohmann::json parse_json(std::string_view text, std::string_view file, int max_depth) {
  struct duplicate_key {
    std::string key;
  };
  struct too_deep {};
  // nlohmann ends its input at a NUL byte and would ignore what follows; no JSON text holds one.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    throw io_error(errc::format, file, "invalid JSON: NUL byte at offset " + std::to_string(nul));
  std::vector<std::set<std::string, std::less<>>> open_objects;
  const auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using ev = nlohmann::json::parse_event_t;
    if (depth > max_depth) throw too_deep{};
    if (event == ev::object_start) {
      open_objects.emplace_back();
    } else if (event == ev::object_end) {
      open_objects.pop_back();
    } else if (event == ev::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second) throw duplicate_key{key};
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), check);
  } catch (const duplicate_key& d) { throw io_error(errc::format, file, "duplicate key '" + d.key + "' in JSON"); } catch (const too_deep&) {
    throw io_error(errc::format, file, "JSON nested deeper than " + std::to_string(max_depth) + " levels");
  } catch (const nlohmann::json::exception& e) { throw io_error(errc::format, file, std::string("invalid JSON: ") + e.what()); }
}

}  // namespace detail
}  // namespace io
}  // namespace v0
}  // namespace tessel
