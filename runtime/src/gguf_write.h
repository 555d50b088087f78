// A small GGUF (v3) writer: the file gguf-py's GGUFWriter writes for the same calls, byte for
// byte. Header ("GGUF", version 3, tensor count, KV count), the KV pairs in the order added
// (general.architecture first), the tensor infos (name, dims in ggml order, the innermost first,
// type, offset), zero padding to 32 bytes, then each tensor's data padded to 32. Only what the
// adapter needs: string / uint32 / float32 values and F32 tensors; little-endian on any host.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "platform.h"
#include "tensor.h"

namespace mesp {

class GgufWriter {
 public:
  explicit GgufWriter(const std::string& architecture);
  // An empty value is skipped, as gguf-py's add_string skips it.
  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_f32(const std::string& key, float value);
  // `shape` in numpy order (outermost first). A view: `data` (numel(shape) floats) must live
  // until the file is written; it is written from where it lies.
  void add_f32_tensor(const std::string& name, const Shape& shape, const float* data);
  // The same for values the writer keeps (a permuted copy).
  void add_f32_tensor(const std::string& name, const Shape& shape, std::vector<float> data);
  // The file as pieces for write_atomic(path, parts): the header, then each tensor's bytes and
  // padding, with no copy of the tensors (valid while the writer and the views live).
  std::vector<ByteSpan> parts();
  // The whole file in one string.
  std::string bytes();

 private:
  struct Tensor {
    std::string name;
    Shape shape;
    const float* data;
  };
  std::string kv_;  // the packed KV pairs
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
  std::list<std::vector<float>> owned_;  // kept values (stable addresses)
  std::string head_;                     // built by parts()
};

}  // namespace mesp
