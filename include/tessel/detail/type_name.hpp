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
    if (c == '<' || c == '(' || c == '[')
      ++depth;
    else if ((c == '>' || c == ')') && depth > 0)
      --depth;
    else if (c == ']' && depth == 0)
      break;
    else if (c == ']')
      --depth;
    else if (c == ';' && depth == 0)
      break;
  }
  return f.substr(b, e - b);
}

// A readable name from a type name: template arguments and the library's namespaces dropped
// ("tessel::v0::detail::softmax::fwd_program<float, float>" -> "softmax::fwd_program"; a lambda
// in f(int) -> "f::lambda" with GCC; Clang names lambdas by place: "lambda@file.hpp:12").
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
    if (p.rfind("(lambda at ", 0) == 0) {  // Clang: "(lambda at /dir/file.hpp:119:5)" -> "lambda@file.hpp:119"
      std::string where = p.substr(11, p.size() - 12);
      if (const auto slash = where.rfind('/'); slash != std::string::npos) where.erase(0, slash + 1);
      if (const auto col = where.rfind(':'); col != std::string::npos && where.find(':') != col) where.erase(col);
      p = "lambda@" + where;
    } else if (p.rfind("<lambda", 0) == 0 || p.rfind("(lambda", 0) == 0) {  // GCC: "<lambda(int)>"
      p = "lambda";
    } else if (const auto cut = p.find_first_of("<("); cut != std::string::npos && cut > 0)
      p.erase(cut);
    if (!out.empty()) out += "::";
    out += p;
  }
  return out.empty() ? std::string(t) : out;
}

// The name of the function a lambda type was written in ("gelu_forward" for a lambda in
// tessel::v0::gelu_forward<...>(...)) where the compiler says it (GCC; Clang gives the lambda's
// file and line instead), or the cleaned type name of any other type.
template <class F>
std::string enclosing_function_name() {
  std::string n = clean_type_name(raw_type_name<F>());
  constexpr std::string_view suffix = "::lambda";
  if (n.size() > suffix.size() && n.ends_with(suffix)) n.resize(n.size() - suffix.size());
  return n;
}

}  // namespace tessel::detail
