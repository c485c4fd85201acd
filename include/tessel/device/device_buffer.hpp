// device_buffer<T, Dev>: an owning, typed, move-only array in a device's memory (host_device, an
// emulated card, any `device`), freed by its destructor, so examples and the model layer stop
// writing their own. Device memory on every tessel device is host-addressable (the emulator's
// cards keep their arenas in host memory), so the buffer also offers data()/span() for host code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <tessel/detail/checked.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/errors.hpp>

namespace tessel {
inline namespace v0 {

template <class T, device Dev>
requires std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>
class device_buffer {
 public:
  using value_type = T;
  using device_type = Dev;

  device_buffer() = default;
  // n elements, contents unspecified (as cudaMalloc): use zeros() or fill() when they matter.
  device_buffer(Dev& dev, std::size_t n) : dev_(&dev), n_(n) {
    if (n) data_ = static_cast<T*>(dev.allocate(detail::mul_checked(n, sizeof(T), "device_buffer bytes")));
  }
  // n copies of `value` (as std::vector(n, value)).
  device_buffer(Dev& dev, std::size_t n, const T& value) : device_buffer(dev, n) { fill(value); }
  // A copy of `src` in `dev`'s memory.
  device_buffer(Dev& dev, std::span<const T> src) : device_buffer(dev, src.size()) { copy_from(src); }
  static device_buffer zeros(Dev& dev, std::size_t n) { return device_buffer(dev, n, T{}); }

  device_buffer(device_buffer&& o) noexcept
      : dev_(std::exchange(o.dev_, nullptr)), data_(std::exchange(o.data_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      dev_ = std::exchange(o.dev_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  // Frees the memory now; the buffer becomes empty (still bound to its device).
  void reset() noexcept {
    if (data_) dev_->deallocate(data_);
    data_ = nullptr;
    n_ = 0;
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }
  std::size_t size_bytes() const noexcept { return n_ * sizeof(T); }
  bool empty() const noexcept { return n_ == 0; }
  Dev* device_ptr() const noexcept { return dev_; }
  std::span<T> span() noexcept { return {data_, n_}; }
  std::span<const T> span() const noexcept { return {data_, n_}; }
  std::span<const T> cspan() const noexcept { return {data_, n_}; }
  operator std::span<T>() noexcept { return span(); }
  operator std::span<const T>() const noexcept { return span(); }

  void fill(const T& v) { std::fill_n(data_, n_, v); }
  // Copies through the device (source first, destination second, as every copy in tessel).
  void copy_from(std::span<const T> src) {
    check_size(src.size(), "copy_from");
    if (n_) dev_->copy(src.data(), data_, size_bytes());
  }
  void copy_to(std::span<T> dst) const {
    check_size(dst.size(), "copy_to");
    if (n_) dev_->copy(data_, dst.data(), size_bytes());
  }

 private:
  void check_size(std::size_t other, const char* what) const {
    if (other != n_)
      throw device_error(errc::invalid_argument,
                         std::string("device_buffer::") + what + ": " + std::to_string(other) + " elements for a buffer of " + std::to_string(n_));
  }

  Dev* dev_ = nullptr;
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace v0
}  // namespace tessel
