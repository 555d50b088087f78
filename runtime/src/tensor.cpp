#include "tensor.h"

#include <cstring>
#include <new>
#include <utility>

namespace mesp {

namespace {
struct DTypeRow {
  DType t;
  const char* name;
  size_t size;
};
const DTypeRow kDTypes[] = {
    {DType::F32, "F32", 4},   {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::F64, "F64", 8},   {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},   {DType::I8, "I8", 1},   {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1},
};
constexpr std::align_val_t kAlign{64};
}  // namespace

DType dtype_from_name(const std::string& name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.t;
  return DType::Unknown;
}

const char* dtype_name(DType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.name;
  return "?";
}

size_t dtype_size(DType t) {
  for (const auto& r : kDTypes)
    if (r.t == t) return r.size;
  return 0;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Buffer::Buffer(size_t nbytes) : size_(nbytes) {
  if (nbytes > 0) {
    data_ = static_cast<uint8_t*>(::operator new(nbytes, kAlign));
    std::memset(data_, 0, nbytes);
  }
}

Buffer::~Buffer() {
  if (data_ != nullptr) ::operator delete(data_, kAlign);
}

Buffer::Buffer(Buffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::operator delete(data_, kAlign);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

HostTensor::HostTensor(DType t, Shape s)
    : dtype(t), shape(std::move(s)), buf(static_cast<size_t>(mesp::numel(shape)) * dtype_size(t)) {}

}  // namespace mesp
