#include "safetensors.h"

#include <algorithm>
#include <cstring>

#include "error.h"
#include "json.h"

namespace mesp {

namespace {
constexpr uint64_t kMaxHeader = 100u << 20;  // safetensors' own limit: 100 MB

uint64_t le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  throw RunnerError(path + ": not a readable safetensors file (" + why + ")");
}

StHeader parse_header(const std::string& path, const std::string& text, uint64_t file_size) {
  StHeader h;
  h.data_start = 8 + text.size();
  h.file_size = file_size;
  Json j;
  std::string why;
  if (!Json::parse(text, j, why)) bad(path, "header: " + why);
  if (!j.is_object()) bad(path, "header is not a JSON object");
  const uint64_t data_size = file_size - h.data_start;
  for (const auto& [name, v] : j.members()) {
    if (name == "__metadata__") {
      if (!v.is_object()) bad(path, "__metadata__ is not an object");
      for (const auto& [k, s] : v.members()) {
        if (!s.is_string()) bad(path, "__metadata__[" + k + "] is not a string");
        h.metadata[k] = s.as_string();
      }
      continue;
    }
    const Json* dt = v.find("dtype");
    const Json* sh = v.find("shape");
    const Json* off = v.find("data_offsets");
    if (dt == nullptr || !dt->is_string() || sh == nullptr || !sh->is_array() || off == nullptr ||
        !off->is_array() || off->items().size() != 2)
      bad(path, "tensor '" + name + "' needs dtype, shape and data_offsets");
    StEntry e;
    e.dtype = dt->as_string();
    int64_t count = 1;
    for (const Json& d : sh->items()) {
      // Bounded so that numel * element size cannot overflow 64 bits.
      if (!d.is_int() || d.as_int() < 0 ||
          (d.as_int() > 0 && count > (int64_t(1) << 56) / d.as_int()))
        bad(path, "tensor '" + name + "' has a bad shape");
      count *= d.as_int();
      e.shape.push_back(d.as_int());
    }
    const Json& b = off->items()[0];
    const Json& en = off->items()[1];
    if (!b.is_int() || !en.is_int() || b.as_int() < 0 || en.as_int() < b.as_int())
      bad(path, "tensor '" + name + "' has bad data_offsets");
    e.begin = static_cast<uint64_t>(b.as_int());
    e.end = static_cast<uint64_t>(en.as_int());
    if (e.end > data_size)
      bad(path, "tensor '" + name + "' ends at byte " + std::to_string(h.data_start + e.end) +
                    " of a " + std::to_string(file_size) + "-byte file (truncated?)");
    DType t = dtype_from_name(e.dtype);
    if (t != DType::Unknown) {
      uint64_t want = static_cast<uint64_t>(numel(e.shape)) * dtype_size(t);
      if (e.end - e.begin != want)
        bad(path, "tensor '" + name + "' holds " + std::to_string(e.end - e.begin) +
                      " bytes, its dtype and shape need " + std::to_string(want));
    }
    h.tensors[name] = std::move(e);
  }
  return h;
}
}  // namespace

StHeader read_st_header(const std::string& path) {
  int64_t size = file_size(path);
  if (size < 0) throw RunnerError(path + ": missing (the export is incomplete)");
  if (size < 8) bad(path, "shorter than its 8-byte header length");
  std::string head, why;
  if (!read_at(path, 0, 8, head, why)) bad(path, why);
  uint64_t n = le64(reinterpret_cast<const uint8_t*>(head.data()));
  if (n > kMaxHeader || n > static_cast<uint64_t>(size) - 8)
    bad(path, "header length " + std::to_string(n) + " does not fit the file");
  std::string text;
  if (!read_at(path, 8, static_cast<size_t>(n), text, why)) bad(path, why);
  return parse_header(path, text, static_cast<uint64_t>(size));
}

void StFile::open(const std::string& path) {
  path_ = path;
  std::string why;
  if (!view_.open(path, why)) throw RunnerError(path + ": cannot read (" + why + ")");
  if (view_.size() < 8) bad(path, "shorter than its 8-byte header length");
  uint64_t n = le64(view_.data());
  if (n > kMaxHeader || n > view_.size() - 8)
    bad(path, "header length " + std::to_string(n) + " does not fit the file");
  std::string text(reinterpret_cast<const char*>(view_.data()) + 8, static_cast<size_t>(n));
  header_ = parse_header(path, text, view_.size());
}

const uint8_t* StFile::data(const std::string& name) const {
  auto it = header_.tensors.find(name);
  if (it == header_.tensors.end()) throw RunnerError(path_ + ": no tensor '" + name + "'");
  return view_.data() + header_.data_start + it->second.begin;
}

StParts st_layout(std::vector<StOut> tensors, const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(),
            [](const StOut& a, const StOut& b) { return a.name < b.name; });
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      header += (first ? "" : ",") + json_quote(k) + ":" + json_quote(v);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StOut& t = tensors[i];
    header += (i || !metadata.empty() ? "," : "") + json_quote(t.name) + ":{\"dtype\":\"" +
              dtype_name(t.dtype) + "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d)
      header += (d ? "," : "") + std::to_string(t.shape[d]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.nbytes) + "]}";
    offset += t.nbytes;
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) header += ' ';  // data 8-byte aligned, as safetensors does
  StParts out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.head += static_cast<char>((n >> (8 * i)) & 0xFF);
  out.head += header;
  out.tensors = std::move(tensors);
  return out;
}

std::vector<ByteSpan> StParts::parts() const {
  std::vector<ByteSpan> p = {{head.data(), head.size()}};
  for (const StOut& t : tensors) p.push_back({t.data, t.nbytes});
  return p;
}

std::string st_serialize(std::vector<StOut> tensors,
                         const std::map<std::string, std::string>& metadata) {
  const StParts f = st_layout(std::move(tensors), metadata);
  std::string out = f.head;
  for (const StOut& t : f.tensors) out.append(reinterpret_cast<const char*>(t.data), t.nbytes);
  return out;
}

}  // namespace mesp
