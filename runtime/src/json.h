// A small JSON reader (RFC 8259: objects, arrays, strings with escapes, numbers, true/false/null)
// and the few helpers the runner needs to write JSON. Integers are kept exactly (int64) beside
// their double value, so token ids and byte offsets never go through floating point.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mesp {

class Json {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_int() const { return type_ == Type::Number && is_int_; }  // integral, fits int64
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  bool as_bool() const { return bool_; }
  double as_double() const { return num_; }
  int64_t as_int() const { return int_; }
  const std::string& as_string() const { return str_; }
  // A number's text as written (to write it back unchanged, as Python's json would).
  const std::string& number_text() const { return str_; }
  const std::vector<Json>& items() const { return arr_; }
  // Object members in file order (duplicates: the last one wins in find()).
  const std::vector<std::pair<std::string, Json>>& members() const { return obj_; }
  const Json* find(const std::string& key) const;  // nullptr when absent or not an object

  // Parses a whole document; on error returns false and sets `why` ("line L col C: ...").
  static bool parse(const std::string& text, Json& out, std::string& why);

 private:
  friend class JsonParser;
  Type type_ = Type::Null;
  bool bool_ = false;
  bool is_int_ = false;
  double num_ = 0;
  int64_t int_ = 0;
  std::string str_;
  std::vector<Json> arr_;
  std::vector<std::pair<std::string, Json>> obj_;
};

// A JSON string literal for the UTF-8 string `s`, escaped as Python's json.dumps does by default
// (ensure_ascii: everything outside ' '..'~' as \uXXXX).
std::string json_quote(const std::string& s);
// The name of a JSON type, for messages.
const char* json_type_name(Json::Type t);

}  // namespace mesp
