// The block inputs x_i of one step: what the forward keeps and the backward recomputes from.
// In memory one buffer per block; with --checkpoints-dir a nameless scratch file in that
// directory (platform.h's ScratchFile) holds them, each written in the forward and read back in
// the backward, so two buffers stay resident whatever the depth. Stored as they are (F32) the
// bytes go and come back unchanged: the numbers do not change. --checkpoint-dtype float16 /
// bfloat16 stores each block input rounded to nearest even (torch's .to(dtype)), half the
// bytes, and widens it back for the backward: the forward and the loss are unchanged, the
// backward recomputes from the rounded input (docs/ondevice.md states the difference). A
// finite input past the half type's range stops the run in one line (no adapter written).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "platform.h"
#include "tensor.h"

namespace mesp {

class Checkpoints {
 public:
  // Throws RunnerError (one line) when `dir` is given and no scratch file can be made there.
  // `store`: F32 (as computed), F16 or BF16.
  void init(size_t blocks, DType dtype, const Shape& shape, const std::string& dir,
            DType store = DType::F32);
  // Where the forward writes block i's input (and reads it to run block i).
  HostTensor& forward(size_t i);
  // Block i's input is complete: stored now (on disk: written to the file; half: rounded).
  void keep(size_t i);
  // Block i's input for its backward (on disk or half: read back / widened into a buffer).
  HostTensor& backward(size_t i);
  // Bytes held in memory: the fp32 buffers, and half storage where kept in memory.
  uint64_t resident_bytes() const;

 private:
  [[noreturn]] void overflow_error(size_t i, const float* v, int64_t n) const;
  bool staged() const { return file_.is_open() || store_ != DType::F32; }
  std::vector<HostTensor> bufs_;  // one per block; staged (disk or half): two, used in turn
  std::vector<std::vector<uint16_t>> half_;  // half storage in memory, one per block
  std::vector<uint16_t> row_;                // half storage on disk: one block's, staged
  ScratchFile file_;
  std::string dir_;
  DType store_ = DType::F32;
};

}  // namespace mesp
