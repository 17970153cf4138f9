// Host-side launchers of megascale's fused CUDA kernels.
//
// Plain C++ with raw pointers and a dtype tag, so the torch bindings
// (bindings.cpp) and the kernel bodies (*.cu) never include each other's
// headers. Every launcher returns the CUDA error of its launch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace megascale {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---- layer norm / RMS norm, optionally with the residual add fused in front.
// z = x (+ residual); y = norm(z) * weight (+ bias). When `residual` is given,
// z is written to `sum_out` (same dtype as x). mean (LayerNorm only) and rstd
// are fp32 [rows] and feed the backward. `weight_dtype` is x's dtype or fp32.
cudaError_t norm_forward(DType dtype, DType weight_dtype, const void* x, const void* residual, const void* weight,
                         const void* bias, void* y, void* sum_out, float* mean, float* rstd, int64_t rows,
                         int64_t cols, float eps, bool rms, cudaStream_t stream);

// Rows of partial weight/bias gradients the backward writes (fp32 [n, cols]).
int64_t norm_backward_partial_rows(int64_t rows);

// dx = d norm / dz (+ dsum, the gradient flowing into the residual output),
// and dweight/dbias reduced over rows through fp32 partials (workspace of
// 2 * norm_backward_partial_rows(rows) * cols floats).
cudaError_t norm_backward(DType dtype, DType weight_dtype, const void* dy, const void* z, const float* mean,
                          const float* rstd, const void* weight, const void* dsum, void* dx, void* dweight,
                          void* dbias, float* workspace, int64_t rows, int64_t cols, bool rms, cudaStream_t stream);

// ---- rotary embedding, in place, rotate-half convention.
// A tensor [s, b, heads, d] with arbitrary strides for its first three dims
// and a contiguous last dim. cos/sin are fp32 [s, d/2]. sign=-1 applies the
// inverse rotation (the backward). k with heads = 0 rotates q alone.
struct RotaryTensor {
  void* data;
  int64_t heads;
  int64_t stride_s;
  int64_t stride_b;
  int64_t stride_h;
};

cudaError_t rotary_inplace(DType dtype, RotaryTensor q, RotaryTensor k, int64_t seq, int64_t batch, int64_t head_dim,
                           const float* cos, const float* sin, float sign, cudaStream_t stream);

// ---- activations (contiguous tensors of n elements; bias_gelu: rows x cols).
cudaError_t swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n, cudaStream_t stream);
cudaError_t swiglu_backward(DType dtype, const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                            int64_t n, cudaStream_t stream);
cudaError_t bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                              cudaStream_t stream);
cudaError_t bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias, void* dx, int64_t rows,
                               int64_t cols, cudaStream_t stream);

// ---- vocab-parallel cross entropy over a local vocab shard [rows, vocab].
// Forward: per row, the local max, the sum of exp(logit - local max) and the
// target logit (0 when the label is outside [vocab_start, vocab_start+vocab)
// or negative = ignored). Backward: dlogits = grad * (exp(logit - lse) - onehot).
cudaError_t cross_entropy_forward(DType dtype, const void* logits, const int64_t* labels, float* local_max,
                                  float* local_sum, float* target_logit, int64_t rows, int64_t vocab,
                                  int64_t vocab_start, cudaStream_t stream);
cudaError_t cross_entropy_backward(DType dtype, const void* logits, const int64_t* labels, const float* lse,
                                   const float* grad, void* dlogits, int64_t rows, int64_t vocab, int64_t vocab_start,
                                   cudaStream_t stream);

}  // namespace megascale
