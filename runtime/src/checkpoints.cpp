#include "checkpoints.h"

#include "error.h"

namespace mesp {

void Checkpoints::init(size_t blocks, DType dtype, const Shape& shape, const std::string& dir) {
  dir_ = dir;
  bufs_.clear();
  const size_t kept = dir.empty() ? blocks : 2;
  for (size_t i = 0; i < kept; ++i) bufs_.emplace_back(dtype, shape);
  if (dir.empty()) return;
  std::string why;
  if (!file_.open(dir, why))
    throw RunnerError("--checkpoints-dir " + dir + ": cannot create a scratch file there (" +
                      why + ")");
}

HostTensor& Checkpoints::forward(size_t i) { return bufs_[file_.is_open() ? i % 2 : i]; }

void Checkpoints::keep(size_t i) {
  if (!file_.is_open()) return;  // in memory: forward(i) is the checkpoint
  const HostTensor& x = forward(i);
  std::string why;
  if (!file_.write(i * x.nbytes(), x.buf.data(), x.nbytes(), why))
    throw RunnerError("--checkpoints-dir " + dir_ + ": cannot write the block inputs (" + why +
                      "); no adapter written");
}

HostTensor& Checkpoints::backward(size_t i) {
  if (!file_.is_open()) return bufs_[i];
  HostTensor& x = bufs_[0];
  std::string why;
  if (!file_.read(i * x.nbytes(), x.buf.data(), x.nbytes(), why))
    throw RunnerError("--checkpoints-dir " + dir_ + ": cannot read the block inputs back (" +
                      why + "); no adapter written");
  return x;
}

}  // namespace mesp
