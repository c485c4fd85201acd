// load(source tile, destination) against a plain loop, for every source element type (f32, bf16,
// fp16, e4m3, e5m2; random codes incl. NaN, Inf, subnormals), both stage types, every layout (row,
// col, panels, K-pair column panels, the mma layouts) and fragments; row-major, column-major and
// strided sources; tensors of 1, primes, exact tile multiples and ragged edges, every tile of each;
// scale 1 and not. Inside the tensor dst(r, c) == convert(src(r, c)) * scale (bitwise; NaN as NaN),
// everything else (edge rows/columns, layout padding) is zero.
// With a used extent, load writes that part (rounded to the layout's packing granule) and nothing else.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <tessel/tile/load.hpp>
#include <tessel/tile/mma.hpp>

// The whole file in its own namespace: its test executable is a unity build (tests/CMakeLists.txt),
// where each file's helpers must keep their own names.
namespace tessel_test_tile_load {

using namespace tessel;

namespace {
template <class S>
S random_elem(std::mt19937& g) {
  if constexpr (std::is_same_v<S, float>) {
    switch (g() % 4) {
      case 0: return std::bit_cast<float>(static_cast<std::uint32_t>(g()));           // any bits
      case 1: return std::ldexp(float(int(g() % 2001) - 1000), int(g() % 30) - 20);   // moderate
      case 2: return float(int(g() % 17) - 8);                                        // small integers
      default: return std::ldexp(float(int(g() % 255) - 127), -140 + int(g() % 20));  // subnormal-ish
    }
  } else {
    return S::from_bits(static_cast<typename S::storage_type>(g()));
  }
}

// The reference conversion: the number types' own scalar conversions, one rounding.
template <class D, class S>
D expected(S x, float scale) {
  const float f = static_cast<float>(x);
  if constexpr (std::is_same_v<D, float>)
    return scale != 1.0f ? f * scale : f;
  else
    return scale != 1.0f ? bf16(f * scale) : bf16(f);
}

template <class D>
std::uint32_t bits_of(D x) {
  if constexpr (std::is_same_v<D, float>)
    return std::bit_cast<std::uint32_t>(x);
  else
    return x.bits();
}
template <class D>
bool same_value(D a, D b) {
  const bool na = std::isnan(float(a)), nb = std::isnan(float(b));
  return na || nb ? na == nb : bits_of(a) == bits_of(b);
}

struct source_shape {
  std::size_t rows, cols;
  int kind;  // 0 row-major (padded ld), 1 column-major (padded ld), 2 strided both ways
};

// A (rows, cols) view of `store` in the given kind; fills `store` with random elements.
template <class S>
tensor<const S, 2> make_source(const source_shape& sh, std::vector<S>& store, std::mt19937& g) {
  std::size_t rs = 0, cs = 0;
  switch (sh.kind) {
    case 0:
      rs = sh.cols + 3;
      cs = 1;
      break;
    case 1:
      rs = 1;
      cs = sh.rows + 5;
      break;
    default:
      rs = 2 * sh.cols + 1;
      cs = 2;
      break;
  }
  store.resize((sh.rows - 1) * rs + (sh.cols - 1) * cs + 1);
  for (auto& x : store) x = random_elem<S>(g);
  return tensor<const S, 2>::strided(store.data(), sh.rows, sh.cols, rs, cs);
}

template <class... L>
struct layouts {};

template <class D>
D sentinel() {
  if constexpr (std::is_same_v<D, float>)
    return 12345.0f;
  else
    return bf16(12345.0f);
}

// Loads every (R, C) tile of the source (plus one at an odd element offset) into `Dst` and counts
// wrong elements; `where` describes the first.
template <class S, class D, std::size_t R, std::size_t C, class L>
std::size_t check_layout(const tensor<const S, 2>& src, float scale, std::string& where) {
  using Dst = staged<D, R, C, L>;
  std::vector<D> mem(Dst::elements);
  Dst dst(mem.data());
  // storage offsets that some (r, c) maps to; the rest is layout padding
  std::vector<char> used(Dst::elements, 0);
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < C; ++c) used[L::offset(r, c, R, C)] = 1;
  std::size_t bad = 0;
  auto check_tile = [&](const tensor_tile<const S, R, C>& t) {
    std::fill(mem.begin(), mem.end(), sentinel<D>());
    load(t, dst, scale);
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) {
        const bool inside = r < t.rows && c < t.cols;
        const D want = inside ? expected<D>(t(r, c), scale) : D(0.0f);
        if (!same_value(dst(r, c), want) && bad++ == 0) {
          std::ostringstream os;
          os << "tile at (" << t.row0 << "," << t.col0 << ") element (" << r << "," << c << "): got " << float(dst(r, c)) << " want " << float(want)
             << " (source " << float(inside ? t(r, c) : S(0.0f)) << ")";
          where = os.str();
        }
      }
    for (std::size_t i = 0; i < mem.size(); ++i)
      if (!used[i] && bits_of(mem[i]) != 0 && bad++ == 0) where = "padding element " + std::to_string(i) + " not zero";
  };
  for (std::size_t i = 0; i * R < src.rows(); ++i)
    for (std::size_t j = 0; j * C < src.cols(); ++j) check_tile(src.template tile<R, C>(i, j));
  if (src.rows() > 1 && src.cols() > 1) check_tile(src.template tile_at<R, C>(1, 1));
  return bad;
}

// Layout granules of tile_extent: (rows, cols) a used extent is rounded up to, and the padded
// (rows, cols) of the storage.
template <class L>
struct granule {
  static constexpr std::size_t rows = 1, cols = 1;
  static constexpr std::size_t padded_rows(std::size_t r) { return r; }
  static constexpr std::size_t padded_cols(std::size_t c) { return c; }
};
template <std::size_t MR, std::size_t KP>
struct granule<layout::panel<MR, KP>> : layout::panel<MR, KP> {
  static constexpr std::size_t rows = MR, cols = KP;
};
template <std::size_t NR, std::size_t KP>
struct granule<layout::col_panel<NR, KP>> : layout::col_panel<NR, KP> {
  static constexpr std::size_t rows = KP, cols = NR;
};

// load(tile, dst, tile_extent{ur, uc}): inside the used part (rounded up to the layout's granule,
// padding included) dst holds the source or zero; every other storage element keeps its sentinel.
template <class S, class D, std::size_t R, std::size_t C, class L>
std::size_t check_extent(const tensor<const S, 2>& src, std::size_t ur, std::size_t uc, std::string& where) {
  using Dst = staged<D, R, C, L>;
  using G = granule<L>;
  constexpr std::size_t PR = G::padded_rows(R), PC = G::padded_cols(C);
  const std::size_t wr = std::min(PR, (ur + G::rows - 1) / G::rows * G::rows), wc = std::min(PC, (uc + G::cols - 1) / G::cols * G::cols);
  std::vector<D> mem(Dst::elements);
  Dst dst(mem.data());
  std::size_t bad = 0;
  auto check_tile = [&](const tensor_tile<const S, R, C>& t) {
    std::fill(mem.begin(), mem.end(), sentinel<D>());
    load(t, dst, tile_extent{ur, uc});
    for (std::size_t r = 0; r < PR; ++r)
      for (std::size_t c = 0; c < PC; ++c) {
        const D got = mem[L::offset(r, c, R, C)];
        const bool written = r < wr && c < wc, inside = r < t.rows && c < t.cols && r < R && c < C;
        const D want = !written ? sentinel<D>() : (inside ? expected<D>(t(r, c), 1.0f) : D(0.0f));
        if (!same_value(got, want) && bad++ == 0) {
          std::ostringstream os;
          os << "tile at (" << t.row0 << "," << t.col0 << ") extent (" << ur << "," << uc << ") element (" << r << "," << c << "): got " << float(got)
             << " want " << float(want);
          where = os.str();
        }
      }
  };
  for (std::size_t i = 0; i * R < src.rows(); ++i)
    for (std::size_t j = 0; j * C < src.cols(); ++j) check_tile(src.template tile<R, C>(i, j));
  return bad;
}

template <class S, class D, std::size_t R, std::size_t C, class... L>
void check_all_extents(layouts<L...>, std::mt19937& g) {
  const std::size_t extents[][2] = {{0, 0}, {1, 1}, {R / 2 + 1, C / 2 + 1}, {R - 1, C}, {R, 1}, {1, C - 1}, {R, C}, {R + 7, C + 9}};
  for (std::size_t m : {std::size_t{1}, R / 2 + 1, R, 2 * R + 3})
    for (std::size_t n : {std::size_t{1}, C - 1, C + 1})
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<S> store;
        const auto src = make_source<S>({m, n, kind}, store, g);
        for (const auto& e : extents) {
          std::string where;
          const std::size_t bad = (check_extent<S, D, R, C, L>(src, e[0], e[1], where) + ...);
          INFO("tensor (" << m << "," << n << ") kind " << kind << ": " << where);
          REQUIRE(bad == 0);
        }
      }
}

template <class S, class D, std::size_t R, std::size_t C>
std::size_t check_fragment(const tensor<const S, 2>& src, float scale, std::string& where) {
  fragment<D, R, C> f;
  std::size_t bad = 0;
  for (std::size_t i = 0; i * R < src.rows(); ++i)
    for (std::size_t j = 0; j * C < src.cols(); ++j) {
      const auto t = src.template tile<R, C>(i, j);
      f.fill(sentinel<D>());
      load(t, f, scale);
      for (std::size_t r = 0; r < R; ++r)
        for (std::size_t c = 0; c < C; ++c) {
          const D want = r < t.rows && c < t.cols ? expected<D>(t(r, c), scale) : D(0.0f);
          if (!same_value(f(r, c), want) && bad++ == 0) where = "fragment tile " + std::to_string(i) + "," + std::to_string(j);
        }
    }
  return bad;
}

using mma_f32 = mma_traits<float>;
using mma_bf16 = mma_traits<bf16>;

// Every layout for one (R, C) and one source/destination type pair.
template <class S, class D, std::size_t R, std::size_t C, class... L>
void check_all_layouts(layouts<L...>, std::mt19937& g) {
  const std::size_t sizes[] = {1, 2, R, R + 1, 2 * R + 3};
  const std::size_t csizes[] = {1, C - 1, C, C + 1, 2 * C + 5};
  for (std::size_t m : sizes)
    for (std::size_t n : csizes)
      for (int kind = 0; kind < 3; ++kind) {
        if (n == 0) continue;
        std::vector<S> store;
        const auto src = make_source<S>({m, n, kind}, store, g);
        for (float scale : {1.0f, 0.5f, 3.0f}) {
          std::string where;
          std::size_t bad = (check_layout<S, D, R, C, L>(src, scale, where) + ...);
          bad += check_fragment<S, D, R, C>(src, scale, where);
          INFO("tensor (" << m << "," << n << ") kind " << kind << " scale " << scale << ": " << where);
          REQUIRE(bad == 0);
        }
      }
}

using all_layouts = layouts<layout::row, layout::col, layout::panel<4, 1>, layout::panel<4, 2>, layout::col_panel<16, 1>, layout::vnni2<16>,
                            mma_f32::a_layout, mma_f32::b_layout, mma_bf16::a_layout, mma_bf16::b_layout>;
}  // namespace

TEMPLATE_TEST_CASE("load equals convert-and-scale inside the tensor and zero elsewhere, every layout", "[tile][load]", float, bf16, fp16, e4m3,
                   e5m2) {
  std::mt19937 g(31);
  SECTION("to f32, 16x32 tiles (full panels: the fast paths)") { check_all_layouts<TestType, float, 16, 32>(all_layouts{}, g); }
  SECTION("to bf16, 16x32 tiles") { check_all_layouts<TestType, bf16, 16, 32>(all_layouts{}, g); }
  SECTION("to f32, 7x13 tiles (every panel ragged)") { check_all_layouts<TestType, float, 7, 13>(all_layouts{}, g); }
  SECTION("to bf16, 7x13 tiles") { check_all_layouts<TestType, bf16, 7, 13>(all_layouts{}, g); }
}

TEMPLATE_TEST_CASE("load with a used extent writes that part (rounded to the layout's granule) and nothing else", "[tile][load]", float, bf16, fp16,
                   e4m3) {
  std::mt19937 g(37);
  SECTION("to f32, 16x32 tiles") { check_all_extents<TestType, float, 16, 32>(all_layouts{}, g); }
  SECTION("to bf16, 16x32 tiles") { check_all_extents<TestType, bf16, 16, 32>(all_layouts{}, g); }
  SECTION("to f32, 7x13 tiles") { check_all_extents<TestType, float, 7, 13>(all_layouts{}, g); }
  SECTION("to bf16, 7x13 tiles") { check_all_extents<TestType, bf16, 7, 13>(all_layouts{}, g); }
}

TEST_CASE("prefetch of any tile is harmless (edge tiles, both orders)", "[tile][load]") {
  std::vector<float> v(37 * 41, 1.0f);
  const tensor<const float, 2> t(v.data(), 37, 41);
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j) {
      prefetch(t.tile<16, 16>(i, j));
      prefetch(t.transposed().tile<16, 16>(j, i));
    }
  SUCCEED();
}

TEST_CASE("loadable and stage element concepts", "[tile][load]") {
  STATIC_REQUIRE(loadable_element<float>);
  STATIC_REQUIRE(loadable_element<const bf16>);
  STATIC_REQUIRE(loadable_element<e5m2>);
  STATIC_REQUIRE_FALSE(loadable_element<double>);
  STATIC_REQUIRE_FALSE(loadable_element<int>);
  STATIC_REQUIRE(stage_element<float>);
  STATIC_REQUIRE(stage_element<bf16>);
  STATIC_REQUIRE_FALSE(stage_element<fp16>);
  STATIC_REQUIRE_FALSE(stage_element<e4m3>);
}

}  // namespace tessel_test_tile_load
