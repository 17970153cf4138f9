// Fused SwiGLU and bias + tanh-GeLU, forward and backward.
//
// Elementwise and memory-bound: 16-byte vector loads when sizes and pointers
// allow, a grid-stride loop, math in fp32.
#include <initializer_list>

#include "dispatch.cuh"

namespace megascale {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh(float z) {
  return 0.5f * z * (1.f + tanhf(kSqrt2OverPi * (z + kGeluCoeff * z * z * z)));
}

__device__ __forceinline__ float gelu_tanh_grad(float z) {
  const float t = tanhf(kSqrt2OverPi * (z + kGeluCoeff * z * z * z));
  return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * z * z);
}

inline unsigned grid_for(int64_t items, int threads) {
  const int64_t wanted = (items + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(device_sm_count()) * 32;
  const int64_t blocks = wanted < cap ? wanted : cap;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

template <typename T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                                      int64_t items) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T, VEC> g = load_vec<T, VEC>(gate + i * VEC);
    const Vec<T, VEC> u = load_vec<T, VEC>(up + i * VEC);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = to_float(g.v[j]);
      o.v[j] = from_float<T>(gf * sigmoid(gf) * to_float(u.v[j]));
    }
    store_vec<T, VEC>(out + i * VEC, o);
  }
}

template <typename T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ dgate, T* __restrict__ dup,
                                       int64_t items) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T, VEC> d = load_vec<T, VEC>(dout + i * VEC);
    const Vec<T, VEC> g = load_vec<T, VEC>(gate + i * VEC);
    const Vec<T, VEC> u = load_vec<T, VEC>(up + i * VEC);
    Vec<T, VEC> dg;
    Vec<T, VEC> du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = to_float(g.v[j]);
      const float df = to_float(d.v[j]);
      const float sig = sigmoid(gf);
      // d silu(g)/dg = sig * (1 + g * (1 - sig))
      dg.v[j] = from_float<T>(df * to_float(u.v[j]) * sig * (1.f + gf * (1.f - sig)));
      du.v[j] = from_float<T>(df * gf * sig);
    }
    store_vec<T, VEC>(dgate + i * VEC, dg);
    store_vec<T, VEC>(dup + i * VEC, du);
  }
}

// VEC divides cols, so a vector never straddles two rows and the bias index
// of its first element is (i * VEC) % cols.
template <typename T, int VEC>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y,
                                         int64_t items, int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T, VEC> xv = load_vec<T, VEC>(x + i * VEC);
    Vec<T, VEC> bv;
    if (bias != nullptr) bv = load_vec<T, VEC>(bias + (i * VEC) % cols);
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float z = to_float(xv.v[j]) + (bias != nullptr ? to_float(bv.v[j]) : 0.f);
      out.v[j] = from_float<T>(gelu_tanh(z));
    }
    store_vec<T, VEC>(y + i * VEC, out);
  }
}

template <typename T, int VEC>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                          const T* __restrict__ bias, T* __restrict__ dx, int64_t items,
                                          int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec<T, VEC> dv = load_vec<T, VEC>(dy + i * VEC);
    const Vec<T, VEC> xv = load_vec<T, VEC>(x + i * VEC);
    Vec<T, VEC> bv;
    if (bias != nullptr) bv = load_vec<T, VEC>(bias + (i * VEC) % cols);
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float z = to_float(xv.v[j]) + (bias != nullptr ? to_float(bv.v[j]) : 0.f);
      out.v[j] = from_float<T>(to_float(dv.v[j]) * gelu_tanh_grad(z));
    }
    store_vec<T, VEC>(dx + i * VEC, out);
  }
}

template <typename T>
bool vectorisable(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int vec = vec_width<T>();
  if (n % vec != 0) return false;
  for (const void* p : ptrs)
    if (!aligned_to(p, sizeof(T) * vec)) return false;
  return true;
}

constexpr int kThreads = 256;

}  // namespace

cudaError_t swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* g = static_cast<const scalar_t*>(gate);
    const auto* u = static_cast<const scalar_t*>(up);
    auto* o = static_cast<scalar_t*>(out);
    if (vectorisable<scalar_t>(n, {gate, up, out}))
      swiglu_forward_kernel<scalar_t, vec><<<grid_for(n / vec, kThreads), kThreads, 0, stream>>>(g, u, o, n / vec);
    else
      swiglu_forward_kernel<scalar_t, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(g, u, o, n);
    return cudaGetLastError();
  });
}

cudaError_t swiglu_backward(DType dtype, const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                            int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* d = static_cast<const scalar_t*>(dout);
    const auto* g = static_cast<const scalar_t*>(gate);
    const auto* u = static_cast<const scalar_t*>(up);
    auto* dg = static_cast<scalar_t*>(dgate);
    auto* du = static_cast<scalar_t*>(dup);
    if (vectorisable<scalar_t>(n, {dout, gate, up, dgate, dup}))
      swiglu_backward_kernel<scalar_t, vec>
          <<<grid_for(n / vec, kThreads), kThreads, 0, stream>>>(d, g, u, dg, du, n / vec);
    else
      swiglu_backward_kernel<scalar_t, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(d, g, u, dg, du, n);
    return cudaGetLastError();
  });
}

cudaError_t bias_gelu_forward(DType dtype, const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                              cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* xp = static_cast<const scalar_t*>(x);
    const auto* bp = static_cast<const scalar_t*>(bias);
    auto* yp = static_cast<scalar_t*>(y);
    if (vectorisable<scalar_t>(cols, {x, bias, y}))
      bias_gelu_forward_kernel<scalar_t, vec>
          <<<grid_for(n / vec, kThreads), kThreads, 0, stream>>>(xp, bp, yp, n / vec, cols);
    else
      bias_gelu_forward_kernel<scalar_t, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(xp, bp, yp, n, cols);
    return cudaGetLastError();
  });
}

cudaError_t bias_gelu_backward(DType dtype, const void* dy, const void* x, const void* bias, void* dx, int64_t rows,
                               int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* dp = static_cast<const scalar_t*>(dy);
    const auto* xp = static_cast<const scalar_t*>(x);
    const auto* bp = static_cast<const scalar_t*>(bias);
    auto* out = static_cast<scalar_t*>(dx);
    if (vectorisable<scalar_t>(cols, {dy, x, bias, dx}))
      bias_gelu_backward_kernel<scalar_t, vec>
          <<<grid_for(n / vec, kThreads), kThreads, 0, stream>>>(dp, xp, bp, out, n / vec, cols);
    else
      bias_gelu_backward_kernel<scalar_t, 1>
          <<<grid_for(n, kThreads), kThreads, 0, stream>>>(dp, xp, bp, out, n, cols);
    return cudaGetLastError();
  });
}

}  // namespace megascale
