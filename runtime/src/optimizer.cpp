// Trainer::begin_update / update_block: a block's LoRA tensors, flattened, through the sgd or
// adamw program.
// The scalars are computed in double on the host, as torch.optim does, then cast to f32.
#include <cmath>
#include <map>

#include "train.h"
#include "train_util.h"

namespace mesp {

using namespace train_util;

void Trainer::begin_update() {
  const double lr = opt_.lr, wd = opt_.weight_decay;
  const int64_t t = ++opt_steps_;
  opt_named_.clear();
  auto scalar = [&](int slot, const char* name, double v) {
    *f32(scalars_[slot]) = static_cast<float>(v);  // computed in double, then cast
    opt_named_[name] = ref(scalars_[slot]);
  };
  if (opt_.optimizer == "adamw") {
    scalar(0, "decay", 1.0 - lr * wd);
    scalar(1, "one_minus_beta1", 1.0 - 0.9);
    scalar(2, "beta2", 0.999);
    scalar(3, "one_minus_beta2", 1.0 - 0.999);
    scalar(4, "step_size", lr / (1.0 - std::pow(0.9, static_cast<double>(t))));
    scalar(5, "bc2_sqrt", std::sqrt(1.0 - std::pow(0.999, static_cast<double>(t))));
    scalar(6, "eps", 1e-8);
  } else {
    scalar(0, "lr", lr);
    scalar(1, "weight_decay", wd);
  }
}

void Trainer::update_block(size_t i) {
  const bool adamw = opt_.optimizer == "adamw";
  const std::string prog = adamw ? "adamw" : "sgd";
  std::map<std::string, TensorRef> named = opt_named_;
  for (size_t j = 0; j < lora_[i].size(); ++j) {
    Lora& l = lora_[i][j];
    const Shape flat = {l.p.numel()};
    named["p"] = TensorRef{l.p.dtype, flat, l.p.buf.data()};
    named["g"] = TensorRef{l.p.dtype, flat, grads_[j].buf.data()};
    if (adamw) {
      named["m"] = TensorRef{l.m.dtype, flat, l.m.buf.data()};
      named["v"] = TensorRef{l.v.dtype, flat, l.v.buf.data()};
    }
    auto outs = run(prog, -1, named);
    copy_out(output(outs, prog, "p"), l.p, prog + ": p");
    if (adamw) {
      copy_out(output(outs, prog, "m"), l.m, prog + ": m");
      copy_out(output(outs, prog, "v"), l.v, prog + ": v");
    }
  }
}

}  // namespace mesp
