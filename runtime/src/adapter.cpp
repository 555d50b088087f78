// Trainer::save: the adapter in PEFT's format, as save_adapter() in mesp/ondevice/runner.py
// writes it: adapter_model.safetensors first, adapter_config.json last, each atomically.
#include <cstring>

#include "error.h"
#include "json.h"
#include "platform.h"
#include "train.h"

namespace mesp {

namespace {
// A value copied from run_config.json as Python's json.dumps(indent=2) writes it; numbers keep
// their text (so 16.0 stays 16.0).
std::string dump(const Json& v, int level) {
  const std::string pad(static_cast<size_t>(2 * (level + 1)), ' ');
  const std::string end(static_cast<size_t>(2 * level), ' ');
  switch (v.type()) {
    case Json::Type::Null: return "null";
    case Json::Type::Bool: return v.as_bool() ? "true" : "false";
    case Json::Type::Number: return v.number_text();
    case Json::Type::String: return json_quote(v.as_string());
    case Json::Type::Array: {
      if (v.items().empty()) return "[]";
      std::string s = "[\n";
      for (size_t i = 0; i < v.items().size(); ++i)
        s += pad + dump(v.items()[i], level + 1) + (i + 1 < v.items().size() ? ",\n" : "\n");
      return s + end + "]";
    }
    case Json::Type::Object: {
      if (v.members().empty()) return "{}";
      std::string s = "{\n";
      for (size_t i = 0; i < v.members().size(); ++i)
        s += pad + json_quote(v.members()[i].first) + ": " +
             dump(v.members()[i].second, level + 1) + (i + 1 < v.members().size() ? ",\n" : "\n");
      return s + end + "}";
    }
  }
  return "null";
}

const Json& need(const Json& obj, const char* key, const std::string& where) {
  const Json* v = obj.find(key);
  if (v == nullptr) throw RunnerError(where + ": malformed (" + key + " is missing)");
  return *v;
}
}  // namespace

void Trainer::save(const std::string& out) const {
  const std::string cp = art_.path("run_config.json");
  const Json& lora = need(art_.conf, "lora", cp);
  const Json& model = need(art_.conf, "model", cp);
  // adapter_config.json: the fields and order of save_adapter(), indent 2, no final newline.
  std::vector<std::pair<std::string, std::string>> f = {
      {"peft_type", "\"LORA\""},
      {"task_type", "\"CAUSAL_LM\""},
      {"r", dump(need(lora, "rank", cp), 1)},
      {"lora_alpha", dump(need(lora, "alpha", cp), 1)},
      {"lora_dropout", "0.0"},
      {"bias", "\"none\""},
      {"target_modules", dump(need(lora, "targets", cp), 1)},
      {"base_model_name_or_path", dump(need(model, "base_model", cp), 1)},
      {"fan_in_fan_out", "false"},
      {"use_rslora", "false"},
      {"use_dora", "false"},
      {"inference_mode", "true"},
  };
  std::string config = "{\n";
  for (size_t i = 0; i < f.size(); ++i)
    config +=
        "  " + json_quote(f[i].first) + ": " + f[i].second + (i + 1 < f.size() ? ",\n" : "\n");
  config += "}";

  std::vector<StOut> tensors;
  for (size_t i = 0; i < lora_.size(); ++i)
    for (const Lora& l : lora_[i])
      tensors.push_back(
          StOut{"base_model.model.model.layers." + std::to_string(i) + "." + l.key + ".weight",
                l.p.dtype, l.p.shape, l.p.buf.data(), l.p.nbytes()});
  // No metadata: byte for byte the file safetensors' save_file(tensors) writes in runner.py.
  const std::string model_bytes = st_serialize(std::move(tensors), {});

  std::string why;
  if (!make_dirs(out, why) || !write_atomic(out + "/adapter_model.safetensors", model_bytes, why) ||
      !write_atomic(out + "/adapter_config.json", config, why))
    throw RunnerError(out + ": could not save the adapter (" + why + ")");
}

}  // namespace mesp
