#!/usr/bin/env bash
# Prepares a DeepGEMM checkout for benchmarks/bench_gemm.py --deepgemm DIR: DeepGEMM's FP8
# grouped GEMMs (deepseek-ai/DeepGEMM, a PyTorch library) timed on the same quantised operands
# in the same run.
#
#   benchmarks/deepgemm.sh [DIR]      (default: .deepgemm)
#
# The pinned commit (June 2025) is the last whose Python front end needs no C++ extension: its
# kernels are compiled at run time with nvcc and launched through torch and cuda-python
# (cuda.bindings). Only its deep_gemm/ package is taken. Its kernels include CUTLASS's CuTe
# headers: deep_gemm/include/cute and .../cutlass become links to CUTLASS_INCLUDE (default
# .cutlass/include, the headers the README fetches). When DIR already holds the package, the
# links alone are made again (links do not survive a copy to another machine).
# DEEPGEMM_SOURCE: a local clone to take the commit from (default: a clone from GitHub).
set -euo pipefail
DIR=${1:-.deepgemm}
COMMIT=0c88cd01392c1073c7049a97d6328c7bba9b3947
INC=${CUTLASS_INCLUDE:-.cutlass/include}
[ -d "$INC/cute" ] || { echo "deepgemm.sh: $INC/cute not found (set CUTLASS_INCLUDE)" >&2; exit 2; }
INC=$(cd "$INC" && pwd)
if [ ! -d "$DIR/deep_gemm" ]; then
  SRC=${DEEPGEMM_SOURCE:-}
  if [ -z "$SRC" ]; then
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    git clone -q https://github.com/deepseek-ai/DeepGEMM "$SRC"
  fi
  mkdir -p "$DIR"
  git -C "$SRC" archive "$COMMIT" deep_gemm LICENSE | tar -x -C "$DIR"
fi
ln -sfn "$INC/cute" "$DIR/deep_gemm/include/cute"
ln -sfn "$INC/cutlass" "$DIR/deep_gemm/include/cutlass"
echo "DeepGEMM $COMMIT in $DIR (CuTe from $INC)"
