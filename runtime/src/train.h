// The training step of mesp/ondevice/runner.py (Trainer.step, train), on ExecuTorch programs:
//   embed -> per block: keep its input, map its weights, forward, unmap
//   -> loss: start, one program call per vocabulary slice, finish (per-row losses and the
//      gradient of the last hidden state; train_loss.cpp)
//   -> per block in reverse: map its weights, backward (dx and the LoRA gradients), unmap
//   -> sgd / adamw program on each block's LoRA tensors right after that block's backward.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "artifacts.h"
#include "data.h"
#include "checkpoints.h"
#include "et_program.h"
#include "gguf_write.h"
#include "private.h"
#include "safetensors.h"
#include "tensor.h"

namespace mesp {

struct OptimConfig {
  std::string optimizer = "sgd";  // or "adamw"
  double lr = 1e-4;
  double weight_decay = 0.0;
};

class Trainer {
 public:
  // Checks every program input against where its data will come from (cheap: headers only).
  // checkpoint_dir: "" keeps the block inputs in memory; else they go to a nameless scratch
  // file there (written in the forward, read back in the backward: two buffers stay resident).
  // checkpoint_dtype: F32 keeps them as computed; F16 / BF16 stores them rounded
  // (checkpoints.h).
  Trainer(const Artifacts& art, OptimConfig opt, const std::string& checkpoint_dir = "",
          DType checkpoint_dtype = DType::F32);
  // Maps the resident files, reads the initial adapter; call after the cheap checks.
  void prepare(Programs& programs);
  // One step on `batch`: the mean token loss, or nothing when no token is trained (then no
  // optimizer step). Throws RunnerError on a non-finite loss.
  std::optional<double> step(const Batch& batch, int64_t k);
  // DP-SGD (private.h; train_private.cpp): call before prepare(). step_private(rows, k) is
  // step k on its Poisson sample of `rows`: the mean of the sampled rows' own mean losses
  // (nothing when no sampled row has a trained token; the noise step still runs), with the
  // sample's size in `sampled`.
  void enable_dp(const DpPlan& plan);
  std::optional<double> step_private(const std::vector<Row>& rows, int64_t k, int64_t& sampled);
  // Writes OUT/adapter_model.safetensors, OUT/adapter.gguf (llama.cpp's LoRA file) where the
  // export recorded its form, then OUT/adapter_config.json. Returns "" or the one line that
  // says why there is no adapter.gguf.
  std::string save(const std::string& out) const;

  // Largest anonymous RSS seen: after any program ran, and by the watch thread (platform.h's
  // start_anon_watch) inside them.
  uint64_t peak_anon() const { return std::max(peak_anon_, anon_watch_peak()); }
  // Bytes the block-input store holds in memory (the JSON log's checkpoint_bytes).
  uint64_t checkpoint_bytes() const { return checkpoints_.resident_bytes(); }
  // Records RssAnon and Private_Dirty now, as `at` (e.g. "after load"); each program's first
  // run is recorded on its own, before and after, the "after" with the largest RssAnon the
  // watch thread read while it ran (peak_inside_bytes; 0 with no watch or a run shorter than
  // its period). take_memory_events() returns the records since the last call as a JSON
  // array ("[]" when none) and clears them.
  void note_memory(const std::string& at, uint64_t peak_inside = 0);
  std::string take_memory_events();

 private:
  struct Lora {
    std::string key;  // e.g. "self_attn.q_proj.lora_A"
    HostTensor p, m, v;
    HostTensor acc, ex;  // DP-SGD: the step's clipped sum; flat: the example's gradient
  };

  std::vector<TensorRef> bind(const std::string& prog, int block,
                              const std::map<std::string, TensorRef>& named, bool with_data);
  std::vector<TensorRef> run(const std::string& prog, int block,
                             const std::map<std::string, TensorRef>& named);
  const TensorRef& output(const std::vector<TensorRef>& outs, const std::string& prog,
                          const std::string& name) const;
  // adapter.gguf's writer (adapter.cpp), viewing the adapter's buffers: null with `note` set
  // when the export recorded no form.
  std::unique_ptr<GgufWriter> adapter_gguf(const std::string& out, std::string& note) const;
  // The optimizer: begin_update() takes the next step's scalars (t counts optimizer steps);
  // update_block(i) runs the update program on block i's adapter tensors with the gradients in
  // grads_ (optimizer.cpp). Called right after block i's backward: exact (block i's adapter is
  // not read again this step and the updates are per tensor), so only one block's gradients
  // exist at a time.
  void begin_update();
  // step(): the forward and the loss (the trained rows' summed loss; dL/dh left in g_), then
  // the blocks in reverse, `block_grads(i)` called with block i's LoRA gradients in grads_.
  double forward_loss(const Batch& batch, int64_t k);
  void backward(const std::function<void(size_t)>& block_grads);
  // DP-SGD's parts (train_private.cpp): block i's gradients clipped into acc (per-layer) or
  // kept in ex (flat); flat's one scale at the end of an example; the noisy update.
  void dp_take_block(size_t i);
  void dp_flat_done();
  void dp_update(int64_t k);
  void update_block(size_t i);
  void sample_memory();
  // The loss (train_loss.cpp): the up-front checks of its programs, and one run of the loop
  // loss_start -> loss_slice per vocabulary slice (loss_tail: a shorter last) -> loss_finish on
  // the n trained rows in rows_/tgt_; dh goes to g_, the per-row losses' sum (double) returned.
  void check_loss(const TensorRef& act);
  double run_loss(int64_t n);
  TensorRef rows_of(HostTensor& t, int64_t n) const;  // t with dim 0 cut to n

  const Artifacts& art_;
  OptimConfig opt_;
  Programs* programs_ = nullptr;
  StFile embed_, head_, ctx_;            // resident for the whole run
  StFile block_;                         // the one block whose weights are mapped now
  std::vector<std::vector<Lora>> lora_;  // per block, in the forward program's input order
  Checkpoints checkpoints_;              // block inputs x_i (checkpoints.h)
  HostTensor ids_, rows_, tgt_, norm_, h_, g_;
  HostTensor scalars_[8];        // 0-d f32 optimizer inputs
  std::map<std::string, TensorRef> opt_named_;  // the scalars, by input name
  std::vector<HostTensor> grads_;  // one block's LoRA gradients (max numel each), reused
  std::vector<std::string> state_names_;  // loss_start's outputs: hs, then the running state
  std::vector<HostTensor> state_;         // their buffers, B*S rows (n used)
  HostTensor v0_;                         // 0-d i64: the slice's first vocabulary id
  std::vector<Buffer> scratch_;  // aligned copies of misaligned mapped tensors, for one run
  int64_t opt_steps_ = 0;
  int64_t max_lora_numel_ = 0;
  uint64_t peak_anon_ = 0;
  std::optional<DpPlan> dp_;
  size_t dp_linears_ = 0;  // K: the adapted linears (A/B pairs) of the whole model
  std::set<std::string> ran_;              // programs run at least once
  std::vector<std::string> memory_events_;  // JSON objects, in order
};

}  // namespace mesp
