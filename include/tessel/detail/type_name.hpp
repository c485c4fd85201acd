// Readable type names without RTTI or demangling: the compiler's own spelling of a template
// argument (from __PRETTY_FUNCTION__, GCC and Clang), and a short form for reports (the profiler's
// operator names, transport names). Internal.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::detail {

// A type's name from the compiler's signature of this function ("T = ..." in GCC and Clang).
template <class T>
constexpr std::string_view raw_type_name() {
  constexpr std::string_view f = __PRETTY_FUNCTION__;
  constexpr std::size_t b = f.find("T = ") + 4;
  std::size_t depth = 0, e = b;
  for (; e < f.size(); ++e) {
    const char c = f[e];
    if (c == '<' || c == '(' || c == '[') ++depth;
    else if ((c == '>' || c == ')') && depth > 0) --depth;
    else if (c == ']' && depth == 0) break;
    else if (c == ']') --depth;
    else if (c == ';' && depth == 0) break;
  }
  return f.substr(b, e - b);
}

// A readable name from a type name: template arguments and the library's namespaces dropped
// ("tessel::v0::detail::softmax::fwd_program<float, float>" -> "softmax::fwd_program"; a lambda
// in f() -> "f()::lambda").
inline std::string clean_type_name(std::string_view t) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (c == '<' || c == '(') ++depth;
    if (c == '>' || c == ')') --depth;
    if (depth == 0 && c == ':' && i + 1 < t.size() && t[i + 1] == ':') {
      parts.push_back(cur);
      cur.clear();
      ++i;
      continue;
    }
    cur += c;
  }
  parts.push_back(cur);
  std::string out;
  for (auto& p : parts) {
    if (p == "tessel" || p == "v0" || p == "detail" || p == "(anonymous namespace)" || p == "{anonymous}") continue;
    if (p.rfind("<lambda", 0) == 0 || p.rfind("(lambda", 0) == 0) p = "lambda";
    else if (const auto lt = p.find('<'); lt != std::string::npos && lt > 0) p.erase(lt);
    if (!out.empty()) out += "::";
    out += p;
  }
  return out.empty() ? std::string(t) : out;
}

}  // namespace tessel::detail
