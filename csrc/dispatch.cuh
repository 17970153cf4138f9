// DType tag -> C++ type dispatch for the launchers.
#pragma once

#include "common.cuh"
#include "kernels.h"

// Runs BODY with `scalar_t` bound to the element type of DTYPE.
#define MEGASCALE_DISPATCH(DTYPE, ...)                      \
  [&]() -> cudaError_t {                                    \
    switch (DTYPE) {                                        \
      case ::megascale::DType::kFloat32: {                  \
        using scalar_t = float;                             \
        return __VA_ARGS__();                               \
      }                                                     \
      case ::megascale::DType::kFloat16: {                  \
        using scalar_t = __half;                            \
        return __VA_ARGS__();                               \
      }                                                     \
      case ::megascale::DType::kBFloat16: {                 \
        using scalar_t = __nv_bfloat16;                     \
        return __VA_ARGS__();                               \
      }                                                     \
    }                                                       \
    return cudaErrorInvalidValue;                           \
  }()

namespace megascale {

// Vector width giving 16-byte loads of T.
template <typename T>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(T));
}

inline int device_sm_count() {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
  return sms > 0 ? sms : 1;
}

}  // namespace megascale
