// The ExecuTorch side of the runner: every program loaded once, its "forward" method bound to
// ONE set of planned-memory arenas shared by all methods (they run one at a time), and a run()
// that sets every input (as views over runner-owned or mapped memory) before each execute.
// ExecuTorch headers stay inside et_program.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "artifacts.h"
#include "tensor.h"

namespace mesp {

// A view of a tensor the runner owns (inputs) or the arena holds (outputs).
struct TensorRef {
  DType dtype = DType::F32;
  Shape shape;  // the actual sizes (dynamic dims included)
  void* data = nullptr;
  size_t nbytes() const { return static_cast<size_t>(numel(shape)) * dtype_size(dtype); }
};

class Programs {
 public:
  Programs();
  ~Programs();
  Programs(const Programs&) = delete;
  Programs& operator=(const Programs&) = delete;

  // Loads every program of `art` and checks it against its spec (inputs, outputs, planned
  // buffers); then allocates the shared arenas and loads the methods. Throws RunnerError.
  void load(const Artifacts& art);

  // Runs `name`: sets inputs[i] as input i (the spec's order), executes, returns the outputs
  // (views into the arenas: valid until the next run; copy what you keep).
  std::vector<TensorRef> run(const std::string& name, const std::vector<TensorRef>& inputs);

  // Runs every program once on zero inputs (read from untouched zero pages: no memory), the
  // block backwards first, then the rest in name order. XNNPACK's shared workspace grows to
  // a delegate's need at that delegate's first call, and while it grows the old one (already
  // touched) and the new one (zero-filled) are both resident: at 0.5B the backward's first
  // call needed 25 MB over the forward's 20 MB, a 20 MB spike in the middle of the first
  // training step. Called right after load(), before the trainer holds its adapter, the
  // workspace takes the backward's size first and never grows in training. Outputs are
  // discarded; the planned arenas are overwritten by the first real run.
  void warm_up();

  uint64_t planned_bytes() const;  // the arenas, in total

  // Wall seconds each program spent in run() (inputs set, executed, outputs read) and its
  // calls, in name order, since the last take_times(); programs not run since are left out.
  struct Time {
    std::string name;
    double seconds = 0;
    int64_t calls = 0;
  };
  std::vector<Time> take_times();

  // --threads: resize ExecuTorch's shared thread pool (0 leaves the default).
  static void set_threads(int n);
  // Threads the delegated kernels run on (1 where there is no pool).
  static int threads();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mesp
