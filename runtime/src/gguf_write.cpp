// GGUF v3, as gguf-py's GGUFWriter writes it (gguf_write.h): the adapter.gguf of adapter.cpp.
#include "gguf_write.h"

#include <cstring>
#include <utility>

#include "error.h"

namespace mesp {

namespace {
constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint32_t kVersion = 3;
constexpr uint64_t kAlign = 32;  // GGUF_DEFAULT_ALIGNMENT: no general.alignment key is written
constexpr uint32_t kTypeU32 = 4, kTypeF32 = 6, kTypeString = 8;  // GGUFValueType
constexpr uint32_t kGgmlF32 = 0;                                  // GGMLQuantizationType.F32

void put_le(std::string& s, uint64_t v, int nbytes) {
  for (int i = 0; i < nbytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u32(std::string& s, uint32_t v) { put_le(s, v, 4); }
void put_u64(std::string& s, uint64_t v) { put_le(s, v, 8); }
void put_f32(std::string& s, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_u32(s, bits);
}
void put_str(std::string& s, const std::string& v) {  // uint64 length, then the UTF-8 bytes
  put_u64(s, v.size());
  s += v;
}
uint64_t padded(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
bool host_little_endian() {
  const uint16_t one = 1;
  uint8_t first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}
}  // namespace

GgufWriter::GgufWriter(const std::string& architecture) {
  add_string("general.architecture", architecture);
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  if (value.empty()) return;
  put_str(kv_, key);
  put_u32(kv_, kTypeString);
  put_str(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_str(kv_, key);
  put_u32(kv_, kTypeU32);
  put_u32(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_f32(const std::string& key, float value) {
  put_str(kv_, key);
  put_u32(kv_, kTypeF32);
  put_f32(kv_, value);
  ++n_kv_;
}

void GgufWriter::add_f32_tensor(const std::string& name, const Shape& shape,
                                const float* data) {
  if (!host_little_endian()) {  // GGUF is little-endian: the owned path swaps a copy
    add_f32_tensor(name, shape, std::vector<float>(data, data + numel(shape)));
    return;
  }
  tensors_.push_back(Tensor{name, shape, data});
}

void GgufWriter::add_f32_tensor(const std::string& name, const Shape& shape,
                                std::vector<float> data) {
  if (numel(shape) != static_cast<int64_t>(data.size()))
    throw RunnerError("adapter.gguf: tensor " + name + " has " + std::to_string(data.size()) +
                      " values for shape " + shape_str(shape));
  if (!host_little_endian())
    for (float& v : data) {
      auto* b = reinterpret_cast<uint8_t*>(&v);
      std::swap(b[0], b[3]);
      std::swap(b[1], b[2]);
    }
  owned_.push_back(std::move(data));
  tensors_.push_back(Tensor{name, shape, owned_.back().data()});
}

std::vector<ByteSpan> GgufWriter::parts() {
  static const char kZeros[kAlign] = {};
  head_.clear();
  put_u32(head_, kMagic);
  put_u32(head_, kVersion);
  put_u64(head_, tensors_.size());
  put_u64(head_, n_kv_);
  head_ += kv_;
  uint64_t offset = 0;  // from the start of the data section
  for (const Tensor& t : tensors_) {
    put_str(head_, t.name);
    put_u32(head_, static_cast<uint32_t>(t.shape.size()));
    for (size_t d = t.shape.size(); d-- > 0;) put_u64(head_, static_cast<uint64_t>(t.shape[d]));
    put_u32(head_, kGgmlF32);
    put_u64(head_, offset);
    offset += padded(static_cast<uint64_t>(numel(t.shape)) * sizeof(float));
  }
  head_.resize(padded(head_.size()), '\0');
  std::vector<ByteSpan> out = {{head_.data(), head_.size()}};
  for (const Tensor& t : tensors_) {  // the data section starts aligned: pad each tensor alone
    const uint64_t n = static_cast<uint64_t>(numel(t.shape)) * sizeof(float);
    out.push_back({t.data, static_cast<size_t>(n)});
    if (padded(n) > n) out.push_back({kZeros, static_cast<size_t>(padded(n) - n)});
  }
  return out;
}

std::string GgufWriter::bytes() {
  std::string s;
  for (const ByteSpan& p : parts()) s.append(static_cast<const char*>(p.data), p.size);
  return s;
}

}  // namespace mesp
