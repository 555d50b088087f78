// The block inputs x_i of one step: what the forward keeps and the backward recomputes from.
// In memory one buffer per block; with --checkpoints-dir a nameless scratch file in that
// directory (platform.h's ScratchFile) holds them, each written in the forward and read back in
// the backward, so two buffers stay resident whatever the depth. Bytes go and come back as they
// are: the numbers do not change.
#pragma once

#include <string>
#include <vector>

#include "platform.h"
#include "tensor.h"

namespace mesp {

class Checkpoints {
 public:
  // Throws RunnerError (one line) when `dir` is given and no scratch file can be made there.
  void init(size_t blocks, DType dtype, const Shape& shape, const std::string& dir);
  // Where the forward writes block i's input (and reads it to run block i).
  HostTensor& forward(size_t i);
  // Block i's input is complete: on disk, saved to the file now.
  void keep(size_t i);
  // Block i's input for its backward (on disk: read back into a buffer first).
  HostTensor& backward(size_t i);

 private:
  std::vector<HostTensor> bufs_;  // one per block; on disk two, used in turn
  ScratchFile file_;
  std::string dir_;
};

}  // namespace mesp
