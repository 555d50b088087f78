#include "train.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "error.h"
#include "platform.h"
#include "train_util.h"

namespace mesp {

using namespace train_util;

namespace {
const std::string kPeft = "base_model.model.model.layers.";
}  // namespace

Trainer::Trainer(const Artifacts& art, OptimConfig opt, const std::string& checkpoint_dir,
                 DType checkpoint_dtype)
    : art_(art), opt_(std::move(opt)) {
  const int64_t B = art.batch_size, S = art.seq_len;
  const IoSpec* h = art.program("embed").output("h");
  if (h == nullptr || h->shape.size() != 3 || h->shape[0] != B || h->shape[1] != S ||
      !h->dynamic_dims.empty())
    throw RunnerError(art.path("run_config.json") + ": malformed (embed must return h (B, S, H))");
  const DType act = h->dtype;
  const Shape act_shape = h->shape;

  // The LoRA tensors of each block: the forward program's lora/ inputs, in its order.
  const Table& init = art.files.at(art.lora_init);
  lora_.resize(art.blocks.size());
  for (size_t i = 0; i < art.blocks.size(); ++i) {
    for (const IoSpec& in : art.program(art.blocks[i].fn + ".forward").inputs) {
      std::string key;
      if (!starts(in.name, "lora/", &key)) continue;
      std::string name = kPeft + std::to_string(i) + "." + key + ".weight";
      auto it = init.find(name);
      if (it == init.end())
        throw RunnerError(art.path(art.lora_init) + ": no tensor '" + name + "'");
      Lora l;
      l.key = key;
      l.p.dtype = it->second.dtype;
      l.p.shape = it->second.shape;
      max_lora_numel_ = std::max(max_lora_numel_, numel(l.p.shape));
      lora_[i].push_back(std::move(l));
    }
    if (lora_[i].empty())
      throw RunnerError("block " + std::to_string(i) + ": its program takes no LoRA tensor");
  }

  auto check = [&](const std::string& prog, int block,
                   const std::map<std::string, TensorRef>& named) {
    bind(prog, block, named, false);
  };
  auto need_out = [&](const std::string& prog, const std::string& name, DType t, const Shape& s) {
    const IoSpec* o = art.program(prog).output(name);
    if (o == nullptr || o->dtype != t || o->shape != s)
      throw RunnerError(art.path(art.program(prog).pte) + ": output " + name + " must be " +
                        dtype_name(t) + shape_str(s));
  };
  const TensorRef a = ref(act, act_shape);
  const TensorRef n_rows = ref(DType::I64, {B * S});
  const TensorRef scalar = ref(DType::F32, {});
  check("embed", -1, {{"ids", ref(DType::I64, {B, S})}});
  for (size_t i = 0; i < art.blocks.size(); ++i) {
    const std::string fn = art.blocks[i].fn;
    check(fn + ".forward", static_cast<int>(i), {{"x", a}});
    need_out(fn + ".forward", "y", act, act_shape);
    check(fn + ".backward", static_cast<int>(i), {{"x", a}, {"dy", a}});
    need_out(fn + ".backward", "dx", act, act_shape);
    for (const Lora& l : lora_[i])
      need_out(fn + ".backward", "grad/" + l.key, l.p.dtype, l.p.shape);
  }
  check_loss(a);
  const TensorRef flat = ref(DType::F32, {max_lora_numel_});
  const std::string& o = opt_.optimizer;
  if (o == "sgd") {
    check("sgd", -1, {{"p", flat}, {"g", flat}, {"lr", scalar}, {"weight_decay", scalar}});
  } else {
    check("adamw", -1,
          {{"p", flat},
           {"g", flat},
           {"m", flat},
           {"v", flat},
           {"decay", scalar},
           {"one_minus_beta1", scalar},
           {"beta2", scalar},
           {"one_minus_beta2", scalar},
           {"step_size", scalar},
           {"bc2_sqrt", scalar},
           {"eps", scalar}});
  }
  for (const auto& block : lora_)
    for (const Lora& l : block)
      if (l.p.dtype != DType::F32)
        throw RunnerError(art.path(art.lora_init) +
                          ": LoRA tensors must be F32 (the optimizer programs are)");

  ids_ = HostTensor(DType::I64, {B, S});
  rows_ = HostTensor(DType::I64, {B * S});
  tgt_ = HostTensor(DType::I64, {B * S});
  norm_ = HostTensor(DType::F32, {});
  for (HostTensor& s : scalars_) s = HostTensor(DType::F32, {});
  h_ = HostTensor(act, act_shape);
  g_ = HostTensor(act, act_shape);
  checkpoints_.init(art.blocks.size(), act, act_shape, checkpoint_dir, checkpoint_dtype);
}

// The inputs of `prog` in its spec's order: `named` (per-call tensors: x, dy, ids, ...) first,
// then weights/, ctx/ and lora/ from their files. Before prepare() (with_data false) only the
// dtypes and shapes are known, from run_config.json's tables: that is the up-front check.
std::vector<TensorRef> Trainer::bind(const std::string& prog, int block,
                                     const std::map<std::string, TensorRef>& named,
                                     bool with_data) {
  const ProgramSpec& spec = art_.program(prog);
  std::vector<TensorRef> out;
  for (const IoSpec& in : spec.inputs) {
    TensorRef r;
    std::string rest, key2;
    auto it = named.find(in.name);
    if (it != named.end()) {
      r = it->second;
    } else if (starts(in.name, "weights/", &rest) || starts(in.name, "ctx/", &rest)) {
      std::string rel, key = rest;
      const StFile* file = nullptr;
      if (in.name[0] == 'c') {
        rel = "context.safetensors";
        key = art_.blocks[static_cast<size_t>(block)].layer_type + "." + rest;
        file = &ctx_;
      } else if (prog == "embed") {
        rel = "embedding.safetensors";
        file = &embed_;
      } else if (starts(prog, "loss_", &key2)) {
        bool in_head = art_.files.at("head.safetensors").count(rest) > 0;
        rel = in_head ? "head.safetensors" : "embedding.safetensors";
        file = in_head ? &head_ : &embed_;
      } else {
        rel = art_.blocks[static_cast<size_t>(block)].file;
        file = &block_;
      }
      if (with_data) {
        auto t = file->header().tensors.find(key);
        if (t == file->header().tensors.end())
          throw RunnerError(file->path() + ": no tensor '" + key + "' (program " + prog +
                            " needs it)");
        r = ref(dtype_from_name(t->second.dtype), t->second.shape,
                const_cast<uint8_t*>(file->data(key)));
        // safetensors' own writer keeps data aligned; a file from another writer may not be,
        // and kernels may assume aligned elements: such a tensor is copied.
        const size_t esize = dtype_size(r.dtype);
        if (esize > 1 && reinterpret_cast<uintptr_t>(r.data) % esize != 0) {
          scratch_.emplace_back(r.nbytes());
          std::memcpy(scratch_.back().data(), r.data, r.nbytes());
          r.data = scratch_.back().data();
        }
      } else {
        auto t = art_.files.at(rel).find(key);
        if (t == art_.files.at(rel).end())
          throw RunnerError(art_.path(rel) + ": no tensor '" + key + "' (program " + prog +
                            " needs it)");
        r = ref(t->second.dtype, t->second.shape);
      }
    } else if (starts(in.name, "lora/", &rest)) {
      Lora* l = nullptr;
      for (Lora& x : lora_[static_cast<size_t>(block)])
        if (x.key == rest) l = &x;
      if (l == nullptr)
        throw RunnerError(art_.path(spec.pte) + ": input " + in.name +
                          " is no LoRA tensor of block " + std::to_string(block));
      r = with_data ? ref(l->p) : ref(l->p.dtype, l->p.shape);
    } else {
      throw RunnerError(art_.path(spec.pte) + ": input '" + in.name +
                        "' is not one the runner knows");
    }
    if (!fits(in, r))
      throw RunnerError(art_.path(spec.pte) + ": input " + in.name + " is " + dtype_name(in.dtype) +
                        shape_str(in.shape) + " but its data is " + dtype_name(r.dtype) +
                        shape_str(r.shape) +
                        (block >= 0 ? " (block " + std::to_string(block) + ")" : ""));
    out.push_back(r);
  }
  return out;
}

std::vector<TensorRef> Trainer::run(const std::string& prog, int block,
                                    const std::map<std::string, TensorRef>& named) {
  const bool first = ran_.insert(prog).second;
  if (first) note_memory("before first " + prog);
  if (first) anon_watch_take();  // from here: the peak inside this program's first run
  std::vector<TensorRef> outs = programs_->run(prog, bind(prog, block, named, true));
  const uint64_t inside = first ? anon_watch_take() : 0;
  scratch_.clear();
  sample_memory();
  if (first) note_memory("after first " + prog, inside);
  return outs;
}

void Trainer::note_memory(const std::string& at, uint64_t peak_inside) {
  const MemInfo m = mem_detail();
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "{\"at\": \"%s\", \"rss_anon_bytes\": %llu, \"private_dirty_bytes\": %llu, "
                "\"peak_inside_bytes\": %llu}",
                at.c_str(), static_cast<unsigned long long>(m.rss_anon),
                static_cast<unsigned long long>(m.private_dirty),
                static_cast<unsigned long long>(peak_inside));
  memory_events_.emplace_back(buf);
}

std::string Trainer::take_memory_events() {
  std::string out = "[";
  for (size_t i = 0; i < memory_events_.size(); ++i)
    out += (i ? ", " : "") + memory_events_[i];
  memory_events_.clear();
  return out + "]";
}

const TensorRef& Trainer::output(const std::vector<TensorRef>& outs, const std::string& prog,
                                 const std::string& name) const {
  const ProgramSpec& spec = art_.program(prog);
  for (size_t i = 0; i < spec.outputs.size(); ++i)
    if (spec.outputs[i].name == name) return outs.at(i);
  throw RunnerError(art_.path(spec.pte) + ": no output " + name);
}

void Trainer::sample_memory() {
  peak_anon_ = std::max({peak_anon_, mem_info().rss_anon, anon_watch_peak()});
}

void Trainer::prepare(Programs& programs) {
  programs_ = &programs;
  embed_.open(art_.path("embedding.safetensors"));
  head_.open(art_.path("head.safetensors"));
  ctx_.open(art_.path("context.safetensors"));
  StFile init;
  init.open(art_.path(art_.lora_init));
  for (size_t i = 0; i < lora_.size(); ++i) {
    for (Lora& l : lora_[i]) {
      std::string name = kPeft + std::to_string(i) + "." + l.key + ".weight";
      const StEntry& e = init.header().tensors.at(name);
      if (e.dtype != dtype_name(l.p.dtype) || e.shape != l.p.shape)
        throw RunnerError(init.path() + ": tensor '" + name + "' changed since the check");
      Shape shape = l.p.shape;
      l.p = HostTensor(l.p.dtype, shape);
      std::memcpy(l.p.buf.data(), init.data(name), l.p.nbytes());
      if (opt_.optimizer == "adamw") {  // the moments start at zero
        l.m = HostTensor(l.p.dtype, shape);
        l.v = HostTensor(l.p.dtype, shape);
      }
      if (dp_) {  // DP-SGD's sum of clipped gradients (+ flat: one example's gradient)
        l.acc = HostTensor(l.p.dtype, shape);
        if (dp_->flat) l.ex = HostTensor(l.p.dtype, shape);
      }
    }
  }
  size_t most = 0;
  for (const auto& block : lora_) most = std::max(most, block.size());
  grads_.clear();
  for (size_t j = 0; j < most; ++j) grads_.emplace_back(DType::F32, Shape{max_lora_numel_});
  sample_memory();
}

std::optional<double> Trainer::step(const Batch& batch, int64_t k) {
  const int64_t n = static_cast<int64_t>(batch.rows.size());
  if (n == 0) return std::nullopt;
  const double loss = forward_loss(batch, k) / static_cast<double>(n);
  begin_update();
  backward([this](size_t i) { update_block(i); });
  return loss;
}

double Trainer::forward_loss(const Batch& batch, int64_t k) {
  const int64_t n = static_cast<int64_t>(batch.rows.size());
  std::memcpy(ids_.buf.data(), batch.ids.data(), ids_.nbytes());
  std::memcpy(rows_.buf.data(), batch.rows.data(), static_cast<size_t>(n) * sizeof(int64_t));
  std::memcpy(tgt_.buf.data(), batch.tgt.data(), static_cast<size_t>(n) * sizeof(int64_t));
  *f32(norm_) = static_cast<float>(n);
  const size_t L = art_.blocks.size();

  // Forward: only the block inputs are kept.
  auto outs = run("embed", -1, {{"ids", ref(ids_)}});
  copy_out(output(outs, "embed", "h"), checkpoints_.forward(0), "embed: h");
  for (size_t i = 0; i < L; ++i) {
    const std::string prog = art_.blocks[i].fn + ".forward";
    checkpoints_.keep(i);
    block_.open(art_.path(art_.blocks[i].file));
    outs = run(prog, static_cast<int>(i), {{"x", ref(checkpoints_.forward(i))}});
    block_.release();
    copy_out(output(outs, prog, "y"), i + 1 < L ? checkpoints_.forward(i + 1) : h_, prog + ": y");
  }

  // Loss: per-row losses (summed in double, as the engine does) and dL/dh into g_.
  const double sum = run_loss(n);
  if (!std::isfinite(sum))  // before any update: the adapter stays as it was
    throw RunnerError("non-finite loss at step " + std::to_string(k) +
                      "; no adapter written (lower --lr?)");
  return sum;
}

void Trainer::backward(const std::function<void(size_t)>& block_grads) {
  // Last block first: dy in g_, dx back into g_, the LoRA gradients into grads_.
  for (size_t i = art_.blocks.size(); i-- > 0;) {
    const std::string prog = art_.blocks[i].fn + ".backward";
    HostTensor& x = checkpoints_.backward(i);
    block_.open(art_.path(art_.blocks[i].file));
    auto outs = run(prog, static_cast<int>(i), {{"x", ref(x)}, {"dy", ref(g_)}});
    block_.release();
    copy_out(output(outs, prog, "dx"), g_, prog + ": dx");
    for (size_t j = 0; j < lora_[i].size(); ++j) {
      const Lora& l = lora_[i][j];
      const TensorRef& gr = output(outs, prog, "grad/" + l.key);
      if (gr.dtype != l.p.dtype || gr.shape != l.p.shape)
        throw RunnerError(prog + ": grad/" + l.key + " came back as " + shape_str(gr.shape));
      std::memcpy(grads_[j].buf.data(), gr.data, gr.nbytes());
    }
    block_grads(i);
  }
}

}  // namespace mesp
