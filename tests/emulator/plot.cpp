// emu::line_plot: the SVG is well-formed XML (every tag closed, in order), has one group per
// series, maps larger x to the right and larger y upward on every axis kind, escapes text, and
// skips undrawable points explicitly (counted, the line broken there) or refuses a plot with none.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <tessel/emulator/plot.hpp>

#include "error_match.hpp"

namespace tessel_test_emulator_plot {

using namespace tessel;
using namespace tessel::emu;
using tessel_test::is_error;

namespace {

// A small XML checker: tags balance and nest, attributes are quoted, no raw '<' or '&' in text.
// Returns the element names in document order.
std::vector<std::string> check_xml(const std::string& s) {
  std::vector<std::string> stack, names;
  std::size_t i = 0;
  if (s.rfind("<?xml", 0) == 0) i = s.find("?>") + 2;
  while (i < s.size()) {
    if (s[i] == '&') {
      const auto semi = s.find(';', i);
      REQUIRE(semi != std::string::npos);
      const std::string ent = s.substr(i, semi - i + 1);
      CHECK((ent == "&amp;" || ent == "&lt;" || ent == "&gt;" || ent == "&quot;" || ent == "&apos;"));
      i = semi + 1;
      continue;
    }
    if (s[i] != '<') {
      ++i;
      continue;
    }
    const auto end = s.find('>', i);
    REQUIRE(end != std::string::npos);
    std::string tag = s.substr(i + 1, end - i - 1);
    REQUIRE(tag.find('<') == std::string::npos);
    if (tag[0] == '/') {
      REQUIRE_FALSE(stack.empty());
      CHECK(stack.back() == tag.substr(1));
      stack.pop_back();
    } else {
      const bool self = tag.back() == '/';
      if (self) tag.pop_back();
      const std::string name = tag.substr(0, tag.find(' '));
      names.push_back(name);
      // attributes: name="value" pairs, values without raw '<', '"' or unescaped '&'
      static const std::regex attr(R"re(\s+[A-Za-z][A-Za-z0-9:-]*="[^"<]*")re");
      const std::string rest = tag.substr(name.size());
      CHECK(std::regex_replace(rest, attr, "").find_first_not_of(" \n") == std::string::npos);
      if (!self) stack.push_back(name);
    }
    i = end + 1;
  }
  CHECK(stack.empty());
  return names;
}

// The points of every polyline of the series group named `name`, in order.
std::vector<std::vector<std::pair<double, double>>> polylines_of(const std::string& svg, const std::string& name) {
  std::vector<std::vector<std::pair<double, double>>> out;
  const auto g = svg.find("<g class=\"series\" data-name=\"" + name + "\"");
  REQUIRE(g != std::string::npos);
  const auto gend = svg.find("</g>", g);
  for (auto at = svg.find("<polyline points=\"", g); at != std::string::npos && at < gend; at = svg.find("<polyline points=\"", at + 1)) {
    const auto b = at + 18, e = svg.find('"', b);
    std::istringstream in(svg.substr(b, e - b));
    std::vector<std::pair<double, double>> pts;
    double x, y;
    char comma;
    while (in >> x >> comma >> y) pts.emplace_back(x, y);
    out.push_back(pts);
  }
  return out;
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("plot: well-formed SVG, one group and one legend entry per series", "[emulator][plot]") {
  std::vector<double> x, a, b;
  for (double s = 8; s <= double(1 << 28); s *= 4) {
    x.push_back(s);
    a.push_back(300 * s / (s + 1e6));
    b.push_back(380 * s / (s + 5e5));
  }
  plot_options po;
  po.title = "all_reduce <16 cards> & \"friends\"";
  line_plot p(po);
  p.add("ring", x, a).add("direct", x, b).add("closed form", x, b, true);
  CHECK(p.series() == 3);
  CHECK(p.skipped() == 0);
  const std::string svg = p.svg();
  const auto names = check_xml(svg);
  CHECK(names.front() == "svg");
  CHECK(count(svg, "<g class=\"series\"") == 3);
  CHECK(count(svg, "<polyline") == 3);
  CHECK(count(svg, "<circle") == 3 * x.size());
  CHECK(count(svg, "stroke-dasharray") == 2);  // the dashed series and its legend line
  CHECK_THAT(svg, Catch::Contains("all_reduce &lt;16 cards&gt; &amp; &quot;friends&quot;"));
  CHECK_THAT(svg, Catch::Contains(">closed form</text>"));
  // byte ticks on the log-2 axis (8 B .. 256 MiB: 25 exponents), every 5th power of two
  CHECK_THAT(svg, Catch::Contains(">32</text>") && Catch::Contains(">1K</text>") && Catch::Contains(">32K</text>") && Catch::Contains(">1M</text>") &&
                      Catch::Contains(">32M</text>"));
  CHECK(count(svg, "<g class=\"x-ticks\"") == 1);
  CHECK(count(svg.substr(svg.find("<g class=\"x-ticks\""), svg.find("</g>", svg.find("<g class=\"x-ticks\"")) - svg.find("<g class=\"x-ticks\"")),
              "<line") == 5);
  CHECK_THAT(svg, Catch::Contains(">size (bytes)</text>") && Catch::Contains(">busbw (GB/s)</text>"));
}

TEST_CASE("plot: points map monotonically on every axis kind", "[emulator][plot]") {
  for (auto ys : {axis_scale::linear, axis_scale::log})
    for (bool bytes : {true, false})
      for (auto xs : {axis_scale::log, axis_scale::linear}) {
        CAPTURE(int(ys), bytes, int(xs));
        plot_options po;
        po.y_scale = ys;
        po.x_scale = xs;
        po.x_bytes = bytes;
        std::vector<double> x, y;
        for (int i = 0; i < 12; ++i) {
          x.push_back(std::pow(3.0, i) + 1);
          y.push_back(0.5 + i * i);  // increasing
        }
        line_plot p(po);
        p.add("s", x, y);
        const std::string svg = p.svg();
        check_xml(svg);
        const auto lines = polylines_of(svg, "s");
        REQUIRE(lines.size() == 1);
        REQUIRE(lines[0].size() == x.size());
        for (std::size_t i = 1; i < x.size(); ++i) {
          CHECK(lines[0][i].first > lines[0][i - 1].first);    // right
          CHECK(lines[0][i].second < lines[0][i - 1].second);  // up (SVG y grows downward)
        }
        // inside the canvas
        for (const auto& [px, py] : lines[0]) {
          CHECK(px >= 0);
          CHECK(px <= po.width);
          CHECK(py >= 0);
          CHECK(py <= po.height);
        }
      }
}

TEST_CASE("plot: undrawable points are skipped and break the line, nothing drawable is an error", "[emulator][plot]") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  line_plot p;  // log x
  p.add("gappy", {8, 16, 32, 64, 128, 256}, {1, 2, nan, 4, 5, 6}).add("zero x", {0, 16, 32}, {1, 2, 3});
  CHECK(p.skipped() == 2);
  const std::string svg = p.svg();
  check_xml(svg);
  const auto gappy = polylines_of(svg, "gappy");
  REQUIRE(gappy.size() == 2);  // broken at the NaN
  CHECK(gappy[0].size() == 2);
  CHECK(gappy[1].size() == 3);
  CHECK(polylines_of(svg, "zero x").at(0).size() == 2);
  CHECK(svg.find("nan") == std::string::npos);
  CHECK(svg.find("inf") == std::string::npos);

  line_plot none;
  none.add("all bad", {8, 16}, {nan, inf});
  CHECK_THROWS_MATCHES(none.svg(), emulator_error, is_error(errc::invalid_argument, "emulator", "nothing to draw"));
  plot_options logy;
  logy.y_scale = axis_scale::log;
  line_plot zeros(logy);
  zeros.add("zeros", {8, 16}, {0, 0});
  CHECK_THROWS_AS(zeros.svg(), emulator_error);
  CHECK_THROWS_AS(line_plot().svg(), emulator_error);  // no series at all
  CHECK_THROWS_MATCHES(line_plot().add("short", {1, 2}, {1}), emulator_error,
                       is_error(errc::invalid_argument, "emulator", "2 x values and 1 y values"));
  CHECK_THROWS_MATCHES(line_plot().add("empty", {}, {}), emulator_error, is_error(errc::invalid_argument, "emulator", "no points"));
  plot_options tiny;
  tiny.width = 10;
  CHECK_THROWS_AS(line_plot(tiny), emulator_error);
  // one point, or all points equal, still draws (the axis range is widened)
  line_plot one;
  one.add("one", {1024}, {7});
  check_xml(one.svg());
  CHECK(count(one.svg(), "<circle") == 1);
}

TEST_CASE("plot: write() creates the file, refuses an unwritable path", "[emulator][plot]") {
  line_plot p;
  p.add("a", {8, 64}, {1, 2});
  const char* path = "tessel_plot_test.svg";
  p.write(path);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  CHECK(ss.str() == p.svg());
  std::remove(path);
  CHECK_THROWS_MATCHES(p.write("/nonexistent/dir/plot.svg"), emulator_error, is_error(errc::io, "emulator", "cannot write"));
}
}  // namespace tessel_test_emulator_plot
