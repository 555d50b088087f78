#include "checkpoints.h"

#include "error.h"
#include "half.h"

namespace mesp {
void Checkpoints::init(size_t blocks, DType dtype, const Shape& shape, const std::string& dir,
                       DType store) {
  dir_ = dir;
  store_ = store;
  if (store != DType::F32 && (dtype != DType::F32 || (store != DType::F16 && store != DType::BF16)))
    throw RunnerError("--checkpoint-dtype: float16 or bfloat16 storage needs float32 block inputs");
  bufs_.clear();
  half_.clear();
  const size_t kept = staged() ? 2 : blocks;
  for (size_t i = 0; i < kept; ++i) bufs_.emplace_back(dtype, shape);
  const size_t n = static_cast<size_t>(numel(shape));
  if (store != DType::F32) {
    if (dir.empty()) half_.assign(blocks, std::vector<uint16_t>(n));
    else row_.assign(n, 0);
  }
  if (dir.empty()) return;
  std::string why;
  if (!file_.open(dir, why))
    throw RunnerError("--checkpoints-dir " + dir + ": cannot create a scratch file there (" +
                      why + ")");
}

HostTensor& Checkpoints::forward(size_t i) { return bufs_[staged() ? i % 2 : i]; }

void Checkpoints::keep(size_t i) {
  if (!staged()) return;  // in memory as computed: forward(i) is the checkpoint
  const HostTensor& x = forward(i);
  const void* src = x.buf.data();
  size_t nbytes = x.nbytes();
  if (store_ != DType::F32) {
    uint16_t* dst = file_.is_open() ? row_.data() : half_[i].data();
    const float* v = reinterpret_cast<const float*>(x.buf.data());
    const bool f16 = store_ == DType::F16;
    for (int64_t k = 0, n = x.numel(); k < n; ++k)
      dst[k] = f16 ? half_from_float(v[k]) : bf16_from_float(v[k]);
    if (!file_.is_open()) return;
    src = dst;
    nbytes = row_.size() * sizeof(uint16_t);
  }
  std::string why;
  if (!file_.write(i * nbytes, src, nbytes, why))
    throw RunnerError("--checkpoints-dir " + dir_ + ": cannot write the block inputs (" + why +
                      "); no adapter written");
}

HostTensor& Checkpoints::backward(size_t i) {
  if (!staged()) return bufs_[i];
  HostTensor& x = bufs_[0];
  std::string why;
  if (store_ == DType::F32) {
    if (!file_.read(i * x.nbytes(), x.buf.data(), x.nbytes(), why))
      throw RunnerError("--checkpoints-dir " + dir_ + ": cannot read the block inputs back (" +
                        why + "); no adapter written");
    return x;
  }
  const uint16_t* src = half_.empty() ? row_.data() : half_[i].data();
  if (file_.is_open()) {
    const size_t nbytes = row_.size() * sizeof(uint16_t);
    if (!file_.read(i * nbytes, row_.data(), nbytes, why))
      throw RunnerError("--checkpoints-dir " + dir_ + ": cannot read the block inputs back (" +
                        why + "); no adapter written");
  }
  float* v = reinterpret_cast<float*>(x.buf.data());
  const bool f16 = store_ == DType::F16;
  for (int64_t k = 0, n = x.numel(); k < n; ++k)
    v[k] = f16 ? float_from_half(src[k]) : float_from_bf16(src[k]);
  return x;
}

}  // namespace mesp
