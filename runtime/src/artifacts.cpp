#include "artifacts.h"

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "error.h"
#include "platform.h"
#include "safetensors.h"

namespace mesp {

namespace {
const char* kFormat = "mesp-artifacts";

// Typed access to run_config.json that names the bad field in its error.
struct Conf {
  std::string file;
  [[noreturn]] void bad(const std::string& where, const std::string& what) const {
    throw RunnerError(file + ": malformed (" + where + " " + what + ")");
  }
  const Json& get(const Json& obj, const std::string& key, const std::string& where) const {
    const Json* v = obj.find(key);
    if (v == nullptr) bad(where + "[\"" + key + "\"]", "is missing");
    return *v;
  }
  const Json& object(const Json& obj, const std::string& key, const std::string& where) const {
    const Json& v = get(obj, key, where);
    if (!v.is_object()) bad(where + "[\"" + key + "\"]", "is not an object");
    return v;
  }
  const Json& array(const Json& obj, const std::string& key, const std::string& where) const {
    const Json& v = get(obj, key, where);
    if (!v.is_array()) bad(where + "[\"" + key + "\"]", "is not an array");
    return v;
  }
  std::string str(const Json& obj, const std::string& key, const std::string& where) const {
    const Json& v = get(obj, key, where);
    if (!v.is_string()) bad(where + "[\"" + key + "\"]", "is not a string");
    return v.as_string();
  }
  int64_t integer(const Json& obj, const std::string& key, const std::string& where) const {
    const Json& v = get(obj, key, where);
    if (!v.is_int()) bad(where + "[\"" + key + "\"]", "is not an integer");
    return v.as_int();
  }
  Shape shape(const Json& v, const std::string& where) const {
    if (!v.is_array()) bad(where, "is not a shape");
    Shape s;
    for (const Json& d : v.items()) {
      if (!d.is_int() || d.as_int() < 0 || d.as_int() > (int64_t(1) << 40))
        bad(where, "is not a shape");
      s.push_back(d.as_int());
    }
    return s;
  }
};

IoSpec io_spec(const Conf& c, const Json& v, const std::string& where) {
  if (!v.is_object()) c.bad(where, "is not an object");
  IoSpec s;
  s.name = c.str(v, "name", where);
  std::string dt = c.str(v, "dtype", where);
  s.dtype = dtype_from_name(dt);
  if (s.dtype == DType::Unknown) c.bad(where + "[\"dtype\"]", "is an unknown dtype " + dt);
  s.shape = c.shape(c.get(v, "shape", where), where + "[\"shape\"]");
  if (const Json* dd = v.find("dynamic_dims")) {
    if (!dd->is_array()) c.bad(where + "[\"dynamic_dims\"]", "is not an array");
    for (const Json& d : dd->items()) {
      if (!d.is_int() || d.as_int() < 0 || d.as_int() >= static_cast<int64_t>(s.shape.size()))
        c.bad(where + "[\"dynamic_dims\"]", "names a dimension the shape does not have");
      s.dynamic_dims.push_back(static_cast<int>(d.as_int()));
    }
  }
  return s;
}

void check_file(const Artifacts& a, const std::string& rel, const Table& table) {
  std::string p = a.path(rel);
  StHeader h = read_st_header(p);  // missing / truncated / bad header: its own message
  auto id = h.metadata.find("export_id");
  std::string got = id == h.metadata.end() ? "None" : id->second;
  if (got != a.export_id)
    throw RunnerError(p + ": made by export " + got + ", but run_config.json is from export " +
                      a.export_id + " (files of two exports mixed?)");
  std::set<std::string> names, want;
  for (const auto& kv : h.tensors) names.insert(kv.first);
  for (const auto& kv : table) want.insert(kv.first);
  for (const auto& n : names)
    if (!want.count(n))
      throw RunnerError(p + ": tensor '" + n + "' does not match run_config.json");
  for (const auto& n : want)
    if (!names.count(n))
      throw RunnerError(p + ": tensor '" + n + "' does not match run_config.json");
  for (const auto& [k, e] : table) {
    const StEntry& s = h.tensors.at(k);
    if (s.dtype != e.dtype_text || s.shape != e.shape)
      throw RunnerError(p + ": tensor '" + k + "' is " + s.dtype + shape_str(s.shape) +
                        ", run_config.json says " + e.dtype_text + shape_str(e.shape));
  }
}

void check_pte(const Artifacts& a, const ProgramSpec& s) {
  std::string p = a.path(s.pte);
  int64_t size = file_size(p);
  if (size < 0) throw RunnerError(p + ": missing (the export is incomplete)");
  if (static_cast<uint64_t>(size) != s.size)
    throw RunnerError(p + ": " + std::to_string(size) + " bytes, run_config.json says " +
                      std::to_string(s.size) + " (truncated or replaced?)");
  FileView v;
  std::string why;
  if (!v.open(p, why)) throw RunnerError(p + ": cannot read (" + why + ")");
  std::string h = fnv1a64_hex(v.data(), v.size());
  if (h != s.fnv1a64)
    throw RunnerError(p + ": fnv1a64 " + h + " differs from run_config.json's " + s.fnv1a64 +
                      " (not from this export)");
}
}  // namespace

bool IoSpec::is_dynamic(size_t d) const {
  for (int x : dynamic_dims)
    if (static_cast<size_t>(x) == d) return true;
  return false;
}

const IoSpec* ProgramSpec::input(const std::string& n) const {
  for (const auto& s : inputs)
    if (s.name == n) return &s;
  return nullptr;
}

const IoSpec* ProgramSpec::output(const std::string& n) const {
  for (const auto& s : outputs)
    if (s.name == n) return &s;
  return nullptr;
}

const ProgramSpec& Artifacts::program(const std::string& name) const {
  auto it = programs.find(name);
  if (it == programs.end())
    throw RunnerError(path("run_config.json") + ": malformed (no program \"" + name + "\")");
  return it->second;
}

std::string fnv1a64_hex(const uint8_t* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

Artifacts load_artifacts(const std::string& root) {
  Artifacts a;
  a.root = root;
  std::string cp = a.path("run_config.json");
  if (!is_dir(root)) throw RunnerError(root + ": not an artifact directory");
  if (file_size(cp) < 0) throw RunnerError(cp + ": missing (not a `mesp export` directory?)");
  std::ifstream f(cp, std::ios::binary);
  if (!f) throw RunnerError(cp + ": unreadable (cannot open it)");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string why;
  if (!Json::parse(ss.str(), a.conf, why)) throw RunnerError(cp + ": unreadable: " + why);
  const Json& c = a.conf;
  Conf k{cp};
  const Json* fmt = c.find("format");
  const Json* ver = c.find("version");
  if (!c.is_object() || fmt == nullptr || !fmt->is_string() || fmt->as_string() != kFormat ||
      ver == nullptr || !ver->is_int() || ver->as_int() != 1)
    throw RunnerError(cp + ": not a " + std::string(kFormat) + " v1 config");
  const Json* et = c.find("executorch");
  if (et == nullptr || !et->is_object())
    throw RunnerError(cp + ": has no \"executorch\" section (export with --target executorch)");
  if (k.integer(*et, "version", "executorch") != 2)
    throw RunnerError(cp + ": executorch programs of another format than 2: export again with "
                      "the mesp this runner was built with");

  a.export_id = k.str(c, "export_id", "");
  a.seq_len = k.integer(c, "seq_len", "");
  a.batch_size = k.integer(c, "batch_size", "");
  a.vocab = k.integer(k.object(c, "model", ""), "vocab_size", "model");
  if (a.seq_len < 1 || a.batch_size < 1 || a.vocab < 1)
    k.bad("seq_len/batch_size/vocab_size", "not positive");
  a.lora_init = k.str(k.object(c, "lora", ""), "init", "lora");

  for (const auto& [rel, spec] : k.object(c, "files", "").members()) {
    std::string w = "files[\"" + rel + "\"]";
    if (!spec.is_object()) k.bad(w, "is not an object");
    Table t;
    for (const auto& [name, e] : k.object(spec, "tensors", w).members()) {
      std::string we = w + "[\"tensors\"][\"" + name + "\"]";
      if (!e.is_object()) k.bad(we, "is not an object");
      TableEntry te;
      te.dtype_text = k.str(e, "dtype", we);
      te.dtype = dtype_from_name(te.dtype_text);
      te.shape = k.shape(k.get(e, "shape", we), we + "[\"shape\"]");
      t[name] = te;
    }
    a.files[rel] = std::move(t);
  }
  const Json& blocks = k.array(c, "blocks", "");
  for (size_t i = 0; i < blocks.items().size(); ++i) {
    const Json& b = blocks.items()[i];
    std::string w = "blocks[" + std::to_string(i) + "]";
    if (!b.is_object()) k.bad(w, "is not an object");
    BlockInfo bi{k.str(b, "file", w), k.str(b, "fn", w), k.str(b, "layer_type", w)};
    if (!a.files.count(bi.file)) k.bad(w + "[\"file\"]", "is not in the files table");
    a.blocks.push_back(bi);
  }
  if (a.blocks.empty()) k.bad("blocks", "is empty");
  for (const char* rel : {"embedding.safetensors", "head.safetensors", "context.safetensors"})
    if (!a.files.count(rel)) k.bad("files", std::string("has no ") + rel);
  if (!a.files.count(a.lora_init)) k.bad("lora.init", "is not in the files table");

  for (const auto& [name, p] : k.object(*et, "programs", "executorch").members()) {
    std::string w = "executorch.programs[\"" + name + "\"]";
    if (!p.is_object()) k.bad(w, "is not an object");
    ProgramSpec s;
    s.name = name;
    s.pte = k.str(p, "pte", w);
    s.method = p.find("method") ? k.str(p, "method", w) : "forward";
    int64_t size = k.integer(p, "size", w);
    if (size < 0) k.bad(w + "[\"size\"]", "is negative");
    s.size = static_cast<uint64_t>(size);
    s.fnv1a64 = k.str(p, "fnv1a64", w);
    if (const Json* pb = p.find("planned_bytes")) {
      if (!pb->is_array()) k.bad(w + "[\"planned_bytes\"]", "is not an array");
      for (const Json& x : pb->items()) {
        if (!x.is_int() || x.as_int() < 0)
          k.bad(w + "[\"planned_bytes\"]", "is not a list of sizes");
        s.planned_bytes.push_back(x.as_int());
      }
    }
    const Json& ins = k.array(p, "inputs", w);
    for (size_t i = 0; i < ins.items().size(); ++i)
      s.inputs.push_back(io_spec(k, ins.items()[i], w + "[\"inputs\"][" + std::to_string(i) + "]"));
    const Json& outs = k.array(p, "outputs", w);
    for (size_t i = 0; i < outs.items().size(); ++i)
      s.outputs.push_back(
          io_spec(k, outs.items()[i], w + "[\"outputs\"][" + std::to_string(i) + "]"));
    a.programs[name] = std::move(s);
  }
  const Json& loss = k.object(*et, "loss", "executorch");
  a.loss_chunk = k.integer(loss, "chunk", "executorch.loss");
  a.head_file = k.str(loss, "head_file", "executorch.loss");
  a.head_prefix = k.str(loss, "head_prefix", "executorch.loss");
  if (a.loss_chunk < 1 || a.loss_chunk > a.vocab || k.integer(loss, "vocab", "executorch.loss") != a.vocab)
    k.bad("executorch.loss", "chunk or vocab disagrees with model.vocab_size");
  if (a.head_file != "head.safetensors" && a.head_file != "embedding.safetensors")
    k.bad("executorch.loss.head_file", "is neither head.safetensors nor embedding.safetensors");
  std::set<std::string> need = {"embed", "loss_start", "loss_slice", "loss_finish", "sgd", "adamw"};
  if (a.vocab % a.loss_chunk != 0) need.insert("loss_tail");
  for (const auto& b : a.blocks) {
    need.insert(b.fn + ".forward");
    need.insert(b.fn + ".backward");
  }
  for (const auto& n : need)
    if (!a.programs.count(n)) k.bad("executorch.programs", "has no program \"" + n + "\"");

  // The cheap checks first (headers, sizes), the hashes (a read of every .pte) after.
  for (const auto& [rel, table] : a.files) check_file(a, rel, table);
  for (const auto& [name, s] : a.programs) check_pte(a, s);
  return a;
}

}  // namespace mesp
