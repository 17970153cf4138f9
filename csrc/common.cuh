// Shared device helpers for megascale's fused kernels.
//
// This header (and every .cu file) includes only CUDA headers, never torch:
// the kernels then compile with a bare `nvcc -c` on any machine with the CUDA
// toolkit, which is how CI checks them without a GPU or a CUDA build of torch.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace megascale {

// A fixed-size vector of N elements, aligned so that a load is one wide
// transaction (16 bytes for 8 x bf16 / 4 x fp32).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T, N>& value) {
  *reinterpret_cast<Vec<T, N>*>(ptr) = value;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the whole block, result returned to every thread. blockDim.x must be
// a multiple of 32. `scratch` holds >= 32 floats; the leading barrier makes it
// safe to call this repeatedly with the same scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : -FLT_MAX;
  return warp_max(v);
}

// Online softmax state: running max m and sum of exp(x - m). -FLT_MAX (not
// -inf) as the empty max keeps exp(m_old - m_new) finite when logits hold -inf.
struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = combine(v, other);
  }
  return v;
}

__device__ __forceinline__ MaxSum block_combine(MaxSum v, float* scratch_max, float* scratch_sum) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_combine(v);
  __syncthreads();
  if (lane == 0) {
    scratch_max[warp] = v.max;
    scratch_sum[warp] = v.sum;
  }
  __syncthreads();
  v = lane < num_warps ? MaxSum{scratch_max[lane], scratch_sum[lane]} : MaxSum{-FLT_MAX, 0.f};
  return warp_combine(v);
}

// True when every pointer is aligned for a vector of `bytes` bytes.
inline bool aligned_to(const void* ptr, size_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Threads per block for a row of `items` vector items: a multiple of 32 in [32, cap].
inline int threads_for(int64_t items, int cap) {
  int64_t t = ((items + 31) / 32) * 32;
  if (t < 32) t = 32;
  if (t > cap) t = cap;
  return static_cast<int>(t);
}

}  // namespace megascale
