// Rotary position embedding applied in place to q and k in one launch.
//
// Rotate-half convention (Llama / HF): for each head vector x = [x1, x2] of
// halves, out = [x1*c - x2*s, x2*c + x1*s] with c, s = cos, sin[pos, i]. The
// backward is the inverse rotation, i.e. the same kernel with sign = -1.
// Blocks: one (position, batch) token per blockIdx.x; blockIdx.y picks q or k.
#include "dispatch.cuh"

namespace megascale {
namespace {

template <typename T>
__global__ void rotary_kernel(RotaryTensor q, RotaryTensor k, int64_t batch, int64_t half,
                              const float* __restrict__ cos, const float* __restrict__ sin, float sign) {
  const RotaryTensor t = blockIdx.y == 0 ? q : k;
  const int64_t token = blockIdx.x;
  const int64_t pos = token / batch;
  const int64_t b = token % batch;
  T* base = static_cast<T*>(t.data) + pos * t.stride_s + b * t.stride_b;
  const float* cos_row = cos + pos * half;
  const float* sin_row = sin + pos * half;
  const int64_t pairs = t.heads * half;
  for (int64_t idx = threadIdx.x; idx < pairs; idx += blockDim.x) {
    const int64_t head = idx / half;
    const int64_t i = idx - head * half;
    T* p = base + head * t.stride_h;
    const float c = cos_row[i];
    const float s = sign * sin_row[i];
    const float x1 = to_float(p[i]);
    const float x2 = to_float(p[i + half]);
    p[i] = from_float<T>(x1 * c - x2 * s);
    p[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}

}  // namespace

cudaError_t rotary_inplace(DType dtype, RotaryTensor q, RotaryTensor k, int64_t seq, int64_t batch, int64_t head_dim,
                           const float* cos, const float* sin, float sign, cudaStream_t stream) {
  if (seq * batch == 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t half = head_dim / 2;
  const int64_t max_heads = q.heads > k.heads ? q.heads : k.heads;
  const int threads = threads_for(max_heads * half, 256);
  // grid.y = 2 rotates q and k in one launch; 1 when k is absent.
  const dim3 grid(static_cast<unsigned>(seq * batch), k.heads > 0 ? 2 : 1);
  return MEGASCALE_DISPATCH(dtype, [&] {
    rotary_kernel<scalar_t><<<grid, threads, 0, stream>>>(q, k, batch, half, cos, sin, sign);
    return cudaGetLastError();
  });
}

}  // namespace megascale
