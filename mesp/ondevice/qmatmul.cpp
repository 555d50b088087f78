// mesp::qlinear.out and mesp::qmatmul.out: the products of a block with a packed 4-, 5-, 6- or
// 8-bit frozen matrix, as ExecuTorch kernels (the ops mesp/ops/qmatmul.py defines for the export);
// gated_act.cpp beside it holds the MLP's gated activation kernels.
//
//   qlinear  y (M, N) = x (M, K) Wᵀ     W (N, K) dequantized a block of rows at a time
//   qmatmul  dx (M, K) = dy (M, N) W    W dequantized a block of whole groups of columns at a time
//   qlinear_add / qmatmul_add: the same with a LoRA term added block by block (y += s·h Bᵀ,
//   dx += gh A), so a LoRA linear's output is the only (M, N) tensor its product makes
//
// W is stored as mesp.quant.packed_bytes: bytes (N, K·bits/8), each row a little-endian bit
// stream with value c at bits bits·c .. bits·c + bits − 1 (4 bits: byte c/2, low nibble first;
// 8 bits: byte c; 5 and 6 bits: a value may straddle two bytes); scales and biases (N, K/g) fp32;
// w = q·scale + bias, rounded twice as mesp.quant.dequantize_core_aten does (this file is
// compiled with -ffp-contract=off, so no fused multiply-add merges the two). Each block goes
// through XNNPACK's fp32 fully-connected operator on ExecuTorch's thread pool. So a product
// holds one block of fp32 values and XNNPACK's packing of it (about 2 × kBlockBytes), where a
// graph that dequantizes W whole holds all of W in fp32 in its arena and again packed in the
// XNNPACK workspace. The cut keeps every dot product whole (rows of W for x Wᵀ, columns for
// dy W), so the sums are XNNPACK's own, as in the delegated linears of the graphs.
//
// Linked into mesp-runner, and built as libmesp_kernels.so for the Python driver (loaded before
// the programs: its static initializer registers the kernels in the shared libexecutorch.so).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

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
void pthreadpool_parallelize_1d(::pthreadpool* pool, void (*task)(void*, size_t), void* context,
                                size_t range, uint32_t flags);
}

namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

constexpr size_t kBlockBytes = size_t(1) << 20;  // fp32 bytes of W per block
constexpr uint32_t kTransposeWeights = 1;         // XNN_FLAG_TRANSPOSE_WEIGHTS: kernel (in, out)

// W (N, K) as stored, and the shape checks every product needs.
struct Packed {
  const uint8_t* q;
  const float* s;
  const float* b;
  int64_t n, k, bits, group, row_bytes, groups;

  // values c0:c1 of row r (c0, c1 on group boundaries) into out
  void row(int64_t r, int64_t c0, int64_t c1, float* out) const {
    switch (bits) {
      case 4: return row_of<4>(r, c0, c1, out);
      case 5: return row_of<5>(r, c0, c1, out);
      case 6: return row_of<6>(r, c0, c1, out);
      default: return row_of<8>(r, c0, c1, out);
    }
  }

  // Eight values at once: they fill exactly B bytes from a byte boundary (a group is a multiple
  // of 8 values and starts on one), read as one little-endian integer, B bits a value.
  template <int B>
  void row_of(int64_t r, int64_t c0, int64_t c1, float* out) const {
    const uint8_t* qr = q + r * row_bytes;
    const float* sr = s + r * groups;
    const float* br = b + r * groups;
    for (int64_t g0 = c0; g0 < c1; g0 += group) {
      const float sc = sr[g0 / group], bi = br[g0 / group];
      const uint8_t* p = qr + g0 * B / 8;
      for (int64_t c = 0; c < group; c += 8, p += B, out += 8) {
        uint64_t word = 0;
        for (int j = 0; j < B; ++j) word |= uint64_t(p[j]) << (8 * j);
        for (int j = 0; j < 8; ++j) {
          const float t = float(uint32_t(word >> (B * j)) & ((1u << B) - 1u)) * sc;
          out[j] = t + bi;  // two roundings, as w = q·scale + bias everywhere (no FMA)
        }
      }
    }
  }
};

struct Fill {  // one block: rows r0:r0+rows (all columns), or all rows and columns c0:c1
  const Packed* w;
  float* buf;
  int64_t r0, c0, c1;
};

void fill_rows(void* ctx, size_t i) {  // buf (rows, K): W[r0 + i, :]
  auto* f = static_cast<Fill*>(ctx);
  f->w->row(f->r0 + int64_t(i), 0, f->w->k, f->buf + int64_t(i) * f->w->k);
}

void fill_cols(void* ctx, size_t i) {  // buf (N, c1 - c0): W[i, c0:c1]
  auto* f = static_cast<Fill*>(ctx);
  f->w->row(int64_t(i), f->c0, f->c1, f->buf + int64_t(i) * (f->c1 - f->c0));
}

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

// out[:, 0:out_ch] (row stride out_stride) = in (M, in_ch; row stride in_stride) · kernel, the
// last row of in read from `spare` (the same values: every block of W reads the same rows)
bool fully_connected(const float* in, size_t m, size_t in_ch, size_t in_stride,
                     const float* kernel, size_t out_ch, uint32_t flags, float* out,
                     size_t out_stride, ::pthreadpool* pool, const Spare& spare) {
  xnn_operator_t op = nullptr;
  const float inf = std::numeric_limits<float>::infinity();
  if (xnn_create_fully_connected_nc_f32(in_ch, out_ch, in_stride, out_stride, kernel, nullptr,
                                        -inf, inf, flags, nullptr, &op) != 0)
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

struct AddPart {  // y[i, 0:cols] (row stride ys) += alpha · part[i, 0:cols]
  float* y;
  const float* part;
  size_t ys, cols;
  float alpha;
};

void add_part_row(void* ctx, size_t i) {
  const auto* c = static_cast<const AddPart*>(ctx);
  float* y = c->y + i * c->ys;
  const float* p = c->part + i * c->cols;
  // alpha · p is exact at alpha = 1 (no FMA in this file), so one loop is the lowering's
  // add (alpha = 1) and its mul then add (alpha != 1) alike
  for (size_t j = 0; j < c->cols; ++j) y[j] = y[j] + c->alpha * p[j];
}

using Buffer = std::unique_ptr<float, decltype(&std::free)>;

Buffer buffer(size_t floats) {
  return Buffer(static_cast<float*>(block_buffer(4 * std::max<size_t>(floats, 1))), &std::free);
}

// out columns c0:c0+cols of every row (row stride ys) += the addend's block for those columns;
// kbuf holds the addend's matrix block (with slack), part the block of the product
bool add_block(const Addend& ad, bool linear, size_t m, int64_t c0, int64_t cols, float* y,
               size_t ys, float* kbuf, float* part, ::pthreadpool* pool, const Spare& spare) {
  if (linear) {  // b rows c0:c0+cols, (cols, r): the operator's (out, in) kernel
    std::memcpy(kbuf, ad.b + c0 * ad.r, 4 * size_t(cols * ad.r));
  } else {  // b columns c0:c0+cols, (r, cols): an (in, out) kernel
    for (int64_t i = 0; i < ad.r; ++i)
      std::memcpy(kbuf + i * cols, ad.b + i * ad.b_cols + c0, 4 * size_t(cols));
  }
  if (!fully_connected(ad.a, m, size_t(ad.r), size_t(ad.r), kbuf, size_t(cols),
                       linear ? 0 : kTransposeWeights, part, size_t(cols), pool, spare))
    return false;
  AddPart c{y + c0, part, ys, size_t(cols), ad.alpha};
  pthreadpool_parallelize_1d(pool, add_part_row, &c, m, 0);
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

// y (..., N) = x (..., K) Wᵀ [+ alpha · a Bᵀ]: W in blocks of whole rows (output columns of y)
Tensor& linear_impl(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    const Tensor* a, const Tensor* b, double alpha, Tensor& out) {
  Packed w{};
  if (!checked(ctx, true, x, wq, scales, biases, bits, group, out, &w)) return out;
  const size_t m = size_t(x.numel() / w.k);
  Addend ad{};
  if (a != nullptr && !addend_of(ctx, true, w, m, *a, *b, alpha, &ad)) return out;
  xnn_initialize(nullptr);
  auto* pool = executorch::extension::threadpool::get_pthreadpool();
  const int64_t step = std::max<int64_t>(1, int64_t(kBlockBytes / (4 * size_t(w.k))));
  const int64_t most = std::min(step, w.n);
  Buffer buf = buffer(size_t(most * w.k));
  Buffer kbuf = buffer(a ? size_t(most * ad.r) : 0), part = buffer(a ? m * size_t(most) : 0);
  const Spare spare(x.const_data_ptr<float>(), m, size_t(w.k));
  const Spare spare_a(ad.a, a ? m : 0, size_t(ad.r));
  float* y = out.mutable_data_ptr<float>();
  for (int64_t r0 = 0; r0 < w.n && m > 0; r0 += step) {
    const int64_t rows = std::min(step, w.n - r0);
    Fill f{&w, buf.get(), r0, 0, w.k};
    pthreadpool_parallelize_1d(pool, fill_rows, &f, size_t(rows), 0);
    if (!fully_connected(x.const_data_ptr<float>(), m, size_t(w.k), size_t(w.k), buf.get(),
                         size_t(rows), 0, y + r0, size_t(w.n), pool, spare) ||
        (a != nullptr && !add_block(ad, true, m, r0, rows, y, size_t(w.n), kbuf.get(),
                                    part.get(), pool, spare_a))) {
      ET_LOG(Error, "mesp::qlinear: XNNPACK's fully-connected operator failed");
      ctx.fail(Error::Internal);
      return out;
    }
  }
  return out;
}

// dx (..., K) = dy (..., N) W [+ alpha · a A]: W in blocks of whole groups of columns
Tensor& matmul_impl(KernelRuntimeContext& ctx, const Tensor& dy, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    const Tensor* a, const Tensor* b, double alpha, Tensor& out) {
  Packed w{};
  if (!checked(ctx, false, dy, wq, scales, biases, bits, group, out, &w)) return out;
  const size_t m = size_t(dy.numel() / w.n);
  Addend ad{};
  if (a != nullptr && !addend_of(ctx, false, w, m, *a, *b, alpha, &ad)) return out;
  xnn_initialize(nullptr);
  auto* pool = executorch::extension::threadpool::get_pthreadpool();
  const int64_t per = int64_t(kBlockBytes / (4 * size_t(w.n))) / group * group;
  const int64_t step = std::min(std::max(group, per), w.k);
  Buffer buf = buffer(size_t(step * w.n));
  Buffer kbuf = buffer(a ? size_t(step * ad.r) : 0), part = buffer(a ? m * size_t(step) : 0);
  const Spare spare(dy.const_data_ptr<float>(), m, size_t(w.n));
  const Spare spare_a(ad.a, a ? m : 0, size_t(ad.r));
  float* dx = out.mutable_data_ptr<float>();
  for (int64_t c0 = 0; c0 < w.k && m > 0; c0 += step) {
    const int64_t cols = std::min(step, w.k - c0);
    Fill f{&w, buf.get(), 0, c0, c0 + cols};
    pthreadpool_parallelize_1d(pool, fill_cols, &f, size_t(w.n), 0);
    if (!fully_connected(dy.const_data_ptr<float>(), m, size_t(w.n), size_t(w.n), buf.get(),
                         size_t(cols), kTransposeWeights, dx + c0, size_t(w.k), pool, spare) ||
        (a != nullptr && !add_block(ad, false, m, c0, cols, dx, size_t(w.k), kbuf.get(),
                                    part.get(), pool, spare_a))) {
      ET_LOG(Error, "mesp::qmatmul: XNNPACK's fully-connected operator failed");
      ctx.fail(Error::Internal);
      return out;
    }
  }
  return out;
}

}  // namespace

namespace mesp_kernels {

Tensor& qlinear_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    Tensor& out) {
  return linear_impl(ctx, x, wq, scales, biases, bits, group, nullptr, nullptr, 1.0, out);
}

Tensor& qmatmul_out(KernelRuntimeContext& ctx, const Tensor& dy, const Tensor& wq,
                    const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                    Tensor& out) {
  return matmul_impl(ctx, dy, wq, scales, biases, bits, group, nullptr, nullptr, 1.0, out);
}

Tensor& qlinear_add_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& wq,
                        const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                        const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  return linear_impl(ctx, x, wq, scales, biases, bits, group, &a, &b, alpha, out);
}

Tensor& qmatmul_add_out(KernelRuntimeContext& ctx, const Tensor& dy, const Tensor& wq,
                        const Tensor& scales, const Tensor& biases, int64_t bits, int64_t group,
                        const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  return matmul_impl(ctx, dy, wq, scales, biases, bits, group, &a, &b, alpha, out);
}

}  // namespace mesp_kernels

// The product on raw buffers, exactly as the kernels run each block of W: for the guard-page
// test of the slack (tests/test_qmatmul_kernel.py). out (m, n) = in (m, k) · kernel (n, k)ᵀ.
extern "C" int mesp_fully_connected_f32(const float* in, size_t m, size_t k, const float* kernel,
                                        size_t n, float* out) {
  xnn_initialize(nullptr);
  const Spare spare(in, m, k);
  auto* pool = executorch::extension::threadpool::get_pthreadpool();
  return fully_connected(in, m, k, k, kernel, n, 0, out, n, pool, spare) ? 0 : 1;
}

EXECUTORCH_LIBRARY(mesp, "qlinear.out", mesp_kernels::qlinear_out);
EXECUTORCH_LIBRARY(mesp, "qmatmul.out", mesp_kernels::qmatmul_out);
EXECUTORCH_LIBRARY(mesp, "qlinear_add.out", mesp_kernels::qlinear_add_out);
EXECUTORCH_LIBRARY(mesp, "qmatmul_add.out", mesp_kernels::qmatmul_add_out);
