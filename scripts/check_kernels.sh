#!/usr/bin/env bash
# Compile-check megascale's CUDA kernels without a GPU.
#
#   scripts/check_kernels.sh            # every csrc/*.cu for sm_80 and sm_90
#   CHECK_BINDINGS=1 scripts/check_kernels.sh   # also syntax-check csrc/bindings.cpp
#
# The .cu files include only CUDA headers, so `nvcc -c` works wherever the CUDA
# toolkit is installed. The bindings need torch headers; a CPU build of torch
# lacks c10/cuda/impl/cuda_cmake_macros.h, so the optional bindings check
# supplies an empty stand-in for that one generated header.
# Exits non-zero if anything fails to compile.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC="$ROOT/csrc"
NVCC="${NVCC:-nvcc}"
ARCHS="${ARCHS:-80 90}"
JOBS="${JOBS:-2}"
OUT="$(mktemp -d /tmp/megascale_kernels_check.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

command -v "$NVCC" >/dev/null || { echo "check_kernels: $NVCC not found on PATH" >&2; exit 2; }

gencode=()
for arch in $ARCHS; do gencode+=("-gencode" "arch=compute_${arch},code=sm_${arch}"); done

compile_one() {
  local src="$1" name
  name="$(basename "$src" .cu)"
  if "$NVCC" -std=c++17 -O3 -I"$CSRC" "${gencode[@]}" -c "$src" -o "$OUT/$name.o" >"$OUT/$name.log" 2>&1; then
    echo "ok    $name.cu (sm_${ARCHS// /, sm_})"
  else
    echo "FAIL  $name.cu" >&2
    cat "$OUT/$name.log" >&2
    return 1
  fi
}

# One nvcc per source (both architectures in it), at most $JOBS at a time.
pids=()
status=0
for src in "$CSRC"/*.cu; do
  compile_one "$src" &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

if [[ "${CHECK_BINDINGS:-0}" == "1" ]]; then
  torch_include="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
  # Ask nvcc where its own headers are (wrappers and target dirs vary).
  cuda_include="$("$NVCC" -v -x cu -E /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)"
  mkdir -p "$OUT/stub/c10/cuda/impl"
  echo '#pragma once' >"$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
  if g++ -std=c++20 -fsyntax-only -I"$OUT/stub" -I"$torch_include" -I"$torch_include/torch/csrc/api/include" \
      -I"$cuda_include" $(python3-config --includes) -DTORCH_EXTENSION_NAME=megascale_kernels \
      "$CSRC/bindings.cpp" >"$OUT/bindings.log" 2>&1; then
    echo "ok    bindings.cpp (syntax)"
  else
    echo "FAIL  bindings.cpp" >&2
    cat "$OUT/bindings.log" >&2
    status=1
  fi
fi

exit $status
