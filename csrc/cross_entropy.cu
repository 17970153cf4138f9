// Vocab-parallel cross entropy over one rank's vocab shard, never
// materialising probabilities.
//
// Forward: one block per row makes a single pass over the shard with an
// online max / sum-of-exp (fp32), and picks the target logit if this rank
// owns it. The front all-reduces max and rescaled sums over the tp group.
// Backward: recomputes softmax from the logits and the saved global
// log-sum-exp: dlogits = grad * (exp(logit - lse) - onehot(target)).
// Negative labels are ignored (zero loss and zero gradient).
#include "dispatch.cuh"

namespace megascale {
namespace {

template <typename T, int VEC>
__global__ void ce_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                                  float* __restrict__ local_max, float* __restrict__ local_sum,
                                  float* __restrict__ target_logit, int64_t vocab, int64_t vocab_start) {
  __shared__ float scratch_max[32];
  __shared__ float scratch_sum[32];
  const int64_t row = blockIdx.x;
  const T* row_logits = logits + row * vocab;
  MaxSum state{-FLT_MAX, 0.f};
  for (int64_t i = threadIdx.x; i < vocab / VEC; i += blockDim.x) {
    const Vec<T, VEC> v = load_vec<T, VEC>(row_logits + i * VEC);
    float chunk_max = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < VEC; ++j) chunk_max = fmaxf(chunk_max, to_float(v.v[j]));
    // One rescale per vector instead of one per element.
    const float m = fmaxf(state.max, chunk_max);
    float s = state.sum * expf(state.max - m);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += expf(to_float(v.v[j]) - m);
    state = {m, s};
  }
  state = block_combine(state, scratch_max, scratch_sum);
  if (threadIdx.x == 0) {
    local_max[row] = state.max;
    local_sum[row] = state.sum;
    const int64_t label = labels[row];
    const int64_t local = label - vocab_start;
    target_logit[row] = (label >= 0 && local >= 0 && local < vocab) ? to_float(row_logits[local]) : 0.f;
  }
}

template <typename T, int VEC>
__global__ void ce_backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                                   const float* __restrict__ lse, const float* __restrict__ grad,
                                   T* __restrict__ dlogits, int64_t vocab, int64_t vocab_start) {
  const int64_t row = blockIdx.x;
  const int64_t label = labels[row];
  const float g = label >= 0 ? grad[row] : 0.f;
  const float row_lse = lse[row];
  const int64_t target = label >= 0 ? label - vocab_start : -1;
  const T* in = logits + row * vocab;
  T* out = dlogits + row * vocab;
  for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vocab / VEC;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const Vec<T, VEC> v = load_vec<T, VEC>(in + i * VEC);
    Vec<T, VEC> d;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float p = expf(to_float(v.v[j]) - row_lse);
      const float onehot = (i * VEC + j == target) ? 1.f : 0.f;
      d.v[j] = from_float<T>(g * (p - onehot));
    }
    store_vec<T, VEC>(out + i * VEC, d);
  }
}

template <typename T>
bool ce_vectorisable(int64_t vocab, const void* a, const void* b) {
  constexpr int vec = vec_width<T>();
  return vocab % vec == 0 && aligned_to(a, sizeof(T) * vec) && aligned_to(b, sizeof(T) * vec);
}

// Blocks per row along the vocab (grid.y): enough for ~8 blocks per SM in total.
inline unsigned ce_backward_column_blocks(int64_t rows, int64_t items, int threads) {
  const int64_t needed = (items + threads - 1) / threads;
  int64_t target = (static_cast<int64_t>(device_sm_count()) * 8 + rows - 1) / (rows > 0 ? rows : 1);
  if (target < 1) target = 1;
  const int64_t blocks = needed < target ? needed : target;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

}  // namespace

cudaError_t cross_entropy_forward(DType dtype, const void* logits, const int64_t* labels, float* local_max,
                                  float* local_sum, float* target_logit, int64_t rows, int64_t vocab,
                                  int64_t vocab_start, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* in = static_cast<const scalar_t*>(logits);
    if (ce_vectorisable<scalar_t>(vocab, logits, nullptr)) {
      ce_forward_kernel<scalar_t, vec><<<static_cast<unsigned>(rows), threads_for(vocab / vec, 512), 0, stream>>>(
          in, labels, local_max, local_sum, target_logit, vocab, vocab_start);
    } else {
      ce_forward_kernel<scalar_t, 1><<<static_cast<unsigned>(rows), threads_for(vocab, 512), 0, stream>>>(
          in, labels, local_max, local_sum, target_logit, vocab, vocab_start);
    }
    return cudaGetLastError();
  });
}

cudaError_t cross_entropy_backward(DType dtype, const void* logits, const int64_t* labels, const float* lse,
                                   const float* grad, void* dlogits, int64_t rows, int64_t vocab, int64_t vocab_start,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int threads = 256;
  return MEGASCALE_DISPATCH(dtype, [&] {
    constexpr int vec = vec_width<scalar_t>();
    const auto* in = static_cast<const scalar_t*>(logits);
    auto* out = static_cast<scalar_t*>(dlogits);
    if (ce_vectorisable<scalar_t>(vocab, logits, dlogits)) {
      const dim3 grid(static_cast<unsigned>(rows), ce_backward_column_blocks(rows, vocab / vec, threads));
      ce_backward_kernel<scalar_t, vec><<<grid, threads, 0, stream>>>(in, labels, lse, grad, out, vocab, vocab_start);
    } else {
      const dim3 grid(static_cast<unsigned>(rows), ce_backward_column_blocks(rows, vocab, threads));
      ce_backward_kernel<scalar_t, 1><<<grid, threads, 0, stream>>>(in, labels, lse, grad, out, vocab, vocab_start);
    }
    return cudaGetLastError();
  });
}

}  // namespace megascale
