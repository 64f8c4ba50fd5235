#!/usr/bin/env bash
# Same-run A/B of low-latency kernel variants that environment variables select, on one machine:
#   scripts/ll_ab.sh "base:" "noprereduce:JAX_EP_LL_PREREDUCE=0" "base2:" ...
# Each argument NAME:VAR=VALUE... runs benchmarks/bench.py --mode ll --ll-fused-only
# --kernel-times once with those variables set (run from /tmp, so the installed jax_ep is used),
# and the table rows of every run are printed together at the end. Repeat the base first and
# last: the spread between them is the run's drift. AB_ARGS replaces the bench arguments
# (default: --ranks 4 --iters 20 --reps 10); AB_TRACE=1 also runs
# benchmarks/trace_phases.py --ll-only --absolute (JAX_EP_LL_DIAG=1) for every variant.
# Logs: $OUT/ab-NAME.log (and ab-NAME-trace.log).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
SRC=$PWD
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
read -r -a bench_args <<< "${AB_ARGS:---ranks 4 --iters 20 --reps 10}"
for spec in "$@"; do
  name=${spec%%:*}; vars=${spec#*:}
  read -r -a envs <<< "$vars"
  echo "=== $name ($vars) $(date +%T)"
  (cd /tmp && env "${envs[@]}" timeout 240 $PY "$SRC/benchmarks/bench.py" --mode ll \
     --ll-fused-only --kernel-times "${bench_args[@]}" --out "$OUT" --tag="-$name" \
     > "$OUT/ab-$name.log" 2>&1) || echo "  (bench exited non-zero: see ab-$name.log)"
  rm -rf "$OUT/traces"  # many files; the kernel durations are in the log
  if [[ ${AB_TRACE:-0} == 1 ]]; then
    (cd /tmp && env "${envs[@]}" JAX_EP_LL_DIAG=1 timeout 120 \
       $PY "$SRC/benchmarks/trace_phases.py" --ranks 4 --scan 20 --ll-only --absolute \
       > "$OUT/ab-$name-trace.log" 2>&1) \
      || echo "  (trace exited non-zero)"
  fi
done
echo
echo "| variant | mode | GPUs | op | impl | SMs | median us | wall us | recv GB/s | vs a2a |" \
     "vs ragged | kernel us | all kernels us |"
for spec in "$@"; do
  name=${spec%%:*}
  grep -E "^\| ll \|" "$OUT/ab-$name.log" | grep -v harness | sed "s/^/| $name /"
done
