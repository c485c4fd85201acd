// SVG line plots of an experiment's curves (busbw against message size, one line per algorithm or
// transport), written by the library itself so tools and examples print a plot next to their
// tables without a plotting dependency. x may be logarithmic (base 2 with byte-size ticks: 8, 1K,
// 64M, or base 10), y linear or logarithmic; several named series, axis labels, ticks, a legend.
//
//   emu::plot_options po;
//   po.title = "all_reduce, 16 cards";
//   emu::line_plot p(po);
//   p.add("ring", sizes, busbw).add("direct", sizes, busbw2);
//   p.write("busbw.svg");
//
// Points that cannot be drawn (a non-finite coordinate, or a value <= 0 on a log axis) are
// skipped, counted by skipped(), and break their line there; a plot with no drawable point at all
// is an emulator_error, as are series of unequal lengths or without points.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <tessel/emulator/errors.hpp>

namespace tessel {
inline namespace v0 {
namespace emu {

enum class axis_scale : std::uint8_t { linear, log };

struct plot_options {
  std::string title;
  std::string x_label = "size (bytes)";
  std::string y_label = "busbw (GB/s)";
  axis_scale x_scale = axis_scale::log;
  axis_scale y_scale = axis_scale::linear;
  bool x_bytes = true;  // a log x axis in powers of 2 with byte-size tick labels (1K = 1024); else powers of 10
  int width = 820, height = 500;
};

namespace detail {

// Text for XML character data and attribute values.
inline std::string xml_escape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char ch : s) {
    switch (ch) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        // control characters other than tab/newline are not allowed in XML 1.0
        if (static_cast<unsigned char>(ch) < 0x20 && ch != '\t' && ch != '\n')
          o += ' ';
        else
          o += ch;
    }
  }
  return o;
}

// 8, 512, 4K, 1.5M, 2G: powers of 1024.
inline std::string byte_label(double v) {
  static const char* units[] = {"", "K", "M", "G", "T", "P", "E"};
  int u = 0;
  while (std::fabs(v) >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f%s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.3g%s", v, units[u]);
  return buf;
}

inline std::string number_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

inline std::string coord(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// A 1-2-5 step near range/target.
inline double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

}  // namespace detail

class line_plot {
 public:
  explicit line_plot(plot_options o = {}) : o_(std::move(o)) {
    if (o_.width < 200 || o_.height < 150 || o_.width > 20000 || o_.height > 20000)
      throw emulator_error(errc::invalid_argument,
                           "plot: size " + std::to_string(o_.width) + "x" + std::to_string(o_.height) + " outside 200x150 .. 20000x20000");
  }

  // Adds a series; `dashed` draws it dashed (a model or bound beside measured lines).
  line_plot& add(std::string name, std::vector<double> x, std::vector<double> y, bool dashed = false) {
    if (x.size() != y.size())
      throw emulator_error(errc::invalid_argument,
                           "plot: series '" + name + "' has " + std::to_string(x.size()) + " x values and " + std::to_string(y.size()) + " y values");
    if (x.empty()) throw emulator_error(errc::invalid_argument, "plot: series '" + name + "' has no points");
    series_.push_back({std::move(name), std::move(x), std::move(y), dashed});
    return *this;
  }

  std::size_t series() const { return series_.size(); }
  // Points that cannot be drawn (non-finite, or <= 0 on a log axis), over all series.
  std::size_t skipped() const {
    std::size_t n = 0;
    for (const auto& s : series_)
      for (std::size_t i = 0; i < s.x.size(); ++i) n += !drawable(s.x[i], s.y[i]);
    return n;
  }

  std::string svg() const {
    // data ranges over the drawable points, in axis units (log2/log10 on log axes)
    double x0 = HUGE_VAL, x1 = -HUGE_VAL, y0 = HUGE_VAL, y1 = -HUGE_VAL;
    for (const auto& s : series_)
      for (std::size_t i = 0; i < s.x.size(); ++i)
        if (drawable(s.x[i], s.y[i])) {
          x0 = std::min(x0, ax(s.x[i])), x1 = std::max(x1, ax(s.x[i]));
          y0 = std::min(y0, ay(s.y[i])), y1 = std::max(y1, ay(s.y[i]));
        }
    if (!(x0 <= x1))
      throw emulator_error(errc::invalid_argument,
                           "plot: nothing to draw (no series has a finite point" +
                               std::string(o_.x_scale == axis_scale::log || o_.y_scale == axis_scale::log ? " above 0 on its log axes)" : ")"));
    // x: whole exponents on a log axis; y from 0 on a linear axis with values >= 0
    if (o_.x_scale == axis_scale::log) x0 = std::floor(x0), x1 = std::ceil(x1);
    if (x1 - x0 < 1e-12) x0 -= 1, x1 += 1;
    double ystep = 1;
    if (o_.y_scale == axis_scale::log) {
      y0 = std::floor(y0), y1 = std::ceil(y1);
      if (y1 - y0 < 1e-12) y0 -= 1, y1 += 1;
    } else {
      if (y0 >= 0) y0 = 0;
      if (y1 - y0 < 1e-300) y1 = y0 + (y0 == 0 ? 1 : std::fabs(y0));
      ystep = detail::nice_step(y1 - y0, 5);
      y0 = std::floor(y0 / ystep) * ystep, y1 = std::ceil(y1 / ystep) * ystep;
    }
    const double W = o_.width, H = o_.height, L = 78, R = 200, T = o_.title.empty() ? 24 : 44, B = 58;
    const double pw = W - L - R, ph = H - T - B;
    auto px = [&](double a) { return L + (a - x0) / (x1 - x0) * pw; };
    auto py = [&](double a) { return T + ph - (a - y0) / (y1 - y0) * ph; };

    std::ostringstream o;
    o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << o_.width << "\" height=\"" << o_.height << "\" viewBox=\"0 0 " << o_.width << " "
      << o_.height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    if (!o_.title.empty())
      o << "<text class=\"title\" x=\"" << detail::coord(L + pw / 2) << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
        << detail::xml_escape(o_.title) << "</text>\n";
    // grid and ticks
    o << "<g class=\"x-ticks\" stroke=\"#ddd\">\n";
    const int xn = static_cast<int>(std::lround(x1 - x0));
    // log axes: at most ~10 ticks, every 1, 2, 5, 10 or 20 exponents, on multiples of the stride
    // (8, 1K, 32K, 1M, 32M for bytes with a stride of 5)
    double xstride = detail::nice_step(x1 - x0, 8);
    if (o_.x_scale == axis_scale::log) {
      const int need = std::max(1, (xn + 9) / 10);
      xstride = need <= 1 ? 1 : need <= 2 ? 2 : need <= 5 ? 5 : need <= 10 ? 10 : 20 * std::ceil(need / 20.0);
    }
    const double xfirst = std::ceil(x0 / xstride - 1e-9) * xstride;
    // ticks by index (a step far below the values' spacing could never move t), at most 100
    const int xticks = static_cast<int>(std::min(100.0, std::floor((x1 - xfirst) / xstride + 1e-9)));
    for (int i = 0; i <= xticks; ++i) {
      const double t = xfirst + i * xstride;
      const double v = o_.x_scale == axis_scale::log ? std::pow(o_.x_bytes ? 2.0 : 10.0, t) : t;
      const std::string label = o_.x_bytes ? detail::byte_label(v) : detail::number_label(v);
      o << "<line x1=\"" << detail::coord(px(t)) << "\" y1=\"" << detail::coord(T) << "\" x2=\"" << detail::coord(px(t)) << "\" y2=\""
        << detail::coord(T + ph) << "\"/><text stroke=\"none\" fill=\"black\" x=\"" << detail::coord(px(t)) << "\" y=\"" << detail::coord(T + ph + 16)
        << "\" text-anchor=\"middle\">" << detail::xml_escape(label) << "</text>\n";
    }
    o << "</g>\n<g class=\"y-ticks\" stroke=\"#ddd\">\n";
    const double ystride = o_.y_scale == axis_scale::log ? std::max(1.0, std::ceil((y1 - y0) / 8)) : ystep;
    const int yticks = static_cast<int>(std::min(100.0, std::floor((y1 - y0) / ystride + 1e-9)));
    for (int i = 0; i <= yticks; ++i) {
      const double t = y0 + i * ystride;
      const double v = o_.y_scale == axis_scale::log ? std::pow(10.0, t) : t;
      o << "<line x1=\"" << detail::coord(L) << "\" y1=\"" << detail::coord(py(t)) << "\" x2=\"" << detail::coord(L + pw) << "\" y2=\""
        << detail::coord(py(t)) << "\"/><text stroke=\"none\" fill=\"black\" x=\"" << detail::coord(L - 6) << "\" y=\"" << detail::coord(py(t) + 4)
        << "\" text-anchor=\"end\">" << detail::xml_escape(detail::number_label(std::fabs(v) < 1e-12 * ystride ? 0 : v)) << "</text>\n";
    }
    o << "</g>\n<rect x=\"" << detail::coord(L) << "\" y=\"" << detail::coord(T) << "\" width=\"" << detail::coord(pw) << "\" height=\""
      << detail::coord(ph) << "\" fill=\"none\" stroke=\"black\"/>\n";
    o << "<text class=\"x-label\" x=\"" << detail::coord(L + pw / 2) << "\" y=\"" << detail::coord(H - 14) << "\" text-anchor=\"middle\">"
      << detail::xml_escape(o_.x_label) << "</text>\n";
    o << "<text class=\"y-label\" x=\"18\" y=\"" << detail::coord(T + ph / 2) << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 "
      << detail::coord(T + ph / 2) << ")\">" << detail::xml_escape(o_.y_label) << "</text>\n";
    // series: one <g> each, a polyline per unbroken run of drawable points, a marker per point
    static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
    for (std::size_t k = 0; k < series_.size(); ++k) {
      const auto& s = series_[k];
      const char* color = colors[k % 8];
      o << "<g class=\"series\" data-name=\"" << detail::xml_escape(s.name) << "\" stroke=\"" << color << "\" fill=\"none\""
        << (s.dashed ? " stroke-dasharray=\"6 4\"" : "") << " stroke-width=\"2\">\n";
      std::string run;
      std::size_t run_points = 0;
      auto flush = [&] {
        if (run_points > 1) o << "<polyline points=\"" << run << "\"/>\n";
        run.clear();
        run_points = 0;
      };
      std::string markers;
      for (std::size_t i = 0; i < s.x.size(); ++i) {
        if (!drawable(s.x[i], s.y[i])) {
          flush();
          continue;
        }
        const std::string cx = detail::coord(px(ax(s.x[i]))), cy = detail::coord(py(ay(s.y[i])));
        run += (run.empty() ? "" : " ") + cx + "," + cy;
        ++run_points;
        markers += "<circle cx=\"" + cx + "\" cy=\"" + cy + "\" r=\"2.5\" fill=\"" + color + "\" stroke=\"none\"/>\n";
      }
      flush();
      o << markers << "</g>\n";
    }
    // legend, right of the plot area
    o << "<g class=\"legend\">\n";
    for (std::size_t k = 0; k < series_.size(); ++k) {
      const double y = T + 10 + 20 * static_cast<double>(k), x = L + pw + 14;
      o << "<line x1=\"" << detail::coord(x) << "\" y1=\"" << detail::coord(y) << "\" x2=\"" << detail::coord(x + 26) << "\" y2=\""
        << detail::coord(y) << "\" stroke=\"" << colors[k % 8] << "\" stroke-width=\"2\"" << (series_[k].dashed ? " stroke-dasharray=\"6 4\"" : "")
        << "/><text x=\"" << detail::coord(x + 32) << "\" y=\"" << detail::coord(y + 4) << "\">" << detail::xml_escape(series_[k].name)
        << "</text>\n";
    }
    o << "</g>\n</svg>\n";
    return o.str();
  }

  void write(const std::string& path) const {
    const std::string text = svg();  // a plot that cannot be drawn leaves no file behind
    std::ofstream f(path, std::ios::binary);
    if (!f) throw emulator_error(errc::io, "plot: cannot write '" + path + "'");
    f << text;
    if (!f) throw emulator_error(errc::io, "plot: writing '" + path + "' failed");
  }

 private:
  struct series_data {
    std::string name;
    std::vector<double> x, y;
    bool dashed;
  };
  double ax(double v) const { return o_.x_scale == axis_scale::log ? (o_.x_bytes ? std::log2(v) : std::log10(v)) : v; }
  double ay(double v) const { return o_.y_scale == axis_scale::log ? std::log10(v) : v; }
  bool drawable(double x, double y) const {
    if (!std::isfinite(x) || !std::isfinite(y)) return false;
    if (o_.x_scale == axis_scale::log && !(x > 0)) return false;
    if (o_.y_scale == axis_scale::log && !(y > 0)) return false;
    return true;
  }
  plot_options o_;
  std::vector<series_data> series_;
};

}  // namespace emu
}  // namespace v0
}  // namespace tessel
