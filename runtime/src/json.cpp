#include "json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace mesp {

const Json* Json::find(const std::string& key) const {
  if (type_ != Type::Object) return nullptr;
  for (auto it = obj_.rbegin(); it != obj_.rend(); ++it)
    if (it->first == key) return &it->second;
  return nullptr;
}

const char* json_type_name(Json::Type t) {
  switch (t) {
    case Json::Type::Null: return "null";
    case Json::Type::Bool: return "a boolean";
    case Json::Type::Number: return "a number";
    case Json::Type::String: return "a string";
    case Json::Type::Array: return "an array";
    case Json::Type::Object: return "an object";
  }
  return "?";
}

// Recursive descent over the text; depth is bounded so hostile nesting cannot blow the stack.
class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}

  bool document(Json& out, std::string& why) {
    bool ok = ws() && value(out, 0) && ws();
    if (ok && i_ != s_.size()) ok = fail("trailing characters after the value");
    if (!ok) why = where() + err_;
    return ok;
  }

 private:
  static constexpr int kMaxDepth = 256;
  const std::string& s_;
  size_t i_ = 0;
  std::string err_;

  std::string where() const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < i_ && k < s_.size(); ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    if (s_.find('\n') == std::string::npos) return "column " + std::to_string(col) + ": ";
    return "line " + std::to_string(line) + " column " + std::to_string(col) + ": ";
  }
  bool fail(const std::string& msg) {
    if (err_.empty()) err_ = msg;
    return false;
  }
  bool ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
    return true;
  }
  bool literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(i_, n, word) != 0) return fail("invalid literal");
    i_ += n;
    return true;
  }

  bool value(Json& out, int depth) {
    if (depth > kMaxDepth) return fail("nesting too deep");
    if (i_ >= s_.size()) return fail("unexpected end of input");
    char c = s_[i_];
    switch (c) {
      case '{': return object(out, depth);
      case '[': return array(out, depth);
      case '"': out.type_ = Json::Type::String; return string(out.str_);
      case 't':
        out.type_ = Json::Type::Bool;
        out.bool_ = true;
        return literal("true");
      case 'f':
        out.type_ = Json::Type::Bool;
        out.bool_ = false;
        return literal("false");
      case 'n': out.type_ = Json::Type::Null; return literal("null");
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number(out);
        return fail(std::string("unexpected character '") + c + "'");
    }
  }

  bool object(Json& out, int depth) {
    out.type_ = Json::Type::Object;
    ++i_;  // '{'
    ws();
    if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
    while (true) {
      ws();
      if (i_ >= s_.size() || s_[i_] != '"') return fail("expected a string key");
      std::string key;
      if (!string(key)) return false;
      ws();
      if (i_ >= s_.size() || s_[i_] != ':') return fail("expected ':'");
      ++i_;
      ws();
      out.obj_.emplace_back(std::move(key), Json());
      if (!value(out.obj_.back().second, depth + 1)) return false;
      ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
      return fail("expected ',' or '}'");
    }
  }

  bool array(Json& out, int depth) {
    out.type_ = Json::Type::Array;
    ++i_;  // '['
    ws();
    if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
    while (true) {
      ws();
      out.arr_.emplace_back();
      if (!value(out.arr_.back(), depth + 1)) return false;
      ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
      return fail("expected ',' or ']'");
    }
  }

  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  bool hex4(uint32_t& v) {
    if (i_ + 4 > s_.size()) return fail("truncated \\u escape");
    v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= h - '0';
      else if (h >= 'a' && h <= 'f')
        v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        v |= h - 'A' + 10;
      else
        return fail("bad \\u escape");
    }
    return true;
  }

  bool string(std::string& out) {
    ++i_;  // '"'
    while (i_ < s_.size()) {
      unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return true;
      if (c < 0x20) return fail("control character in a string");
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (i_ >= s_.size()) break;
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp;
          if (!hex4(cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            uint32_t lo;
            if (s_.compare(i_, 2, "\\u") != 0) return fail("unpaired surrogate");
            i_ += 2;
            if (!hex4(lo)) return false;
            if (lo < 0xDC00 || lo > 0xDFFF) return fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return fail("unpaired surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default: return fail("bad escape in a string");
      }
    }
    return fail("unterminated string");
  }

  bool number(Json& out) {
    size_t start = i_;
    bool integral = true;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size() || !(s_[i_] >= '0' && s_[i_] <= '9')) return fail("bad number");
    if (s_[i_] == '0') {
      ++i_;
    } else {
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      integral = false;
      ++i_;
      if (i_ >= s_.size() || !(s_[i_] >= '0' && s_[i_] <= '9')) return fail("bad number");
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      integral = false;
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (i_ >= s_.size() || !(s_[i_] >= '0' && s_[i_] <= '9')) return fail("bad number");
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    std::string text = s_.substr(start, i_ - start);
    out.type_ = Json::Type::Number;
    out.str_ = text;
    out.num_ = std::strtod(text.c_str(), nullptr);  // inf on overflow; callers range-check
    if (integral) {
      errno = 0;
      long long v = std::strtoll(text.c_str(), nullptr, 10);
      out.is_int_ = errno != ERANGE;  // an integer past int64 stays a (rounded) double
      out.int_ = out.is_int_ ? static_cast<int64_t>(v) : 0;
    }
    return true;
  }
};

bool Json::parse(const std::string& text, Json& out, std::string& why) {
  out = Json();
  JsonParser p(text);
  return p.document(out, why);
}

}  // namespace mesp
