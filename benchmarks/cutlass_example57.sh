#!/usr/bin/env bash
# Builds CUTLASS's own SM90 grouped-GEMM example (example 57 of the nvidia-cutlass package) as a
# same-run baseline for benchmarks/bench_gemm.py, which runs every binary it finds in OUT_DIR.
#
#   benchmarks/cutlass_example57.sh [OUT_DIR]      (default: .cutlass/bin)
#
# Three binaries, from the example's source as the package ships it:
#   ex57_fp8         unchanged: e4m3 x e5m2, fast accumulation, no block scales, f16 out
#   ex57_bf16_k64    bf16 in and out, the example's tiles with a K step of 64
#   ex57_bf16_k128   bf16 in and out, the example's tiles unchanged (K step 128)
# The bf16 builds only swap the element types and drop the FP8 schedule suffix (sed below);
# each binary times a cooperative and a ping-pong kernel, with problem shapes on the host and
# read on the device. CUTLASS_SOURCE: the package's cutlass_library/source folder (default:
# the installed package's). Needs nvcc with sm_90a; the binaries need only the CUDA runtime,
# so they can be built here and carried to a GPU machine with .cutlass/. The example's device
# fills include curand_kernel.h: where the CUDA toolkit lacks it, point CURAND_INCLUDE at the
# include folder of the nvidia-curand package.
set -euo pipefail
OUT_DIR=${1:-.cutlass/bin}
SRC=${CUTLASS_SOURCE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')}
EX=$SRC/examples/57_hopper_grouped_gemm/57_hopper_grouped_gemm.cu
[ -f "$EX" ] || { echo "cutlass_example57.sh: $EX not found (set CUTLASS_SOURCE)" >&2; exit 2; }
NVCC=${NVCC:-nvcc}
mkdir -p "$OUT_DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

BF16='s/cutlass::float_e4m3_t;/cutlass::bfloat16_t;/; s/cutlass::float_e5m2_t;/cutlass::bfloat16_t;/; s/using ElementC = cutlass::half_t;/using ElementC = cutlass::bfloat16_t;/; s/FP8FastAccum//g'
K64='s/Shape<_256,_128,_128>/Shape<_256,_128,_64>/; s/Shape<_128,_128,_128>/Shape<_128,_128,_64>/'
cp "$EX" "$TMP/ex57_fp8.cu"
sed -e "$BF16" -e "$K64" "$EX" > "$TMP/ex57_bf16_k64.cu"
sed -e "$BF16" "$EX" > "$TMP/ex57_bf16_k128.cu"

build() {
  "$NVCC" -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -I"$SRC/include" -I"$SRC/tools/util/include" -I"$SRC/examples/common" \
    ${CURAND_INCLUDE:+-I"$CURAND_INCLUDE"} \
    -o "$OUT_DIR/$1" "$TMP/$1.cu"
}
pids=()
for name in ex57_fp8 ex57_bf16_k64 ex57_bf16_k128; do
  build "$name" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
ls -l "$OUT_DIR"
