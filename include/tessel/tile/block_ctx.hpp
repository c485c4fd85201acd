// What a running tile program sees: its block index in the launch grid, the worker running it,
// and that worker's scratch arena (kept alive across launches). Devices construct block_ctx;
// tile/ never includes device/, so any device (host pool, emulated card) can run the same program.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <tessel/tile/errors.hpp>
#include <tessel/tile/detail/os_memory.hpp>

namespace tessel {
inline namespace v0 {

// Launch grid of up to three dimensions. Block (i0, i1, i2) has linear id i0 + x*(i1 + y*i2):
// the first index varies fastest, so neighbouring blocks along the first axis (e.g. row blocks of
// C sharing one column panel of B) run close together in time.
struct grid {
  [[noreturn, gnu::cold, gnu::noinline]] static void throw_too_many(std::size_t x, std::size_t y, std::size_t z) {
    throw tile_error(errc::overflow, "grid " + std::to_string(x) + "x" + std::to_string(y) + "x" + std::to_string(z) + " has too many blocks");
  }
  std::size_t x = 1, y = 1, z = 1;
  constexpr grid() = default;
  constexpr explicit grid(std::size_t x_) : x(x_) {}
  constexpr grid(std::size_t x_, std::size_t y_) : x(x_), y(y_) {}
  constexpr grid(std::size_t x_, std::size_t y_, std::size_t z_) : x(x_), y(y_), z(z_) {}

  // Total block count; throws tile_error(errc::overflow) if it does not fit in size_t (out of
  // line, so the check inlines into a launch).
  constexpr std::size_t size() const {
    std::size_t xy = 0, xyz = 0;
    if (__builtin_mul_overflow(x, y, &xy) || __builtin_mul_overflow(xy, z, &xyz)) [[unlikely]]
      throw_too_many(x, y, z);
    return xyz;
  }
  constexpr bool empty() const { return x == 0 || y == 0 || z == 0; }
  constexpr std::array<std::size_t, 3> index_of(std::size_t linear) const { return {linear % x, (linear / x) % y, linear / (x * y)}; }
  friend constexpr bool operator==(const grid&, const grid&) = default;
};

constexpr std::size_t ceil_div(std::size_t a, std::size_t b) { return b == 0 ? 0 : a / b + (a % b != 0); }

// Per-worker bump allocator. Memory is never moved while a block runs (chunks are chained), and
// reset() rewinds it; if a block needed several chunks they are merged into one bigger chunk so
// later launches allocate from one contiguous, already-faulted region.
class scratch_arena {
 public:
  explicit scratch_arena(std::size_t initial_bytes = std::size_t{4} << 20) : initial_(initial_bytes) {}
  scratch_arena(const scratch_arena&) = delete;
  scratch_arena& operator=(const scratch_arena&) = delete;
  scratch_arena(scratch_arena&&) noexcept = default;
  scratch_arena& operator=(scratch_arena&&) noexcept = default;

  // Returns `bytes` of uninitialized memory aligned to `align` (power of two, <= 4096).
  void* allocate(std::size_t bytes, std::size_t align = 64) {
    if (align == 0 || (align & (align - 1)) != 0 || align > 4096)
      throw tile_error(errc::invalid_argument, "scratch alignment " + std::to_string(align) + " must be a power of two <= 4096");
    if (!chunks_.empty()) {
      chunk& c = chunks_[current_];
      std::size_t off = detail::round_up_checked(c.used, align);
      if (off <= c.size && bytes <= c.size - off) {
        c.used = off + bytes;
        note_use();
        return c.data.get() + off;
      }
      // try following (already allocated) chunks
      for (std::size_t i = current_ + 1; i < chunks_.size(); ++i) {
        if (bytes <= chunks_[i].size) {
          current_ = i;
          chunks_[i].used = bytes;
          note_use();
          return chunks_[i].data.get();
        }
      }
    }
    std::size_t want = initial_;
    if (!chunks_.empty()) want = chunks_.back().size * 2;
    if (want < bytes) want = bytes;
    std::size_t got = 0;
    void* p = detail::os_allocate(want, 4096, got);
    chunks_.push_back(chunk{std::unique_ptr<std::byte[], freer>(static_cast<std::byte*>(p)), got, bytes});
    current_ = chunks_.size() - 1;
    note_use();
    return p;
  }

  template <class T>
  T* allocate_array(std::size_t n, std::size_t align = 64) {
    if (n > SIZE_MAX / sizeof(T)) throw tile_error(errc::overflow, "scratch array of " + std::to_string(n) + " elements overflows");
    return static_cast<T*>(allocate(n * sizeof(T), align < alignof(T) ? alignof(T) : align));
  }

  // Rewinds the arena (all pointers it handed out become invalid).
  void reset() {
    if (chunks_.size() > 1) {
      std::size_t total = 0;
      for (auto& c : chunks_) total += c.size;
      chunks_.clear();
      std::size_t got = 0;
      void* p = detail::os_allocate(total, 4096, got);
      chunks_.push_back(chunk{std::unique_ptr<std::byte[], freer>(static_cast<std::byte*>(p)), got, 0});
    }
    for (auto& c : chunks_) c.used = 0;
    current_ = 0;
  }
  // Marks/rewinds for nested scopes inside a block.
  struct mark_t {
    std::size_t chunk, used;
  };
  mark_t mark() const { return chunks_.empty() ? mark_t{0, 0} : mark_t{current_, chunks_[current_].used}; }
  void rewind(mark_t m) {
    if (chunks_.empty()) return;
    current_ = m.chunk;
    chunks_[current_].used = m.used;
  }

  std::size_t capacity() const {
    std::size_t t = 0;
    for (auto& c : chunks_) t += c.size;
    return t;
  }
  std::size_t high_water() const { return high_water_; }

 private:
  struct freer {
    void operator()(std::byte* p) const noexcept { detail::os_free(p); }
  };
  struct chunk {
    std::unique_ptr<std::byte[], freer> data;
    std::size_t size;
    std::size_t used;
  };
  void note_use() {
    std::size_t t = 0;
    for (std::size_t i = 0; i < current_; ++i) t += chunks_[i].size;
    t += chunks_[current_].used;
    if (t > high_water_) high_water_ = t;
  }
  std::vector<chunk> chunks_;
  std::size_t current_ = 0;
  std::size_t initial_;
  std::size_t high_water_ = 0;
};

// The context handed to `program(block_ctx&)`. Cheap to construct; devices make one per block.
class block_ctx {
 public:
  block_ctx(const grid& dims, std::size_t linear, unsigned worker, unsigned workers, scratch_arena& scratch)
      : dims_(dims), linear_(linear), idx_(dims.index_of(linear)), worker_(worker), workers_(workers), scratch_(&scratch) {}

  // (i0, i1) — for 2-D grids; `auto [bm, bn] = ctx.block_index();`
  std::array<std::size_t, 2> block_index() const { return {idx_[0], idx_[1]}; }
  std::array<std::size_t, 3> block_index3() const { return idx_; }
  std::size_t block_linear() const { return linear_; }
  const grid& dims() const { return dims_; }
  unsigned worker_id() const { return worker_; }
  unsigned num_workers() const { return workers_; }
  scratch_arena& scratch() const { return *scratch_; }

 private:
  grid dims_;
  std::size_t linear_;
  std::array<std::size_t, 3> idx_;
  unsigned worker_, workers_;
  scratch_arena* scratch_;
};

// A tile program: a copyable callable run once per block of the grid.
template <class P>
concept tile_program = std::is_copy_constructible_v<P> && requires(const P& p, block_ctx& ctx) {
  p(ctx);
};

}  // namespace v0
}  // namespace tessel
