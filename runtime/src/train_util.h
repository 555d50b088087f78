// Small helpers shared by train.cpp and optimizer.cpp.
#pragma once

#include <cstring>
#include <string>

#include "artifacts.h"
#include "error.h"
#include "et_program.h"
#include "tensor.h"

namespace mesp {
namespace train_util {

inline bool starts(const std::string& s, const std::string& prefix, std::string* rest) {
  if (s.compare(0, prefix.size(), prefix) != 0) return false;
  *rest = s.substr(prefix.size());
  return true;
}

// A program input accepts `r` when dtypes match and every dim equals the spec's (a dynamic dim:
// at most the spec's upper bound).
inline bool fits(const IoSpec& spec, const TensorRef& r) {
  if (spec.dtype != r.dtype || spec.shape.size() != r.shape.size()) return false;
  for (size_t d = 0; d < r.shape.size(); ++d) {
    if (spec.is_dynamic(d) ? r.shape[d] > spec.shape[d] : r.shape[d] != spec.shape[d]) return false;
  }
  return true;
}

inline TensorRef ref(HostTensor& t) {
  return TensorRef{t.dtype, t.shape, t.buf.data()};
}
inline TensorRef ref(DType t, Shape s, void* data = nullptr) {
  return TensorRef{t, std::move(s), data};
}

// Copies a program output into a runner-owned tensor of the same size.
inline void copy_out(const TensorRef& from, HostTensor& to, const std::string& what) {
  if (from.dtype != to.dtype || from.nbytes() != to.nbytes())
    throw RunnerError(what + " came back as " + dtype_name(from.dtype) + shape_str(from.shape) +
                      ", expected " + dtype_name(to.dtype) + shape_str(to.shape));
  if (to.nbytes() > 0) std::memmove(to.buf.data(), from.data, to.nbytes());
}

inline float* f32(HostTensor& t) {
  return t.buf.as<float>();
}
}  // namespace train_util

}  // namespace mesp
