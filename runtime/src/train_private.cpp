// Trainer's DP-SGD step (private.h says what a step is). The fused per-block update of step()
// cannot stay: every sampled row's forward must see the adapter as the step began, so the
// clipped gradients are summed over the sample (acc: one adapter's worth of f32; flat adds
// one more for the row in flight, ex) and the update runs once, block by block, at the end.
#include <cmath>
#include <cstring>
#include <map>

#include "train.h"
#include "train_util.h"

namespace mesp {

using namespace train_util;

namespace {
// "self_attn.q_proj.lora_A" -> "self_attn.q_proj": the linear an A or B belongs to.
std::string linear_of(const std::string& key) {
  return key.substr(0, key.rfind(".lora_"));
}

// acc += scale * g, elementwise in f32 (the engine's einsum over the examples).
void add_scaled(HostTensor& acc, const float* g, float scale) {
  float* a = f32(acc);
  for (int64_t k = 0, n = acc.numel(); k < n; ++k) a[k] += scale * g[k];
}

double sq_norm(const float* g, int64_t n) {
  double s = 0;
  for (int64_t k = 0; k < n; ++k) s += static_cast<double>(g[k]) * g[k];
  return s;
}

// min(1, bound / norm) in double, then f32 (mesp/engines/clipping.py's _scale).
float clip_scale(double sq, double bound) {
  const double norm = std::sqrt(sq);
  return static_cast<float>(norm > bound ? bound / norm : 1.0);
}
}  // namespace

void Trainer::enable_dp(const DpPlan& plan) {
  dp_ = plan;
  dp_linears_ = 0;
  for (const auto& block : lora_) {
    std::map<std::string, int> seen;
    for (const Lora& l : block) seen[linear_of(l.key)] += 1;
    dp_linears_ += seen.size();
  }
}

std::optional<double> Trainer::step_private(const std::vector<Row>& rows, int64_t k,
                                            int64_t& sampled) {
  const DpStream pick(dp_->seed, k, 0);
  double loss_sum = 0;
  int64_t used = 0;
  sampled = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!(pick.uniform(r) < dp_->q)) continue;
    ++sampled;
    const Batch b = example_batch(rows[r], art_.batch_size, art_.seq_len);
    const int64_t n = static_cast<int64_t>(b.rows.size());
    if (n == 0) continue;  // no trained token: a zero gradient
    loss_sum += forward_loss(b, k) / static_cast<double>(n);
    ++used;
    backward([this](size_t i) { dp_take_block(i); });
    if (dp_->flat) dp_flat_done();
  }
  dp_update(k);
  if (used == 0) return std::nullopt;
  return loss_sum / static_cast<double>(used);
}

void Trainer::dp_take_block(size_t i) {
  std::vector<Lora>& block = lora_[i];
  if (dp_->flat) {
    for (size_t j = 0; j < block.size(); ++j)
      std::memcpy(block[j].ex.buf.data(), grads_[j].buf.data(), block[j].ex.nbytes());
    return;
  }
  const double bound = dp_->clip / std::sqrt(static_cast<double>(dp_linears_));
  std::map<std::string, double> sq;  // per linear: ||gA||^2 + ||gB||^2
  for (size_t j = 0; j < block.size(); ++j)
    sq[linear_of(block[j].key)] += sq_norm(f32(grads_[j]), block[j].p.numel());
  for (size_t j = 0; j < block.size(); ++j)
    add_scaled(block[j].acc, f32(grads_[j]), clip_scale(sq[linear_of(block[j].key)], bound));
}

void Trainer::dp_flat_done() {
  double sq = 0;
  for (auto& block : lora_)
    for (Lora& l : block) sq += sq_norm(f32(l.ex), l.ex.numel());
  const float scale = clip_scale(sq, dp_->clip);
  for (auto& block : lora_)
    for (Lora& l : block) add_scaled(l.acc, f32(l.ex), scale);
}

void Trainer::dp_update(int64_t k) {
  begin_update();
  const double std_dev = dp_->sigma * dp_->clip;
  const float e = static_cast<float>(dp_->expected);
  uint64_t t = 0;  // the tensor's index over the whole adapter: its noise stream
  for (size_t i = 0; i < lora_.size(); ++i) {
    for (size_t j = 0; j < lora_[i].size(); ++j, ++t) {
      Lora& l = lora_[i][j];
      const DpStream noise(dp_->seed, k, 1 + t);
      float* acc = f32(l.acc);
      float* g = f32(grads_[j]);
      for (int64_t x = 0, n = l.acc.numel(); x < n; ++x) {
        const float z = std_dev == 0 ? 0.0f
                                     : static_cast<float>(std_dev * noise.normal(static_cast<uint64_t>(x)));
        g[x] = (acc[x] + z) / e;
        acc[x] = 0;
      }
    }
    update_block(i);
  }
}

}  // namespace mesp
