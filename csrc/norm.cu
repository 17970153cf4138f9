// Fused LayerNorm / RMSNorm with an optional residual add in front.
//
// Forward: one row per block. The row is read up to three times (sum, centred
// sum of squares, normalise); after the first pass it sits in L1/L2, so DRAM
// sees one read and one write per element while any hidden size works
// without templating on it. Statistics accumulate in fp32.
//
// Backward: a grid of ~one block per SM slot walks the rows; each block keeps
// its partial dweight/dbias columns in shared memory (global workspace when
// the row is too wide for shared memory), writes them once as an fp32 row of
// partials, and a second kernel reduces the partial rows per column.
#include <initializer_list>

#include "dispatch.cuh"

namespace megascale {
namespace {

template <typename T, typename W, int VEC>
// No __restrict__ on x / sum_out: later passes re-read sum_out through `z`,
// and a read-only (non-coherent) cache load of memory this kernel wrote
// would be wrong.
__global__ void norm_forward_kernel(const T* x, const T* __restrict__ residual, const W* __restrict__ weight,
                                    const W* __restrict__ bias, T* __restrict__ y, T* sum_out,
                                    float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t cols,
                                    float eps, bool rms) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t offset = row * cols;
  const int64_t items = cols / VEC;
  // z is what gets normalised: x, or x + residual rounded to T (as the
  // unfused reference computes it, so both backends agree bit for bit on z).
  const T* z = residual != nullptr ? sum_out + offset : x + offset;

  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    Vec<T, VEC> xv = load_vec<T, VEC>(x + offset + i * VEC);
    if (residual != nullptr) {
      const Vec<T, VEC> rv = load_vec<T, VEC>(residual + offset + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) xv.v[j] = from_float<T>(to_float(xv.v[j]) + to_float(rv.v[j]));
      store_vec<T, VEC>(sum_out + offset + i * VEC, xv);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float value = to_float(xv.v[j]);
      acc += rms ? value * value : value;
    }
  }
  acc = block_sum(acc, scratch);

  float mean = 0.f;
  float var;
  if (rms) {
    var = acc / static_cast<float>(cols);
  } else {
    mean = acc / static_cast<float>(cols);
    // Centred second pass: no catastrophic cancellation for large means.
    float centred = 0.f;
    for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
      const Vec<T, VEC> zv = load_vec<T, VEC>(z + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = to_float(zv.v[j]) - mean;
        centred += d * d;
      }
    }
    var = block_sum(centred, scratch) / static_cast<float>(cols);
  }
  const float rstd = rsqrtf(var + eps);
  if (threadIdx.x == 0) {
    if (mean_out != nullptr) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }

  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const Vec<T, VEC> zv = load_vec<T, VEC>(z + i * VEC);
    const Vec<W, VEC> wv = load_vec<W, VEC>(weight + i * VEC);
    Vec<T, VEC> out;
    if (bias != nullptr) {
      const Vec<W, VEC> bv = load_vec<W, VEC>(bias + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        out.v[j] = from_float<T>((to_float(zv.v[j]) - mean) * rstd * to_float(wv.v[j]) + to_float(bv.v[j]));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>((to_float(zv.v[j]) - mean) * rstd * to_float(wv.v[j]));
    }
    store_vec<T, VEC>(y + offset + i * VEC, out);
  }
}

template <typename T, typename W, int VEC>
__global__ void norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ z, const float* __restrict__ mean,
                                     const float* __restrict__ rstd, const W* __restrict__ weight,
                                     const T* __restrict__ dsum, T* __restrict__ dx, float* __restrict__ partial_dw,
                                     float* __restrict__ partial_db, int64_t rows, int64_t cols, bool rms,
                                     bool acc_in_shared) {
  extern __shared__ float shared_acc[];
  __shared__ float scratch[32];
  const int64_t items = cols / VEC;
  const bool with_bias = partial_db != nullptr;
  float* acc_dw = acc_in_shared ? shared_acc : partial_dw + blockIdx.x * cols;
  float* acc_db = !with_bias ? nullptr : (acc_in_shared ? shared_acc + cols : partial_db + blockIdx.x * cols);

  // Every thread owns the same columns in every row, so the accumulators need
  // no synchronisation: each slot is touched by exactly one thread.
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_dw[i * VEC + j] = 0.f;
      if (with_bias) acc_db[i * VEC + j] = 0.f;
    }
  }

  const float inv_cols = 1.f / static_cast<float>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * cols;
    const float mu = rms ? 0.f : mean[row];
    const float rs = rstd[row];
    float sum_g = 0.f;        // sum of dy * w
    float sum_g_xhat = 0.f;   // sum of dy * w * xhat
    for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
      const Vec<T, VEC> dyv = load_vec<T, VEC>(dy + offset + i * VEC);
      const Vec<T, VEC> zv = load_vec<T, VEC>(z + offset + i * VEC);
      const Vec<W, VEC> wv = load_vec<W, VEC>(weight + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float g = to_float(dyv.v[j]);
        const float xhat = (to_float(zv.v[j]) - mu) * rs;
        const float gw = g * to_float(wv.v[j]);
        sum_g += gw;
        sum_g_xhat += gw * xhat;
        acc_dw[i * VEC + j] += g * xhat;
        if (with_bias) acc_db[i * VEC + j] += g;
      }
    }
    const float mean_g = rms ? 0.f : block_sum(sum_g, scratch) * inv_cols;
    const float mean_g_xhat = block_sum(sum_g_xhat, scratch) * inv_cols;
    for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
      const Vec<T, VEC> dyv = load_vec<T, VEC>(dy + offset + i * VEC);
      const Vec<T, VEC> zv = load_vec<T, VEC>(z + offset + i * VEC);
      const Vec<W, VEC> wv = load_vec<W, VEC>(weight + i * VEC);
      Vec<T, VEC> extra;
      if (dsum != nullptr) extra = load_vec<T, VEC>(dsum + offset + i * VEC);
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = (to_float(zv.v[j]) - mu) * rs;
        const float gw = to_float(dyv.v[j]) * to_float(wv.v[j]);
        float grad = rs * (gw - mean_g - xhat * mean_g_xhat);
        if (dsum != nullptr) grad += to_float(extra.v[j]);
        out.v[j] = from_float<T>(grad);
      }
      store_vec<T, VEC>(dx + offset + i * VEC, out);
    }
  }

  if (acc_in_shared) {
    for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        partial_dw[blockIdx.x * cols + i * VEC + j] = acc_dw[i * VEC + j];
        if (with_bias) partial_db[blockIdx.x * cols + i * VEC + j] = acc_db[i * VEC + j];
      }
    }
  }
}

// out[c] = sum_r partial[r, c]: 32 columns per block, 8 row lanes, fp32.
template <typename W>
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t partial_rows, int64_t cols,
                                  W* __restrict__ out) {
  __shared__ float tile[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < partial_rows; r += 8) acc += partial[r * cols + col];
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) total += tile[r][threadIdx.x];
    out[col] = from_float<W>(total);
  }
}

template <typename T, typename W, int VEC>
cudaError_t launch_forward(const void* x, const void* residual, const void* weight, const void* bias, void* y,
                           void* sum_out, float* mean, float* rstd, int64_t rows, int64_t cols, float eps, bool rms,
                           cudaStream_t stream) {
  const int threads = threads_for(cols / VEC, 512);
  norm_forward_kernel<T, W, VEC><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const W*>(weight),
      static_cast<const W*>(bias), static_cast<T*>(y), static_cast<T*>(sum_out), mean, rstd, cols, eps, rms);
  return cudaGetLastError();
}

template <typename T, typename W, int VEC>
cudaError_t launch_backward(const void* dy, const void* z, const float* mean, const float* rstd, const void* weight,
                            const void* dsum, void* dx, void* dweight, void* dbias, float* workspace, int64_t rows,
                            int64_t cols, bool rms, cudaStream_t stream) {
  const int64_t blocks = norm_backward_partial_rows(rows);
  const int threads = threads_for(cols / VEC, 512);
  float* partial_dw = workspace;
  float* partial_db = dbias != nullptr ? workspace + blocks * cols : nullptr;

  const size_t acc_bytes = static_cast<size_t>(cols) * sizeof(float) * (dbias != nullptr ? 2 : 1);
  int device = 0;
  int max_optin = 48 * 1024;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  auto kernel = norm_backward_kernel<T, W, VEC>;
  // Leave room for the static reduction scratch.
  const bool acc_in_shared = acc_bytes + 1024 <= static_cast<size_t>(max_optin);
  const size_t shared_bytes = acc_in_shared ? acc_bytes : 0;
  if (shared_bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), threads, shared_bytes, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(z), mean, rstd, static_cast<const W*>(weight),
      static_cast<const T*>(dsum), static_cast<T*>(dx), partial_dw, partial_db, rows, cols, rms, acc_in_shared);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const dim3 sum_threads(32, 8);
  const unsigned sum_blocks = static_cast<unsigned>((cols + 31) / 32);
  column_sum_kernel<W><<<sum_blocks, sum_threads, 0, stream>>>(partial_dw, blocks, cols, static_cast<W*>(dweight));
  if (dbias != nullptr) {
    column_sum_kernel<W><<<sum_blocks, sum_threads, 0, stream>>>(partial_db, blocks, cols, static_cast<W*>(dbias));
  }
  return cudaGetLastError();
}

// Wide vectors only when the row length and every pointer allow them; odd
// hidden sizes fall back to scalar loads through the same kernel.
template <typename T, typename W>
bool can_vectorise(int64_t cols, std::initializer_list<const void*> rows_ptrs, std::initializer_list<const void*> w_ptrs) {
  constexpr int vec = vec_width<T>();
  if (cols % vec != 0) return false;
  for (const void* p : rows_ptrs)
    if (!aligned_to(p, sizeof(T) * vec)) return false;
  for (const void* p : w_ptrs)
    if (!aligned_to(p, sizeof(W) * vec)) return false;
  return true;
}

}  // namespace

int64_t norm_backward_partial_rows(int64_t rows) {
  const int64_t slots = 2 * static_cast<int64_t>(device_sm_count());
  return rows < slots ? (rows > 0 ? rows : 1) : slots;
}

cudaError_t norm_forward(DType dtype, DType weight_dtype, const void* x, const void* residual, const void* weight,
                         const void* bias, void* y, void* sum_out, float* mean, float* rstd, int64_t rows,
                         int64_t cols, float eps, bool rms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool weight_fp32 = weight_dtype == DType::kFloat32;
  if (!weight_fp32 && weight_dtype != dtype) return cudaErrorInvalidValue;
  return MEGASCALE_DISPATCH(dtype, [&] {
    auto run = [&](auto weight_tag) -> cudaError_t {
      using W = decltype(weight_tag);
      constexpr int vec = vec_width<scalar_t>();
      if (can_vectorise<scalar_t, W>(cols, {x, residual, y, sum_out}, {weight, bias}))
        return launch_forward<scalar_t, W, vec>(x, residual, weight, bias, y, sum_out, mean, rstd, rows, cols, eps,
                                                rms, stream);
      return launch_forward<scalar_t, W, 1>(x, residual, weight, bias, y, sum_out, mean, rstd, rows, cols, eps, rms,
                                            stream);
    };
    return weight_fp32 ? run(float{}) : run(scalar_t{});
  });
}

cudaError_t norm_backward(DType dtype, DType weight_dtype, const void* dy, const void* z, const float* mean,
                          const float* rstd, const void* weight, const void* dsum, void* dx, void* dweight,
                          void* dbias, float* workspace, int64_t rows, int64_t cols, bool rms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool weight_fp32 = weight_dtype == DType::kFloat32;
  if (!weight_fp32 && weight_dtype != dtype) return cudaErrorInvalidValue;
  return MEGASCALE_DISPATCH(dtype, [&] {
    auto run = [&](auto weight_tag) -> cudaError_t {
      using W = decltype(weight_tag);
      constexpr int vec = vec_width<scalar_t>();
      if (can_vectorise<scalar_t, W>(cols, {dy, z, dsum, dx}, {weight}))
        return launch_backward<scalar_t, W, vec>(dy, z, mean, rstd, weight, dsum, dx, dweight, dbias, workspace, rows,
                                                 cols, rms, stream);
      return launch_backward<scalar_t, W, 1>(dy, z, mean, rstd, weight, dsum, dx, dweight, dbias, workspace, rows,
                                             cols, rms, stream);
    };
    return weight_fp32 ? run(float{}) : run(scalar_t{});
  });
}

}  // namespace megascale
