// mesp::qlinear.out and mesp::qmatmul.out: the products of a block with a packed 4-, 5-, 6- or
// 8-bit frozen matrix, as ExecuTorch kernels (the ops mesp/ops/qmatmul.py defines for the export);
// gated_act.cpp beside it holds the MLP's gated activation kernels.
//
//   qlinear  y (M, N) = x (M, K) Wᵀ     W (N, K) dequantized a block of rows at a time
//   qmatmul  dx (M, K) = dy (M, N) W    W dequantized a block of columns at a time
//   qlinear_add / qmatmul_add: the same with a LoRA term added block by block (y += s·h Bᵀ,
//   dx += gh A), so a LoRA linear's output is the only (M, N) tensor its product makes
//
// W is stored as mesp.quant.packed_bytes: bytes (N, K·bits/8), each row a little-endian bit
// stream with value c at bits bits·c .. bits·c + bits − 1 (4 bits: byte c/2, low nibble first;
// 8 bits: byte c; 5 and 6 bits: a value may straddle two bytes); scales and biases (N, K/g) fp32;
// w = q·scale + bias, rounded twice as mesp.quant.dequantize_core_aten does (packed_rows.h; this
// file is compiled with -ffp-contract=off, so no fused multiply-add merges the two). The blocks
// are shared out among the threads of ExecuTorch's pool: each thread dequantizes a block, packs
// it (XNNPACK's fully-connected operator) and runs the GEMM on its own, so the block never leaves
// its core's cache and the pool meets once per product. A product holds, per thread, one block
// of fp32 values and XNNPACK's packing of it (at most 2 × 640 KiB), where a graph that
// dequantizes W whole holds all of W in fp32 in its arena and again packed in the XNNPACK
// workspace. The cut keeps every dot product whole (rows of W for x Wᵀ, columns for dy W), so the
// sums are XNNPACK's own, as in the delegated linears of the graphs.
//
// Linked into mesp-runner, and built as libmesp_kernels.so for the Python driver (loaded before
// the programs: its static initializer registers the kernels in the shared libexecutorch.so).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "packed_rows.h"

struct pthreadpool;  // pthreadpool's opaque pool (C, global namespace)
namespace executorch::extension::threadpool {
::pthreadpool* get_pthreadpool();  // the pool the XNNPACK delegate runs on
}

// XNNPACK's operator API as libexecutorch_backend_xnnpack.so exports it (the wheel ships no
// xnnpack.h); the status enum is returned as int (0: success).
extern "C" {
typedef struct xnn_operator* xnn_operator_t;
int xnn_initialize(const void* allocator);
int xnn_create_fully_connected_nc_f32(size_t input_channels, size_t output_channels,
                                      size_t input_stride, size_t output_stride,
                                      const float* kernel, const float* bias, float output_min,
                                      float output_max, uint32_t flags, void* weights_cache,
                                      xnn_operator_t* op_out);
int xnn_reshape_fully_connected_nc_f32(xnn_operator_t op, size_t batch_size, ::pthreadpool* pool);
int xnn_setup_fully_connected_nc_f32(xnn_operator_t op, const float* input, float* output);
int xnn_run_operator(xnn_operator_t op, ::pthreadpool* pool);
int xnn_delete_operator(xnn_operator_t op);
size_t pthreadpool_get_threads_count(::pthreadpool* pool);
void pthreadpool_parallelize_1d_with_thread(::pthreadpool* pool,
                                            void (*task)(void*, size_t thread, size_t i),
                                            void* context, size_t range, uint32_t flags);
}

namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

// fp32 bytes of W per block, at most (a block is 16 rows or columns at least). Each thread
// holds one block and XNNPACK's packing of it, so both stay in its core's L2 from the fill to the
// GEMM. Rows (x Wᵀ) take 256 KiB. Columns (dy W) take up to 640 KiB: each column block reads all
// of dy again, so wider blocks read it fewer times (32 columns of a 4864-row W: 608 KiB).
// Measured on the real Qwen2.5-Coder-0.5B step (AMD EPYC Zen 4, 2 threads, fastest of 3 steps):
// rows of 256 KiB were 2-6% faster than 128 or 640 KiB; a 256 KiB cap on columns (16-column
// blocks for the MLP's dy W) was about 7% slower; 1100 KiB columns were no faster and held 2 MB
// more.
constexpr size_t kRowBlockBytes = size_t(256) << 10;
constexpr size_t kColumnBlockBytes = size_t(640) << 10;
constexpr uint32_t kTransposeWeights = 1;         // XNN_FLAG_TRANSPOSE_WEIGHTS: kernel (in, out)

using mesp_packed::Packed;  // W (N, K) as stored, and its dequantizer (packed_rows.h)

// XNNPACK's kernels may read up to XNN_EXTRA_BYTES (16) past the last input value they use
// (xnnpack.h: "the input ... must have XNN_EXTRA_BYTES of readable memory past the end"). The
// inputs here are ExecuTorch tensors, which promise no such slack: a tensor may end where its
// arena, or a mapping, does. So every row but the last is read in place (a row's over-read
// lands in the row after it) and the last from `spare`, a copy with the slack (same values,
// same operator, same sums).
constexpr size_t kExtraBytes = 16;

struct Spare {  // the input's last row (m rows of `floats`), copied once, with the slack after it
  std::unique_ptr<float, decltype(&std::free)> row{nullptr, &std::free};
  Spare(const float* in, size_t m, size_t floats)
      : row(static_cast<float*>(std::aligned_alloc(64, (4 * floats + kExtraBytes + 63) / 64 * 64)),
            &std::free) {
    if (m > 0) std::memcpy(row.get(), in + (m - 1) * floats, 4 * floats);
  }
};

// out[:, 0:out_ch] (row stride out_stride) = in (M, in_ch) · kernel, the last row of in read
// from `spare` (the same values: every block of W reads the same rows); on the calling thread
// alone (each thread of the pool runs its own blocks)
bool fully_connected(const float* in, size_t m, size_t in_ch, const float* kernel, size_t out_ch,
                     uint32_t flags, float* out, size_t out_stride, const Spare& spare) {
  ::pthreadpool* const pool = nullptr;
  xnn_operator_t op = nullptr;
  const float inf = std::numeric_limits<float>::infinity();
  if (xnn_create_fully_connected_nc_f32(in_ch, out_ch, in_ch, out_stride, kernel, nullptr, -inf,
                                        inf, flags, nullptr, &op) != 0)
    return false;
  bool ok = m < 2 || (xnn_reshape_fully_connected_nc_f32(op, m - 1, pool) == 0 &&
                      xnn_setup_fully_connected_nc_f32(op, in, out) == 0 &&
                      xnn_run_operator(op, pool) == 0);
  if (ok && m > 0) {
    float* last = out + (m - 1) * out_stride;
    ok = xnn_reshape_fully_connected_nc_f32(op, 1, pool) == 0 &&
         xnn_setup_fully_connected_nc_f32(op, spare.row.get(), last) == 0 &&
         xnn_run_operator(op, pool) == 0;
  }
  xnn_delete_operator(op);
  return ok;
}

// linear: a is x (..., K) and out y (..., N); else a is dy (..., N) and out dx (..., K)
bool checked(KernelRuntimeContext& ctx, bool linear, const Tensor& a, const Tensor& wq,
             const Tensor& sc, const Tensor& bi, int64_t bits, int64_t group, Tensor& out,
             Packed* w) {
  const char* name = linear ? "linear" : "matmul";
  bool ok = a.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float &&
            wq.scalar_type() == ScalarType::Byte && sc.scalar_type() == ScalarType::Float &&
            bi.scalar_type() == ScalarType::Float && wq.dim() == 2 && sc.dim() == 2 &&
            bi.dim() == 2 && (bits == 4 || bits == 5 || bits == 6 || bits == 8) && group > 0 &&
            group % 8 == 0 && a.dim() >= 1 && wq.size(1) * 8 % bits == 0;
  if (ok) {
    const int64_t n = wq.size(0), k = wq.size(1) * 8 / bits;
    *w = {wq.const_data_ptr<uint8_t>(), sc.const_data_ptr<float>(), bi.const_data_ptr<float>(),
          n, k, bits, group, wq.size(1), k / group};
    ok = k % group == 0 && group % 2 == 0 && sc.size(0) == n && bi.size(0) == n &&
         sc.size(1) == k / group && bi.size(1) == k / group &&
         a.size(a.dim() - 1) == (linear ? k : n);
  }
  if (!ok) {
    ET_LOG(Error, "mesp::q%s: bad shapes or dtypes", name);
    ctx.fail(Error::InvalidArgument);
    return false;
  }
  // out: a's shape with the last dim replaced
  SizesType sizes[16];
  const size_t nd = std::min<size_t>(a.dim(), 16);
  for (size_t d = 0; d < nd; ++d) sizes[d] = SizesType(a.size(d));
  sizes[nd - 1] = SizesType(linear ? w->n : w->k);
  if (executorch::runtime::resize_tensor(out, {sizes, nd}) != Error::Ok) {
    ET_LOG(Error, "mesp::q%s: cannot resize the output", name);
    ctx.fail(Error::InvalidArgument);
    return false;
  }
  return true;
}

// a block of W, with XNNPACK's slack after it (the packing reads within the block; the slack
// is for any kernel that reads its weights in place)
void* block_buffer(size_t bytes) {
  return std::aligned_alloc(64, (bytes + kExtraBytes + 63) / 64 * 64);
}

}  // namespace

namespace {

// The LoRA term a product may add to its output: out += alpha · (a bᵀ) for qlinear, with b laid
// out like W (N, r), or out += alpha · (a b) for qmatmul, with b (r, K) like W's columns. a is
// (M, r) (the leading dims of x or dy). For each block of W's output columns the term's own block
// is formed by XNNPACK's fully-connected operator into `part` (M × cols) and added value by value,
// scaled first where alpha != 1: the mm, mul and add the lowering writes an addmm as, in the
// same order, on a block of the output instead of a whole (M, N) product and its scaled copy.
struct Addend {
  const float* a = nullptr;  // (M, r)
  const float* b = nullptr;  // qlinear (N, r), qmatmul (r, K)
  int64_t r = 0, b_cols = 0;  // b_cols: b's row length (r for qlinear, K for qmatmul)
  float alpha = 1.0f;
};

using Buffer = std::unique_ptr<float, decltype(&std::free)>;

Buffer buffer(size_t floats) {
  return Buffer(static_cast<float*>(block_buffer(4 * std::max<size_t>(floats, 1))), &std::free);
}

// out columns c0:c0+cols of every row (row stride ys) += the addend's block for those columns;
// kbuf holds the addend's matrix block (with slack), part the block of the product
bool add_block(const Addend& ad, bool linear, size_t m, int64_t c0, int64_t cols, float* y,
               size_t ys, float* kbuf, float* part, const Spare& spare) {
  if (linear) {  // b rows c0:c0+cols, (cols, r): the operator's (out, in) kernel
    std::memcpy(kbuf, ad.b + c0 * ad.r, 4 * size_t(cols * ad.r));
  } else {  // b columns c0:c0+cols, (r, cols): an (in, out) kernel
    for (int64_t i = 0; i < ad.r; ++i)
      std::memcpy(kbuf + i * cols, ad.b + i * ad.b_cols + c0, 4 * size_t(cols));
  }
  if (!fully_connected(ad.a, m, size_t(ad.r), kbuf, size_t(cols), linear ? 0 : kTransposeWeights,
                       part, size_t(cols), spare))
    return false;
  // alpha · p is exact at alpha = 1 (no FMA in this file), so one loop is the lowering's add
  // (alpha = 1) and its mul then add (alpha != 1) alike
  for (size_t i = 0; i < m; ++i) {
    float* yi = y + i * ys + c0;
    const float* p = part + i * size_t(cols);
    for (int64_t j = 0; j < cols; ++j) yi[j] = yi[j] + ad.alpha * p[j];
  }
  return true;
}

// the addend's tensors against the product's: a (..., r) with M rows, b as Addend says
bool addend_of(KernelRuntimeContext& ctx, bool linear, const Packed& w, size_t m,
               const Tensor& a, const Tensor& b, double alpha, Addend* ad) {
  const int64_t r = a.dim() >= 1 ? a.size(a.dim() - 1) : 0;
  const bool ok = a.scalar_type() == ScalarType::Float && b.scalar_type() == ScalarType::Float &&
                  r > 0 && size_t(a.numel()) == m * size_t(r) && b.dim() == 2 &&
                  (linear ? b.size(0) == w.n && b.size(1) == r
                          : b.size(0) == r && b.size(1) == w.k);
  if (!ok) {
    ET_LOG(Error, "mesp::q%s_add: the added term's shapes or dtypes do not fit",
           linear ? "linear" : "matmul");
    ctx.fail(Error::InvalidArgument);
    return false;
  }
  *ad = {a.const_data_ptr<float>(), b.const_data_ptr<float>(), r, b.size(1), float(alpha)};
  return true;
}

// One product, cut into blocks of W: whole rows (linear: y's columns) or columns of every row
// (matmul: dx's columns). Each block is dequantized, packed (XNNPACK's create) and multiplied by
// one thread of the pool, on that thread alone, so its values stay in that core's cache from the
// fill to the GEMM, and the pool meets once per product, not three times per block.
struct Scratch {  // one thread's buffers: the block of W, the addend's block and its product
  Buffer buf{nullptr, &std::free}, kbuf{nullptr, &std::free}, part{nullptr, &std::free};
};

struct Job {
  const Packed* w;
  bool linear;
  const float* in;  // x (m, K) or dy (m, N)
  size_t m;
  float* out;  // y (m, N) or dx (m, K)
  const Spare* spare;
  const Addend* ad;  // the LoRA term, or nullptr
  const Spare* spare_a;
  int64_t step, len;  // a block's rows or columns, and all of them
  Scratch* scratch;   // one per thread
  std::atomic<bool> failed{false};
};

void block_task(void* ctx, size_t thread, size_t i) {
  auto& j = *static_cast<Job*>(ctx);
  if (j.failed.load(std::memory_order_relaxed)) return;
  const Packed& w = *j.w;
  Scratch& s = j.scratch[thread];
  if (!s.buf) {
    s.buf = buffer(size_t(j.step * (j.linear ? w.k : w.n)));
    if (j.ad) s.kbuf = buffer(size_t(j.step * j.ad->r)), s.part = buffer(j.m * size_t(j.step));
  }
  if (!s.buf || (j.ad && (!s.kbuf || !s.part))) {  // out of memory
    j.failed.store(true);
    return;
  }
  const int64_t b0 = int64_t(i) * j.step, len = std::min(j.step, j.len - b0);
  float* buf = s.buf.get();
  w.block(j.linear, b0, len, buf);  // linear: (len, K), W[b0:b0+len, :]; else (N, len)
  const size_t in_ch = size_t(j.linear ? w.k : w.n), ys = size_t(j.linear ? w.n : w.k);
  const bool ok =
      fully_connected(j.in, j.m, in_ch, buf, size_t(len), j.linear ? 0 : kTransposeWeights,
                      j.out + b0, ys, *j.spare) &&
      (j.ad == nullptr || add_block(*j.ad, j.linear, j.m, b0, len, j.out, ys, s.kbuf.get(),
                                    s.part.get(), *j.spare_a));
  if (!ok) j.failed.store(true);
}

bool product(const Packed& w, bool linear, const float* in, size_t m, float* out,
             const Addend* ad) {
  xnn_initialize(nullptr);
  auto* pool = executorch::extension::threadpool::get_pthreadpool();
  const int64_t threads = std::max<int64_t>(1, int64_t(pthreadpool_get_threads_count(pool)));
  const int64_t len = linear ? w.n : w.k, width = linear ? w.k : w.n;
  // rows or columns in sixteens (XNNPACK's widest tile; columns in eights at least, the
  // dequantizer's unit) where there are that many
  const int64_t unit = len >= 16 ? 16 : linear ? 1 : 8;
  const size_t cap = linear ? kRowBlockBytes : kColumnBlockBytes;
  int64_t step = std::max<int64_t>(1, int64_t(cap / (4 * size_t(width))) / unit) * unit;
  const int64_t share = ((len + threads - 1) / threads + unit - 1) / unit * unit;
  step = std::min(step, share);  // a block for every thread at least, where there are that many
  std::vector<Scratch> scratch(static_cast<size_t>(threads));
  const Spare spare(in, m, size_t(width));
  const Spare spare_a(ad ? ad->a : nullptr, ad ? m : 0, size_t(ad ? ad->r : 0));
  Job j{&w, linear, in, m, out, &spare, ad, &spare_a, step, len, scratch.data()};
  const size_t blocks = size_t((len + step - 1) / step);
  if (m > 0) pthreadpool_parallelize_1d_with_thread(pool, block_task, &j, blocks, 0);
  return !j.failed.load();
}

// y (..., N) = x (..., K) Wᵀ [+ alpha · a Bᵀ], or dx (..., K) = dy (..., N) W [+ alpha · a A]
Tensor& product_impl(KernelRuntimeContext& ctx, bool linear, const Tensor& in, const Tensor& wq,
                     const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                     const Tensor* a, const Tensor* b, double alpha, Tensor& out) {
  Packed w{};
  if (!checked(ctx, linear, in, wq, scales, biases, bits, group, out, &w)) return out;
  const size_t m = size_t(in.numel() / (linear ? w.k : w.n));
  Addend ad{};
  if (a != nullptr && !addend_of(ctx, linear, w, m, *a, *b, alpha, &ad)) return out;
  if (!product(w, linear, in.const_data_ptr<float>(), m, out.mutable_data_ptr<float>(),
               a ? &ad : nullptr)) {
    ET_LOG(Error, "mesp::q%s: XNNPACK's fully-connected operator failed (or out of memory)",
           linear ? "linear" : "matmul");
    ctx.fail(Error::Internal);
  }
  return out;
}

}  // namespace

namespace mesp_kernels {

Tensor& qlinear_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    Tensor& out) {
  return product_impl(ctx, true, x, wq, scales, biases, bits, group, nullptr, nullptr, 1.0, out);
}

Tensor& qmatmul_out(KernelRuntimeContext& ctx, const Tensor& dy, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    Tensor& out) {
  return product_impl(ctx, false, dy, wq, scales, biases, bits, group, nullptr, nullptr, 1.0, out);
}

Tensor& qlinear_add_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& wq,
                        const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                        const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  return product_impl(ctx, true, x, wq, scales, biases, bits, group, &a, &b, alpha, out);
}

Tensor& qmatmul_add_out(KernelRuntimeContext& ctx, const Tensor& dy, const Tensor& wq,
                        const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                        const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  return product_impl(ctx, false, dy, wq, scales, biases, bits, group, &a, &b, alpha, out);
}

}  // namespace mesp_kernels

// The product on raw buffers, exactly as the kernels run each block of W: for the guard-page
// test of the slack (tests/test_qmatmul_kernel.py). out (m, n) = in (m, k) · kernel (n, k)ᵀ.
extern "C" int mesp_fully_connected_f32(const float* in, size_t m, size_t k, const float* kernel,
                                        size_t n, float* out) {
  xnn_initialize(nullptr);
  const Spare spare(in, m, k);
  return fully_connected(in, m, k, kernel, n, 0, out, n, spare) ? 0 : 1;
}

// One block of W's values, in the scalar form (vector 0) or the AVX2 form (vector 1), as the
// kernels dequantize it (packed_rows.h): for the test that both give dequantize's bits. Returns
// 1 where this build or CPU has no AVX2 form.
extern "C" int mesp_dequantize_block(const uint8_t* q, const float* s, const float* b, int64_t n,
                                     int64_t k, int64_t bits, int64_t group, int linear,
                                     int64_t b0, int64_t len, int vector, float* out) {
  const Packed w{q, s, b, n, k, bits, group, k * bits / 8, k / group};
  if (!vector) {
    w.block_scalar(linear != 0, b0, len, out);
    return 0;
  }
#ifdef MESP_PACKED_AVX2
  if (Packed::has_avx2()) {
    w.block_avx2(linear != 0, b0, len, out);
    return 0;
  }
#endif
  return 1;
}

EXECUTORCH_LIBRARY(mesp, "qlinear.out", mesp_kernels::qlinear_out);
EXECUTORCH_LIBRARY(mesp, "qmatmul.out", mesp_kernels::qmatmul_out);
EXECUTORCH_LIBRARY(mesp, "qlinear_add.out", mesp_kernels::qlinear_add_out);
EXECUTORCH_LIBRARY(mesp, "qmatmul_add.out", mesp_kernels::qmatmul_add_out);
