// Writing JSON: string literals escaped exactly as Python's json.dumps (ensure_ascii) does, so
// adapter_config.json matches the Python runner's byte for byte.
#include <cstdio>

#include "json.h"

namespace mesp {

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  auto u = [&out](uint32_t v) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(v));
    out += buf;
  };
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"') {
      out += "\\\"";
      ++i;
      continue;
    }
    if (c == '\\') {
      out += "\\\\";
      ++i;
      continue;
    }
    if (c == '\n') {
      out += "\\n";
      ++i;
      continue;
    }
    if (c == '\r') {
      out += "\\r";
      ++i;
      continue;
    }
    if (c == '\t') {
      out += "\\t";
      ++i;
      continue;
    }
    if (c == '\b') {
      out += "\\b";
      ++i;
      continue;
    }
    if (c == '\f') {
      out += "\\f";
      ++i;
      continue;
    }
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Decode one UTF-8 sequence (a stray byte stands for itself).
    uint32_t cp = c;
    size_t len = 1;
    if (c >= 0xF0 && i + 3 < s.size()) {
      cp = ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) |
           (s[i + 3] & 0x3Fu);
      len = 4;
    } else if (c >= 0xE0 && i + 2 < s.size()) {
      cp = ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
      len = 3;
    } else if (c >= 0xC0 && i + 1 < s.size()) {
      cp = ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
      len = 2;
    }
    i += len;
    if (cp >= 0x10000) {  // a surrogate pair, as json.dumps writes it
      cp -= 0x10000;
      u(0xD800 + (cp >> 10));
      u(0xDC00 + (cp & 0x3FF));
    } else {
      u(cp);
    }
  }
  return out + "\"";
}

}  // namespace mesp
