// mesp::gated_act.out, gated_act_dgate.out, gated_act_dup.out (mesp/ops/gated_kernel.py): the
// MLP's gated activation and its backward in one pass each, as ExecuTorch kernels. Compiled with
// qmatmul.cpp into mesp-runner and into the Python driver's libmesp_kernels.so (mesp.ondevice.kernels),
// with -ffp-contract=off like it.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

struct pthreadpool;  // pthreadpool's opaque pool (C, global namespace)
namespace executorch::extension::threadpool {
::pthreadpool* get_pthreadpool();  // the pool the XNNPACK delegate runs on
}

extern "C" void pthreadpool_parallelize_1d(::pthreadpool* pool, void (*task)(void*, size_t),
                                           void* context, size_t range, uint32_t flags);

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

}  // namespace

// The MLP's gated activation and its gradients, one pass each over fp32 (..., F) tensors, so only
// the output is allocated where the written-out graph held a chain of (tokens × intermediate)
// temporaries. Value by value they are the engine's eager ops (mesp.ops.mlp): ATen's silu /
// silu_backward and gelu / gelu_backward (tanh) formulas in their order of operations, fed
// dm·up as the engine feeds them, with this file's no-FMA rule; only exp and tanh are libm's
// where ATen's vectorized ones are SLEEF's (both within an ulp). act 0: silu, 1: gelu_tanh.
namespace {

enum class Gate { kM, kDGate, kDUp };  // act(g)·up, act'(g)·(dm·up), act(g)·dm

struct Gated {
  const float *dm, *gate, *up;
  float* out;
  int64_t act, n;
  Gate which;
};

constexpr size_t kChunk = 4096;  // values per task of the thread pool
constexpr float kBeta = 0.7978845608028654f;  // √2 · (2/√π) · ½, as ATen's gelu
constexpr float kKappa = 0.044715f;

float act_of(int64_t act, float x) {  // ATen's silu / gelu(approximate='tanh')
  if (act == 0) return x / (1.0f + std::exp(-x));
  const float x_cube = x * x * x;
  const float inner = kBeta * (x + kKappa * x_cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

float act_backward(int64_t act, float dy, float x) {  // ATen's silu_backward / gelu_backward
  if (act == 0) {
    const float sigmoid = 1.0f / (1.0f + std::exp(-x));
    return dy * sigmoid * (1.0f + x * (1.0f - sigmoid));
  }
  const float x_sq = x * x;
  const float x_cube = x_sq * x;
  const float tanh_inner = std::tanh(kBeta * (x + kKappa * x_cube));
  const float left = 0.5f * x;
  const float right = 1.0f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float tanh_derivative = 1.0f - tanh_inner * tanh_inner;
  const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * x_sq);
  const float right_derivative = left * tanh_derivative * inner_derivative;
  return dy * (left_derivative + right_derivative);
}

void gated_chunk(void* ctx, size_t i) {
  const auto* c = static_cast<const Gated*>(ctx);
  const int64_t lo = int64_t(i * kChunk), hi = std::min<int64_t>(c->n, lo + int64_t(kChunk));
  for (int64_t j = lo; j < hi; ++j) {
    const float g = c->gate[j];
    switch (c->which) {
      case Gate::kM: c->out[j] = act_of(c->act, g) * c->up[j]; break;
      case Gate::kDGate: c->out[j] = act_backward(c->act, c->dm[j] * c->up[j], g); break;
      case Gate::kDUp: c->out[j] = act_of(c->act, g) * c->dm[j]; break;
    }
  }
}

// dm or up may be absent (nullptr) where `which` does not read it
Tensor& gated(KernelRuntimeContext& ctx, const Tensor* dm, const Tensor& gate, const Tensor* up,
              int64_t act, Gate which, Tensor& out) {
  auto same = [&](const Tensor* t) {
    return t == nullptr || (t->scalar_type() == ScalarType::Float && t->numel() == gate.numel());
  };
  const bool ok = gate.scalar_type() == ScalarType::Float && same(dm) && same(up) &&
                  out.scalar_type() == ScalarType::Float && (act == 0 || act == 1) &&
                  executorch::runtime::resize_tensor(out, gate.sizes()) == Error::Ok;
  if (!ok) {
    ET_LOG(Error, "mesp::gated_act: bad shapes or dtypes");
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  Gated c{dm ? dm->const_data_ptr<float>() : nullptr, gate.const_data_ptr<float>(),
          up ? up->const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(), act,
          int64_t(gate.numel()), which};
  auto* pool = executorch::extension::threadpool::get_pthreadpool();
  pthreadpool_parallelize_1d(pool, gated_chunk, &c, (size_t(c.n) + kChunk - 1) / kChunk, 0);
  return out;
}

}  // namespace

namespace mesp_kernels {

Tensor& gated_act_out(KernelRuntimeContext& ctx, const Tensor& gate, const Tensor& up,
                      int64_t act, Tensor& out) {
  return gated(ctx, nullptr, gate, &up, act, Gate::kM, out);
}

Tensor& gated_act_dgate_out(KernelRuntimeContext& ctx, const Tensor& dm, const Tensor& gate,
                            const Tensor& up, int64_t act, Tensor& out) {
  return gated(ctx, &dm, gate, &up, act, Gate::kDGate, out);
}

Tensor& gated_act_dup_out(KernelRuntimeContext& ctx, const Tensor& dm, const Tensor& gate,
                          int64_t act, Tensor& out) {
  return gated(ctx, &dm, gate, nullptr, act, Gate::kDUp, out);
}

}  // namespace mesp_kernels

EXECUTORCH_LIBRARY(mesp, "gated_act.out", mesp_kernels::gated_act_out);
EXECUTORCH_LIBRARY(mesp, "gated_act_dgate.out", mesp_kernels::gated_act_dgate_out);
EXECUTORCH_LIBRARY(mesp, "gated_act_dup.out", mesp_kernels::gated_act_dup_out);
