// Test helpers for the emulator: a small strict JSON parser (to prove the Chrome trace parses
// back) and closed-form transfer times of the modelled fabric.
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel_test {

struct json {
  enum kind_t { null_v, bool_v, num_v, str_v, arr_v, obj_v } kind = null_v;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<json> arr;
  std::map<std::string, json> obj;
  const json& operator[](const std::string& k) const {
    auto it = obj.find(k);
    if (it == obj.end()) throw std::out_of_range("json: no key " + k);
    return it->second;
  }
  bool has(const std::string& k) const { return obj.count(k) != 0; }
};

class json_parser {
 public:
  explicit json_parser(const std::string& s) : s_(s) {}
  json parse() {
    json v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& m) const { throw std::runtime_error("json: " + m + " at offset " + std::to_string(i_)); }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  json value() {
    char c = peek();
    json v;
    if (c == '{') {
      v.kind = json::obj_v;
      ++i_;
      if (peek() == '}') {
        ++i_;
        return v;
      }
      for (;;) {
        if (peek() != '"') fail("expected key");
        std::string k = string();
        expect(':');
        v.obj[k] = value();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = json::arr_v;
      ++i_;
      if (peek() == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.arr.push_back(value());
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = json::str_v;
      v.str = string();
      return v;
    }
    if (s_.compare(i_, 4, "true") == 0) {
      i_ += 4;
      v.kind = json::bool_v;
      v.b = true;
      return v;
    }
    if (s_.compare(i_, 5, "false") == 0) {
      i_ += 5;
      v.kind = json::bool_v;
      return v;
    }
    if (s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
      return v;
    }
    // number: strict JSON grammar
    std::size_t b = i_;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) fail("bad value");
    if (s_[i_] == '0')
      ++i_;
    else
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) fail("bad fraction");
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) fail("bad exponent");
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    v.kind = json::num_v;
    v.num = std::strtod(s_.substr(b, i_ - b).c_str(), nullptr);
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c == '\\') {
        if (i_ >= s_.size()) fail("bad escape");
        char e = s_[i_++];
        if (e == 'u') {
          if (i_ + 4 > s_.size()) fail("bad \\u");
          i_ += 4;
          out.push_back('?');
        } else if (std::string("\"\\/bfnrt").find(e) == std::string::npos)
          fail("bad escape");
        else
          out.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);
      } else {
        out.push_back(c);
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  const std::string& s_;
  std::size_t i_ = 0;
};

inline json parse_json(const std::string& s) { return json_parser(s).parse(); }

}  // namespace tessel_test
