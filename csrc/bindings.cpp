// Thin torch bindings of the fused kernels: shape/dtype checks, output
// allocation, current stream, then a call into the plain launchers of
// kernels.h. Builds only against a CUDA build of torch (the JIT build in
// megascale/kernels/build.py); the kernel bodies live in the .cu files.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

using megascale::DType;
using torch::Tensor;

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "megascale kernels support float32, float16 and bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void check_contiguous(const Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megascale ", op, " kernel failed: ", cudaGetErrorString(err));
}

const void* ptr_or_null(const std::optional<Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---------------------------------------------------------------- norms

// x, residual: [rows, cols]; weight, bias: [cols] in x's dtype or fp32.
// Returns (y, sum or empty, mean or empty, rstd).
std::vector<Tensor> norm_forward(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                                 const std::optional<Tensor>& bias, double eps, bool rms) {
  check_contiguous(x, "x");
  check_contiguous(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "norm: x [rows, cols], weight [cols]");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  if (residual.has_value()) {
    check_contiguous(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x in shape and dtype");
  }
  if (bias.has_value()) {
    check_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->numel() == cols, "bias must match weight");
  }
  const auto stats = x.options().dtype(at::kFloat);
  Tensor y = torch::empty_like(x);
  Tensor sum = residual.has_value() ? torch::empty_like(x) : torch::empty({0}, x.options());
  Tensor mean = rms ? torch::empty({0}, stats) : torch::empty({rows}, stats);
  Tensor rstd = torch::empty({rows}, stats);
  check_launch(megascale::norm_forward(dtype_of(x), dtype_of(weight), x.data_ptr(), ptr_or_null(residual),
                                       weight.data_ptr(), ptr_or_null(bias), y.data_ptr(),
                                       residual.has_value() ? sum.data_ptr() : nullptr,
                                       rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols,
                                       static_cast<float>(eps), rms, stream()),
               "norm_forward");
  return {y, sum, mean, rstd};
}

// Returns (dx, dweight, dbias or empty).
std::vector<Tensor> norm_backward(const Tensor& dy, const Tensor& z, const Tensor& mean, const Tensor& rstd,
                                  const Tensor& weight, const std::optional<Tensor>& dsum, bool with_bias, bool rms) {
  check_contiguous(dy, "dy");
  check_contiguous(z, "z");
  check_contiguous(weight, "weight");
  TORCH_CHECK(dy.sizes() == z.sizes() && dy.scalar_type() == z.scalar_type(), "dy must match the saved input");
  if (dsum.has_value()) {
    check_contiguous(*dsum, "dsum");
    TORCH_CHECK(dsum->sizes() == z.sizes() && dsum->scalar_type() == z.scalar_type(), "dsum must match the input");
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t rows = z.size(0);
  const int64_t cols = z.size(1);
  const int64_t partial_rows = megascale::norm_backward_partial_rows(rows);
  Tensor dx = torch::empty_like(z);
  Tensor dweight = torch::empty_like(weight);
  Tensor dbias = with_bias ? torch::empty_like(weight) : torch::empty({0}, weight.options());
  Tensor workspace = torch::empty({(with_bias ? 2 : 1) * partial_rows * cols}, z.options().dtype(at::kFloat));
  check_launch(megascale::norm_backward(dtype_of(z), dtype_of(weight), dy.data_ptr(), z.data_ptr(),
                                        rms ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                        weight.data_ptr(), ptr_or_null(dsum), dx.data_ptr(), dweight.data_ptr(),
                                        with_bias ? dbias.data_ptr() : nullptr, workspace.data_ptr<float>(), rows,
                                        cols, rms, stream()),
               "norm_backward");
  return {dx, dweight, dbias};
}

// ---------------------------------------------------------------- rotary

megascale::RotaryTensor rotary_view(const Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, name, " must be [s, b, heads, d] with a contiguous last dim");
  return {t.data_ptr(), t.size(2), t.stride(0), t.stride(1), t.stride(2)};
}

// Rotates q (and k when given) in place in one launch; cos/sin fp32
// contiguous [s, d/2]. sign -1 applies the inverse rotation.
void rotary_inplace(Tensor q, const std::optional<Tensor>& k, const Tensor& cos, const Tensor& sin, double sign) {
  if (k.has_value()) {
    TORCH_CHECK(q.scalar_type() == k->scalar_type(), "q and k must share a dtype");
    TORCH_CHECK(k->dim() == 4 && q.dim() == 4 && q.size(0) == k->size(0) && q.size(1) == k->size(1) &&
                    q.size(3) == k->size(3),
                "q and k must agree in s, b and d");
  }
  check_contiguous(cos, "cos");
  check_contiguous(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin must be float32");
  const megascale::RotaryTensor q_view = rotary_view(q, "q");
  TORCH_CHECK(q.size(3) % 2 == 0, "rotary head dim must be even");
  TORCH_CHECK(cos.numel() == q.size(0) * q.size(3) / 2 && sin.numel() == cos.numel(), "cos/sin must be [s, d/2]");
  // No k: a zero-head stand-in whose blocks exit at once.
  const megascale::RotaryTensor k_view = k.has_value() ? rotary_view(*k, "k") : megascale::RotaryTensor{nullptr, 0, 0, 0, 0};
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(megascale::rotary_inplace(dtype_of(q), q_view, k_view, q.size(0), q.size(1), q.size(3),
                                         cos.data_ptr<float>(), sin.data_ptr<float>(), static_cast<float>(sign),
                                         stream()),
               "rotary");
}

// ---------------------------------------------------------------- activations

Tensor swiglu_forward(const Tensor& gate, const Tensor& up) {
  check_contiguous(gate, "gate");
  check_contiguous(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "gate and up must match");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor out = torch::empty_like(gate);
  check_launch(megascale::swiglu_forward(dtype_of(gate), gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(),
                                         stream()),
               "swiglu_forward");
  return out;
}

std::vector<Tensor> swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up) {
  check_contiguous(dout, "dout");
  check_contiguous(gate, "gate");
  check_contiguous(up, "up");
  TORCH_CHECK(dout.sizes() == gate.sizes() && dout.scalar_type() == gate.scalar_type(), "dout must match gate");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor dgate = torch::empty_like(gate);
  Tensor dup = torch::empty_like(up);
  check_launch(megascale::swiglu_backward(dtype_of(gate), dout.data_ptr(), gate.data_ptr(), up.data_ptr(),
                                          dgate.data_ptr(), dup.data_ptr(), gate.numel(), stream()),
               "swiglu_backward");
  return {dgate, dup};
}

Tensor bias_gelu_forward(const Tensor& x, const std::optional<Tensor>& bias) {
  check_contiguous(x, "x");
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  if (bias.has_value()) {
    check_contiguous(*bias, "bias");
    TORCH_CHECK(bias->numel() == cols && bias->scalar_type() == x.scalar_type(), "bias must be [cols] in x's dtype");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = torch::empty_like(x);
  check_launch(megascale::bias_gelu_forward(dtype_of(x), x.data_ptr(), ptr_or_null(bias), y.data_ptr(),
                                            cols == 0 ? 0 : x.numel() / cols, cols, stream()),
               "bias_gelu_forward");
  return y;
}

Tensor bias_gelu_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& bias) {
  check_contiguous(dy, "dy");
  check_contiguous(x, "x");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy must match x");
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  if (bias.has_value()) check_contiguous(*bias, "bias");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor dx = torch::empty_like(x);
  check_launch(megascale::bias_gelu_backward(dtype_of(x), dy.data_ptr(), x.data_ptr(), ptr_or_null(bias),
                                             dx.data_ptr(), cols == 0 ? 0 : x.numel() / cols, cols, stream()),
               "bias_gelu_backward");
  return dx;
}

// ---------------------------------------------------------------- cross entropy

// Returns fp32 (local_max, local_sum_exp, target_logit), each [rows].
std::vector<Tensor> cross_entropy_forward(const Tensor& logits, const Tensor& labels, int64_t vocab_start) {
  check_contiguous(logits, "logits");
  check_contiguous(labels, "labels");
  TORCH_CHECK(logits.dim() == 2 && labels.dim() == 1 && labels.size(0) == logits.size(0),
              "cross entropy: logits [n, V_local], labels [n]");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels must be int64");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  const auto stats = logits.options().dtype(at::kFloat);
  Tensor local_max = torch::empty({rows}, stats);
  Tensor local_sum = torch::empty({rows}, stats);
  Tensor target = torch::empty({rows}, stats);
  check_launch(megascale::cross_entropy_forward(dtype_of(logits), logits.data_ptr(), labels.data_ptr<int64_t>(),
                                                local_max.data_ptr<float>(), local_sum.data_ptr<float>(),
                                                target.data_ptr<float>(), rows, logits.size(1), vocab_start, stream()),
               "cross_entropy_forward");
  return {local_max, local_sum, target};
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, const Tensor& grad,
                              int64_t vocab_start) {
  check_contiguous(logits, "logits");
  check_contiguous(labels, "labels");
  check_contiguous(lse, "lse");
  check_contiguous(grad, "grad");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat, "lse and grad must be float32");
  const c10::cuda::CUDAGuard guard(logits.device());
  Tensor dlogits = torch::empty_like(logits);
  check_launch(megascale::cross_entropy_backward(dtype_of(logits), logits.data_ptr(), labels.data_ptr<int64_t>(),
                                                 lse.data_ptr<float>(), grad.data_ptr<float>(), dlogits.data_ptr(),
                                                 logits.size(0), logits.size(1), vocab_start, stream()),
               "cross_entropy_backward");
  return dlogits;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megascale fused CUDA kernels (see megascale/kernels for the autograd fronts)";
  m.def("norm_forward", &norm_forward, "fused (residual +) LayerNorm/RMSNorm forward");
  m.def("norm_backward", &norm_backward, "fused LayerNorm/RMSNorm backward");
  m.def("rotary_inplace", &rotary_inplace, "in-place rotary embedding of q and k");
  m.def("swiglu_forward", &swiglu_forward, "silu(gate) * up");
  m.def("swiglu_backward", &swiglu_backward, "SwiGLU backward");
  m.def("bias_gelu_forward", &bias_gelu_forward, "gelu_tanh(x + bias)");
  m.def("bias_gelu_backward", &bias_gelu_backward, "bias GeLU backward (dx; dbias = dx summed by the front)");
  m.def("cross_entropy_forward", &cross_entropy_forward, "per-row local max, sum-exp and target logit");
  m.def("cross_entropy_backward", &cross_entropy_backward, "softmax minus one-hot, recomputed from logits");
}
