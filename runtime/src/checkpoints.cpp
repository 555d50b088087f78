#include "checkpoints.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "error.h"
#include "half.h"

namespace mesp {
void Checkpoints::init(size_t blocks, DType dtype, const Shape& shape, const std::string& dir,
                       DType store) {
  dir_ = dir;
  store_ = store;
  if (store != DType::F32 && (dtype != DType::F32 || (store != DType::F16 && store != DType::BF16)))
    throw RunnerError("--checkpoint-dtype: float16 or bfloat16 storage needs float32 block inputs");
  std::string why;  // the file first: staged() reads whether it is open
  if (!dir.empty() && !file_.open(dir, why))
    throw RunnerError("--checkpoints-dir " + dir + ": cannot create a scratch file there (" +
                      why + ")");
  bufs_.clear();
  half_.clear();
  const size_t kept = staged() ? 2 : blocks;
  for (size_t i = 0; i < kept; ++i) bufs_.emplace_back(dtype, shape);
  const size_t n = static_cast<size_t>(numel(shape));
  if (store != DType::F32) {
    if (dir.empty()) half_.assign(blocks, std::vector<uint16_t>(n));
    else row_.assign(n, 0);
  }
}

uint64_t Checkpoints::resident_bytes() const {
  uint64_t n = 2 * row_.size();
  for (const HostTensor& b : bufs_) n += b.nbytes();
  for (const auto& h : half_) n += 2 * h.size();
  return n;
}

void Checkpoints::overflow_error(size_t i, const float* v, int64_t n) const {
  float top = 0;
  for (int64_t k = 0; k < n; ++k)
    if (std::isfinite(v[k])) top = std::max(top, std::fabs(v[k]));
  const bool f16 = store_ == DType::F16;
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "--checkpoint-dtype %s: block %zu's input reaches %.4g, past %s's largest (%s); "
                "use %s; no adapter written",
                f16 ? "float16" : "bfloat16", i, top, f16 ? "float16" : "bfloat16",
                f16 ? "65504" : "3.39e38", f16 ? "bfloat16 or float32" : "float32");
  throw RunnerError(msg);
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
    bool overflow = false;  // a finite input that rounds to infinity would poison the backward
    for (int64_t k = 0, n = x.numel(); k < n; ++k) {
      dst[k] = f16 ? half_from_float(v[k]) : bf16_from_float(v[k]);
      overflow |= (dst[k] & 0x7FFFu) == (f16 ? 0x7C00u : 0x7F80u) && std::isfinite(v[k]);
    }
    if (overflow) overflow_error(i, v, x.numel());
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
