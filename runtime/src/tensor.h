// Host-side tensors: a dtype tag, a shape and a runner-owned, 64-byte aligned buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mesp {

// The safetensors dtype names the artifacts use.
enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, Unknown };

DType dtype_from_name(const std::string& name);  // Unknown when not one of the above
const char* dtype_name(DType t);
size_t dtype_size(DType t);  // 0 for Unknown

using Shape = std::vector<int64_t>;
int64_t numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"

// An owned, aligned, zero-initialized byte buffer (move-only).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t nbytes);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(data_);
  }
  template <class T>
  const T* as() const {
    return reinterpret_cast<const T*>(data_);
  }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct HostTensor {
  DType dtype = DType::F32;
  Shape shape;
  Buffer buf;

  HostTensor() = default;
  HostTensor(DType t, Shape s);
  int64_t numel() const { return mesp::numel(shape); }
  size_t nbytes() const { return buf.size(); }
};

}  // namespace mesp
