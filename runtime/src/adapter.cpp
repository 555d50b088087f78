// Trainer::save: the adapter in PEFT's format, as save_adapter() in mesp/ondevice/runner.py
// writes it: adapter_model.safetensors first, adapter_config.json last, each atomically; between
// them adapter.gguf, llama.cpp's LoRA file (the one `mesp export-adapter` writes), where the
// export recorded the base GGUF's tensor names.
#include <cstring>
#include <memory>

#include "error.h"
#include "gguf_write.h"
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

// general.name: the adapter directory's name as Python's Path(out).name reads it (what `mesp
// export-adapter --adapter OUT` writes): trailing slashes and "." components dropped.
std::string dir_name(std::string s) {
  for (;;) {
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    if (s == "." || s == "/") return "";
    if (s.size() < 2 || s.compare(s.size() - 2, 2, "/.") != 0) break;
    s.resize(s.size() - 2);
    if (s.empty()) return "";  // "/."
  }
  return s.substr(s.find_last_of('/') + 1);
}

// B (out, r) with llama.cpp's q/k row permutation over `heads` (LlamaModel.permute): in each
// head, row j * half + i (j = 0, 1: the rotary halves) moves to row 2 * i + j.
std::vector<float> permute_rows(const float* b, int64_t out, int64_t r, int64_t heads,
                                const std::string& where) {
  if (heads <= 0 || out % (2 * heads) != 0)
    throw RunnerError(where + ": cannot permute " + std::to_string(out) + " rows over " +
                      std::to_string(heads) + " heads");
  const int64_t hd = out / heads, half = hd / 2;
  std::vector<float> o(static_cast<size_t>(out * r));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j)
        std::memcpy(&o[static_cast<size_t>((h * hd + 2 * i + j) * r)],
                    b + (h * hd + j * half + i) * r, static_cast<size_t>(r) * sizeof(float));
  return o;
}
}  // namespace

// adapter.gguf: the "gguf_adapter" section (mesp/ondevice/contract.py) over the trained tensors,
// as mesp/ondevice/adapter_gguf.py writes it (a writer viewing the adapter's own buffers); null
// with `note` set when the export recorded none.
std::unique_ptr<GgufWriter> Trainer::adapter_gguf(const std::string& out,
                                                  std::string& note) const {
  const std::string cp = art_.path("run_config.json");
  const Json* sec = art_.conf.find("gguf_adapter");
  if (sec == nullptr || !sec->is_object()) {
    const Json* family = need(art_.conf, "model", cp).find("family");
    note = std::string("no adapter.gguf: the llama.cpp form of this ") +
           (family != nullptr && family->is_string() ? family->as_string() : "?") +
           " adapter " + (sec == nullptr ? "was not recorded (export again)" : "is none");
    return nullptr;
  }
  const std::string where = cp + ": gguf_adapter";
  const Json &arch = need(*sec, "architecture", where), &alpha = need(*sec, "alpha", where);
  const Json& list = need(*sec, "tensors", where);
  if (!arch.is_string() || !alpha.is_number() || !list.is_array())
    throw RunnerError(where + ": malformed (architecture, alpha or tensors)");
  auto w = std::make_unique<GgufWriter>(arch.as_string());
  w->add_string("general.type", "adapter");
  w->add_string("adapter.type", "lora");
  w->add_f32("adapter.lora.alpha", static_cast<float>(alpha.as_double()));
  w->add_string("general.name", dir_name(out));
  w->add_u32("general.file_type", 0);             // LlamaFileType.ALL_F32
  w->add_u32("general.quantization_version", 2);  // GGML_QUANT_VERSION
  for (const Json& t : list.items()) {
    const Json &layer = need(t, "layer", where), &module = need(t, "module", where);
    const Json &name = need(t, "name", where), &heads = need(t, "permute", where);
    if (!layer.is_int() || layer.as_int() < 0 ||
        layer.as_int() >= static_cast<int64_t>(lora_.size()) || !module.is_string() ||
        !name.is_string() || !heads.is_int())
      throw RunnerError(where + ": malformed tensor entry");
    const Lora *a = nullptr, *b = nullptr;
    for (const Lora& l : lora_[static_cast<size_t>(layer.as_int())]) {
      if (l.key == module.as_string() + ".lora_A") a = &l;
      if (l.key == module.as_string() + ".lora_B") b = &l;
    }
    if (a == nullptr || b == nullptr || a->p.dtype != DType::F32 || b->p.dtype != DType::F32 ||
        a->p.shape.size() != 2 || b->p.shape.size() != 2)
      throw RunnerError(where + ": no 2-D F32 adapter for layer " +
                        std::to_string(layer.as_int()) + " " + module.as_string());
    const float* bp = b->p.buf.as<float>();
    const int64_t rows = b->p.shape[0], r = b->p.shape[1];
    w->add_f32_tensor(name.as_string() + ".lora_a", a->p.shape, a->p.buf.as<float>());
    if (heads.as_int())  // a permuted copy (r x out: small); otherwise written where it lies
      w->add_f32_tensor(name.as_string() + ".lora_b", b->p.shape,
                        permute_rows(bp, rows, r, heads.as_int(), where));
    else
      w->add_f32_tensor(name.as_string() + ".lora_b", b->p.shape, bp);
  }
  return w;
}

std::string Trainer::save(const std::string& out) const {
  const std::string cp = art_.path("run_config.json");
  std::string note;
  // checked before any file is written; it views the adapter's buffers (no copy)
  const std::unique_ptr<GgufWriter> gguf = adapter_gguf(out, note);
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
  // No metadata: byte for byte the file safetensors' save_file(tensors) writes in runner.py,
  // written from the adapter's own buffers (no second copy of the adapter in memory).
  const StParts model_file = st_layout(std::move(tensors), {});

  std::string why;
  if (!make_dirs(out, why) ||
      !write_atomic(out + "/adapter_model.safetensors", model_file.parts(), why) ||
      (gguf && !write_atomic(out + "/adapter.gguf", gguf->parts(), why)) ||
      !write_atomic(out + "/adapter_config.json", config, why))
    throw RunnerError(out + ": could not save the adapter (" + why + ")");
  return note;
}

}  // namespace mesp
