// OS-level aligned allocation shared by tile scratch arenas and devices.
// Large blocks are 2 MiB aligned and advised as transparent huge pages: on these machines a
// 4 KiB first touch costs ~17 us while a 2 MiB page faults in at ~16 GB/s (see DESIGN "Memory").
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <tessel/tile/errors.hpp>

namespace tessel::detail {

inline constexpr std::size_t huge_page_size = std::size_t{2} << 20;
// Blocks at least this large get huge-page treatment.
inline constexpr std::size_t huge_page_threshold = std::size_t{1} << 20;

// Rounds `n` up to a multiple of `a` (a power of two); throws on overflow.
inline std::size_t round_up_checked(std::size_t n, std::size_t a) {
  if (n > SIZE_MAX - (a - 1)) throw tile_error(errc::overflow, "size " + std::to_string(n) + " overflows when rounded up to " + std::to_string(a));
  return (n + a - 1) & ~(a - 1);
}

// Allocates `bytes` (> 0) aligned to at least `align` (power of two). Large requests are
// rounded to 2 MiB, aligned to 2 MiB and advised MADV_HUGEPAGE. Returns the rounded size in
// `out_size`. Throws std::bad_alloc on failure.
inline void* os_allocate(std::size_t bytes, std::size_t align, std::size_t& out_size) {
  if (align < alignof(std::max_align_t)) align = alignof(std::max_align_t);
  if ((align & (align - 1)) != 0) throw tile_error(errc::invalid_argument, "alignment " + std::to_string(align) + " is not a power of two");
  std::size_t size = 0;
  if (bytes >= huge_page_threshold) {
    if (align < huge_page_size) align = huge_page_size;
    size = round_up_checked(bytes, huge_page_size);
  } else {
    size = round_up_checked(bytes == 0 ? 1 : bytes, align);
  }
  void* p = std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (size >= huge_page_size) (void)::madvise(p, size, MADV_HUGEPAGE);  // advisory; failure is harmless
#endif
  out_size = size;
  return p;
}

inline void os_free(void* p) noexcept { std::free(p); }

}  // namespace tessel::detail
