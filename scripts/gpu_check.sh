#!/usr/bin/env bash
# Build, check and benchmark jax_ep on a GPU machine in one call. Logs go to $OUT.
#   scripts/gpu_check.sh [build] [kernel] [test] [gemm] [moe] [mp] [ucx] [example] [bench]
#                        [bench-quick] [bench-gemm] [bench-moe] [bench-moe-ranks] [bench-modes]
#                        [bench-layer] [bench-fused-backward] [layer-memory] [probe] [ab]
#   (default: build kernel test gemm moe mp example bench). gemm: the grouped-GEMM GPU suite;
#   moe: the MoE layer (moe_ffn) GPU suite; fused: the fused dispatch + grouped GEMM and grouped
#   GEMM + combine suite (tests/test_gpu_fused.py); leases: the call-site lease suite
#   (tests/test_gpu_leases.py); timeouts: waits that give up cleanly (tests/test_gpu_timeouts.py);
#   planted: builds with planted bugs 5 to 25 (csrc/testing/mutations.h
#   lists them), each against the tests that must catch it (PLANTED="M:TEST ..."; planted.log);
#   gemm-mutations: the grouped-GEMM and MoE suites with each planted GEMM bug (tests/conftest.py);
#   mutations: tests of the multi-rank suite, each in its own process, built with each planted
#   bug 1 to 4 of csrc/testing/mutations.h (MUTATIONS="1 2 3 4", MUTATION_K: the tests to run,
#   MUTATION_R: their rank count, 4); a table
#   of which tests catch which bug goes to $OUT/mutations.log;
#   bench-gemm: the grouped-GEMM benchmark (benchmarks/bench_gemm.py; GEMM_BENCH_ARGS), with
#   CUTLASS's example 57 in the same run when benchmarks/cutlass_example57.sh built it into
#   .cutlass/bin, and DeepGEMM when benchmarks/deepgemm.sh prepared .deepgemm;
#   bench-moe: the MoE layer benchmark (benchmarks/bench_moe.py; MOE_BENCH_ARGS);
#   bench-moe-ranks: the layer over the machine's GPUs, fused against communication and GEMMs
#   alone (benchmarks/bench_moe_ranks.py; MOE_RANKS, default all GPUs; MOE_RANKS_ARGS). The GPU
#   machines have no package index: the build takes CUTLASS's headers from .cutlass/ (include/
#   and tools/util/include/ of the nvidia-cutlass package) when that folder is there. mp: the per-process (one GPU per process,
#   NVSHMEM) suite, 2 and 4 processes, also with every peer forced remote (NVSHMEM puts / gets),
#   and the killed-process test: needs nvshmem4py. ucx: the per-process low-latency suite with
#   NVSHMEM's peer-to-peer transport off (NVSHMEM_DISABLE_P2P=1) and its UCX transport over TCP
#   on the loopback device instead (needs the libucx-cu13 wheel): peers are then remote for
#   real, not by JAX_EP_FORCE_REMOTE_PEERS.
#   bench-layer: the layer against its expert compute and the plain-JAX layers, forward,
#   forward + backward and step memory (benchmarks/bench_layer.py; LAYER_RANKS, default
#   1,2,4; LAYER_ARGS; XLA may use 90 % of each GPU's memory there).
#   bench-fused-backward: the layer's backward on the fused kernels against the unfused ops
#   (JAX_EP_FUSED_BACKWARD=0), paired rounds in one process (benchmarks/fused_ab.py; the
#   machine's GPUs, LAYER_RANKS to choose).
#   layer-memory: the memory XLA plans for the layer's step over 2, 4 and 8 GPUs (MEMORY_RANKS),
#   compiled on JAX's mock GPU client on this machine's first GPU, nothing run
#   (benchmarks/bench_layer.py --mock-topology; a minute in all).
#   probe: NVLink all-to-all bandwidth per method (benchmarks/nvlink_probe.cu; PROBE_ARGS).
#   ab: a kernel A/B in one call, after build: a base is built beside the installed tree
#   (pip --target /tmp/jax_ep_ab_base) from a copy of this tree with the files of AB_BASE put
#   in their places (a folder at the repository's paths, for instance .out/ab_base as
#   scripts/ab_base.sh REV fills it; AB_BASE/.ab-delete lists files the base lacks); then
#   AB_CMD (a bash command run in /tmp, $R the repository) AB_ROUNDS times (2) under each build
#   in turn, every line of it into $OUT/ab.log behind "new i |" or "base i |" (AB_PIP_ARGS:
#   more pip arguments for the base's build).
# Extra args: PYTEST_K="ll_ or layout" (a -k expression, test and mp stages);
# PYTEST_ARGS="--maxfail=3";
# BENCH_ARGS="--ranks 4".
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
# A test that deadlocks fails after a minute, not after the 10-minute default
export JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-60}
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
stages=${*:-build kernel test gemm moe mp example bench}
[ -d .cutlass/include ] && export JAX_EP_CUTLASS_DIR=${JAX_EP_CUTLASS_DIR:-$PWD/.cutlass}
rc=0
step() { echo; echo "=== $1 ($(date +%T))"; }
# nvshmem4py (the per-process tests need it) from a wheel carried in .whl/nvshmem/ when the
# machine lacks it
need_nvshmem4py() {
  if ! $PY -c "import nvshmem.core" 2>/dev/null && [ -d .whl/nvshmem ]; then
    $PY -m pip install -q --no-deps --no-index .whl/nvshmem/*.whl
  fi
}
has() { [[ " $stages " == *" $1 "* ]]; }

if has build; then
  step build
  nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.txt"
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  if ! CMAKE_BUILD_PARALLEL_LEVEL=16 $PY -m pip install --no-build-isolation --no-deps -v \
      -C cmake.define.JAX_EP_MUTATION=0 . \
      > "$OUT/build.log" 2>&1; then
    tail -80 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
  grep -E "ptxas info|spill" "$OUT/build.log" | tail -20
  (cd /tmp && $PY -c "import jax_ep, json; print(json.dumps(jax_ep.runtime_info(), indent=1))")
  if ! (cd /tmp && $PY -c "import sys; from jax_ep import _C; sys.exit(not _C.gemm_built())"); then
    echo "WARNING: built without the CUTLASS GEMMs (no .cutlass/include, no nvidia-cutlass):"
    echo "         every grouped-GEMM and fused test and benchmark will fail"; rc=1
  fi
fi
if has kernel; then
  step "layout kernel through FFI vs reference"
  (cd /tmp && $PY -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_gpu.py" \
     -k layout_kernel 2>&1 | tail -5) || rc=1
fi
if has test; then
  step "GPU test suite"
  (cd /tmp && timeout 540 $PY -m pytest -q -p no:cacheprovider -m gpu "$OLDPWD/tests/test_gpu.py" \
     ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40) || rc=1
fi
if has gemm; then
  step "grouped-GEMM GPU suite"
  (cd /tmp && timeout ${GEMM_TEST_TIMEOUT:-540} $PY -m pytest -q -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_gpu_gemm.py" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gemm_tests.log" \
     | tail -30) || rc=1
fi
if has fused; then
  step "fused kernels GPU suite"
  (cd /tmp && timeout 540 $PY -m pytest -q -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_gpu_fused.py" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 \
     | tee "$OUT/fused_tests.log" | tail -30) || rc=1
fi
if has leases; then
  step "call-site lease GPU suite"
  (cd /tmp && timeout 540 $PY -m pytest -q -s -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_gpu_leases.py" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/lease_tests.log" \
     | tail -15) || rc=1
fi
if has timeouts; then
  step "timeout GPU suite"
  (cd /tmp && timeout 540 $PY -m pytest -q -s -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_gpu_timeouts.py" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/timeout_tests.log" \
     | tail -15) || rc=1
fi
if has planted; then
  step "planted-bug check: each planted bug (csrc/testing/mutations.h: 5 to 25) must fail its tests"
  # MUTATION:TEST pairs, each test in a process of its own (table: planted.log). Bug 16's layer
  # case is the low-latency one: the high-throughput layer may raise the timeout from its step
  # before any result exists, and then passes whether its results are poisoned or not.
  L=tests/test_gpu_leases.py
  P=tests/test_gpu_timeouts.py::test_the_results_of_an_op_that_gave_up_are_poisoned
  pairs="${PLANTED:-5:$L::test_130_low_latency_call_sites_and_two_high_throughput_in_one_program
    5:$L::test_dropped_programs_give_their_slots_and_memory_back
    6:$L::test_130_low_latency_call_sites_and_two_high_throughput_in_one_program
    6:$L::test_dropped_programs_give_their_slots_and_memory_back
    7:tests/test_gpu.py::test_ll_combine_never_reads_past_a_tampered_handle
    8:tests/test_gpu_timeouts.py::test_a_wait_that_times_out_raises_and_keeps_the_context
    9:tests/test_multiprocess.py::test_a_process_compiling_an_extra_program_fails_every_compile_clearly
    10:tests/test_multiprocess.py::test_a_process_compiling_an_extra_program_fails_every_compile_clearly[remote]
    11:tests/test_gpu_fused.py::test_fused_dispatch_matmul_matches_unfused
    12:tests/test_gpu_fused.py::test_fused_matmul_combine_matches_unfused
    13:tests/test_gpu_fused.py::test_fused_dispatch_matmul_matches_unfused
    14:tests/test_gpu_gemm.py::test_fp8_matches_reference
    15:tests/test_gpu_fused.py::test_fused_grids_take_each_virtual_rank_share_of_the_sms
    16:$P[ll_dispatch]
    16:$P[ht_dispatch]
    16:$P[ll_combine_split]
    16:$P[ht_gemm_combine]
    16:$P[moe_ffn_ll]
    17:tests/test_gpu_fused.py::test_fused_matmul_combine_matches_unfused
    18:tests/test_gpu_fused.py::test_fused_activation_epilogue_matches_swiglu_of_h
    19:tests/test_gpu_fused.py::test_fused_first_half_without_a_gradient_leaves_h_unwritten
    20:tests/test_gpu_fused.py::test_fused_matmul_combine_top_k_fills_and_passes_a_slot_group
    21:tests/test_gpu_fused.py::test_fused_matmul_combine_adds_its_addend_only_when_on
    22:tests/test_gpu_fused.py::test_fused_matmul_combine_matches_unfused
    23:tests/test_gpu.py::test_expert_positions_kernel_matches_the_xla_plan
    24:tests/test_gpu_fused.py::test_fused_matmul_combine_top_k_fills_and_passes_a_slot_group
    24:tests/test_gpu_fused.py::test_fused_matmul_combine_full_rows_of_top_8
    25:tests/test_gpu_fused.py::test_fused_dispatch_matmul_matches_unfused}"
  : > "$OUT/planted.log"
  need_nvshmem4py
  set -f   # test ids hold [...]: no globbing of them
  # Every planted build at once, each in a build folder of its own (the planted bug must never
  # reach the real build's CMake cache), the machine's cores shared between them: one after the
  # other they took longer than the tests.
  # bugs 11 to 22, 24 and 25 sit in the CUTLASS GEMMs or the fused kernels: their builds need them
  needs_gemm() { { [ "$1" -ge 11 ] && [ "$1" -le 22 ]; } || [ "$1" -ge 24 ]; }
  ms=$(for pair in $pairs; do echo "${pair%%:*}"; done | sort -un)
  nb=$(echo $ms | wc -w); jobs=$(( $(nproc) / nb )); [ $jobs -ge 2 ] || jobs=2
  for m in $ms; do
    dst=/tmp/jax_ep_mutation$m; rm -rf "$dst"
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs $PY -m pip install -v --no-build-isolation --no-deps \
        --target "$dst" -C build-dir=/tmp/jax_ep_mutation_build$m \
        -C cmake.define.JAX_EP_MUTATION=$m \
        -C cmake.define.JAX_EP_WITH_GEMM=$(needs_gemm "$m" && echo ON || echo OFF) \
        . > "$OUT/build_mutation$m.log" 2>&1 && touch "$dst.ok" &
  done
  wait
  usable=" "
  for m in $ms; do
    if [ ! -e "/tmp/jax_ep_mutation$m.ok" ]; then
      echo "  mutation $m: BUILD FAILED" | tee -a "$OUT/planted.log"; rc=1
    elif ! (cd /tmp && PYTHONPATH="/tmp/jax_ep_mutation$m" $PY -c "import sys; from jax_ep import _C
sys.exit(_C.planted_bug() != $m)"); then
      echo "  mutation $m: the tests would not import the planted build" | tee -a "$OUT/planted.log"
      rc=1
    elif needs_gemm "$m" && ! (cd /tmp && PYTHONPATH="/tmp/jax_ep_mutation$m" $PY -c "import sys
from jax_ep import _C; sys.exit(not _C.gemm_built())"); then
      # (its tests would fail on the missing kernels, whatever the bug: a false catch)
      echo "  mutation $m: built without the CUTLASS GEMMs (no .cutlass/include?)" \
        | tee -a "$OUT/planted.log"
      rc=1
    else
      usable="$usable$m "
    fi
    rm -f "/tmp/jax_ep_mutation$m.ok"
  done
  for pair in $pairs; do
    m=${pair%%:*}; t=${pair#*:}
    dst=/tmp/jax_ep_mutation$m
    [[ "$usable" == *" $m "* ]] || continue
    log="$OUT/planted_${m}_$(echo "${t##*::}" | tr -c 'A-Za-z0-9_.\n-' '_').log"
    (cd /tmp && PYTHONPATH="$dst" JAX_EP_TIMEOUT_S=5 timeout ${MUTATION_TIMEOUT:-200} $PY -m pytest \
       -q -p no:cacheprovider -m gpu "$OLDPWD/$t" > "$log" 2>&1)
    r=$?
    if [ $r -eq 0 ] && grep -q " skipped" "$log" && ! grep -q " passed" "$log"; then
      v="NOT RUN (skipped)"; rc=1
    elif [ $r -eq 4 ] || [ $r -eq 5 ]; then  # pytest: usage error / nothing collected
      v="NOT RUN (pytest exit $r: no such test?)"; rc=1
    elif [ $r -eq 0 ]; then v="missed (passed)"; else v="caught (exit $r)"; fi
    echo "  mutation $m, ${t##*::}: $v" | tee -a "$OUT/planted.log"
  done
  set +f
fi
if has moe; then
  step "MoE layer GPU suite"
  (cd /tmp && timeout ${MOE_TEST_TIMEOUT:-540} $PY -m pytest -q -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_gpu_moe.py" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/moe_tests.log" \
     | tail -30) || rc=1
fi
if has gemm-mutations; then
  step "grouped-GEMM mutation check: each planted bug must fail tests"
  for m in ${GEMM_MUTATIONS:-shift_sizes drop_last_group masked_no_zero_fill ignore_row_counts drop_accumulation}; do
    (cd /tmp && JAX_EP_GEMM_MUTATION=$m timeout 200 $PY -m pytest -q -p no:cacheprovider -m gpu \
       "$OLDPWD/tests/test_gpu_gemm.py" \
       -k "${GEMM_MUTATION_K:-forward or masked or gradient}" \
       2>&1 | tail -1 | sed "s/^/  $m: /") | tee -a "$OUT/gemm_mutations.log"
    # (the MoE suite cannot catch ignore_row_counts: the layer's padding rows are zeros, so only
    # the time changes)
    [ $m = ignore_row_counts ] && continue
    (cd /tmp && JAX_EP_GEMM_MUTATION=$m timeout 200 $PY -m pytest -q -p no:cacheprovider -m gpu \
       "$OLDPWD/tests/test_gpu_moe.py" 2>&1 | tail -1 | sed "s/^/  $m (moe_ffn): /") \
       | tee -a "$OUT/gemm_mutations.log"
  done
fi
if has mutations; then
  step "multi-rank mutation check: each planted bug (csrc/testing/mutations.h) must fail tests"
  # Each selected test at R = MUTATION_R in a process of its own: a planted bug may leave its
  # process unable to communicate (a wait that times out fails every later op), and the rest
  # must still run. Table: mutations.log.
  sel="${MUTATION_K:-scan_back_to_back or two_in_flight or gradients or fresh_buffers or (ll_matches_reference and 128-128-True and random)}"
  : > "$OUT/mutations.log"
  set -f   # test ids hold [...]: no globbing of them
  for m in ${MUTATIONS:-1 2 3 4}; do
    dst=/tmp/jax_ep_mutation$m; rm -rf "$dst"
    # A build folder of its own: the planted bug must never reach the real build's CMake cache.
    if ! CMAKE_BUILD_PARALLEL_LEVEL=16 $PY -m pip install -v --no-build-isolation --no-deps \
        --target "$dst" -C build-dir=/tmp/jax_ep_mutation_build$m \
        -C cmake.define.JAX_EP_MUTATION=$m -C cmake.define.JAX_EP_WITH_GEMM=OFF -C build.verbose=true \
        . > "$OUT/build_mutation$m.log" 2>&1 || ! grep -q "planted bug JAX_EP_MUTATION=$m" "$OUT/build_mutation$m.log"; then
      echo "  mutation $m: BUILD FAILED"; tail -20 "$OUT/build_mutation$m.log"; rc=1; continue
    fi
    if ! (cd /tmp && PYTHONPATH="$dst" $PY -c "import jax_ep, sys; from jax_ep import _C
sys.exit(_C.planted_bug() != $m or not jax_ep.__file__.startswith('$dst'))"); then
      echo "  mutation $m: the tests would not import the build with the planted bug"; rc=1; continue
    fi
    ids=$(cd /tmp && PYTHONPATH="$dst" $PY -m pytest -q --collect-only -p no:cacheprovider -m gpu \
          "$OLDPWD/tests/test_gpu.py" -k "$sel" 2>"$OUT/mutation${m}_collect.log" | grep "::" \
          | sed 's/^.*:://' | grep -E "[-[]${MUTATION_R:-4}(-(True|False))?\]$")
    caught=0; n=0
    for id in $ids; do
      n=$((n + 1))
      log="$OUT/mutation${m}_$n.log"
      (cd /tmp && PYTHONPATH="$dst" JAX_EP_TIMEOUT_S=5 timeout ${MUTATION_TIMEOUT:-120} $PY -m pytest -q \
         -p no:cacheprovider -m gpu "$OLDPWD/tests/test_gpu.py::$id" > "$log" 2>&1)
      r=$?
      # pytest: 0 passed, 1 failures, 2-5 usage / collection errors; 124 the timeout; > 128 a
      # signal (an illegal memory access can end the process that way)
      if [ $r -eq 0 ]; then v="missed (passed)"
      elif [ $r -ge 2 ] && [ $r -le 5 ]; then v="ERROR (pytest exit $r: see $log)"; rc=1
      elif grep -q "timed out after" "$log"; then v="caught (a wait timed out)"; caught=$((caught + 1))
      elif [ $r -eq 124 ]; then v="caught (hung until the timeout)"; caught=$((caught + 1))
      elif [ $r -eq 1 ]; then v="caught (wrong result)"; caught=$((caught + 1))
      else v="caught (process ended, exit $r)"; caught=$((caught + 1)); fi
      echo "  mutation $m: $id: $v" | tee -a "$OUT/mutations.log"
    done
    [ "$n" -gt 0 ] || { echo "  mutation $m: no test selected"; rc=1; }
    echo "  mutation $m: caught by $caught of $n tests" | tee -a "$OUT/mutations.log"
  done
  set +f
fi
if has mp; then
  step "per-process suite (jax_ep.launch, NVSHMEM)"
  need_nvshmem4py
  (cd /tmp && timeout 900 $PY -m pytest -q -p no:cacheprovider -m gpu \
     "$OLDPWD/tests/test_multiprocess.py" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 \
     | tee "$OUT/mp_tests.log" | tail -40) || rc=1
fi
if has ucx; then
  step "per-process suite, peers remote over NVSHMEM's UCX transport (TCP, loopback)"
  UCX_LIB=$($PY -c "import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), 'lib'))")
  (cd /tmp && NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx UCX_TLS=tcp,cuda_copy,self \
     UCX_NET_DEVICES=lo NVSHMEM_DEBUG=WARN JAX_EP_DEBUG=1 LD_LIBRARY_PATH="$UCX_LIB:$UCX_LIB/ucx:${LD_LIBRARY_PATH:-}" \
     JAX_EP_MP_ONLY=${UCX_CHECKS:-ll} JAX_EP_TIMEOUT_S=60 timeout 300 $PY -m jax_ep.launch -n 2 \
     --grace 30 "$OLDPWD/tests/mp_worker.py" 2>&1 | tee "$OUT/ucx.log" | tail -40) || rc=1
fi
if has example; then
  step "example on GPUs"
  (cd /tmp && timeout 300 $PY "$OLDPWD/examples/moe_layer.py" --steps 30 --tokens 512 \
     --hidden 1024 --ffn 2048 --experts-per-device 4 --topk 4 2>&1 | tail -6) || rc=1
  (cd /tmp && timeout 300 $PY "$OLDPWD/examples/decode_step.py" --steps 50 --tokens 128 \
     --hidden 7168 --ffn 512 --experts-per-device 8 --topk 8 2>&1 | tail -3) || rc=1
  # Flax (the [flax] extra): from wheels carried in .whl/flax/ when the machine lacks it, each
  # installed only when its module is missing.
  if ! $PY -c "import flax.nnx" 2>/dev/null && [ -d .whl/flax ]; then
    for w in .whl/flax/*.whl; do
      mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z' | sed 's/^pyyaml$/yaml/; s/^markdown_it_py$/markdown_it/')
      $PY -c "import $mod" 2>/dev/null || $PY -m pip install -q --no-deps --no-index "$w"
    done
  fi
  (cd /tmp && timeout 300 $PY "$OLDPWD/examples/flax_moe_block.py" --steps 30 --batch 16 \
     --seq 64 --hidden 512 --ffn 512 2>&1 | tail -4) || rc=1
fi
if has bench; then
  step benchmark
  (cd /tmp && timeout 560 $PY "$OLDPWD/benchmarks/bench.py" --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
     | tee "$OUT/bench.log" | tail -45) || rc=1
fi
if has bench-quick; then
  step "benchmark (quick)"
  (cd /tmp && timeout 560 $PY "$OLDPWD/benchmarks/bench.py" --out "$OUT" --sms 24 132 --iters 10 \
     --reps 5 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -45) || rc=1
fi
if has bench-gemm; then
  step "grouped-GEMM benchmark"
  DG=
  if [ -d .deepgemm/deep_gemm ] && bash benchmarks/deepgemm.sh .deepgemm; then
    DG="--deepgemm $PWD/.deepgemm"
  fi
  (cd /tmp && timeout ${GEMM_BENCH_TIMEOUT:-580} $PY "$OLDPWD/benchmarks/bench_gemm.py" --out "$OUT" \
     --cutlass-bin "$OLDPWD/.cutlass/bin" $DG ${GEMM_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gemm.log" \
     | tail -45) || rc=1
fi
if has bench-moe; then
  step "MoE layer benchmark (one GPU)"
  (cd /tmp && timeout ${MOE_BENCH_TIMEOUT:-580} $PY "$OLDPWD/benchmarks/bench_moe.py" --out "$OUT" \
     ${MOE_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_moe.log" | tail -30) || rc=1
fi
if has bench-moe-ranks; then
  step "MoE layer benchmark over the GPUs (fused vs communication and GEMMs)"
  (cd /tmp && timeout ${MOE_BENCH_TIMEOUT:-580} $PY "$OLDPWD/benchmarks/bench_moe_ranks.py" \
     --ranks ${MOE_RANKS:-$(nvidia-smi -L | wc -l)} --out "$OUT" ${MOE_RANKS_ARGS:-} 2>&1 \
     | tee "$OUT/bench_moe_ranks.log" | tail -12) || rc=1
fi
if has bench-layer; then
  step "MoE layer against its expert compute and plain-JAX layers"
  (cd /tmp && XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${LAYER_BENCH_TIMEOUT:-580} \
     $PY "$OLDPWD/benchmarks/bench_layer.py" --ranks ${LAYER_RANKS:-1,2,4} --out "$OUT" \
     ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layer.log" | tail -40) || rc=1
fi
if has bench-fused-backward; then
  step "MoE layer: the backward on the fused kernels against the unfused ops"
  n=$(nvidia-smi -L | wc -l)
  (cd /tmp && XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${LAYER_BENCH_TIMEOUT:-580} \
     $PY "$OLDPWD/benchmarks/fused_ab.py" --baseline env:JAX_EP_FUSED_BACKWARD=0 \
     --ranks ${LAYER_RANKS:-$( [ "$n" -ge 4 ] && echo 4,2 || echo "$n")} --tag _backward \
     --out "$OUT" 2>&1 | tee "$OUT/fused_backward_ab.log" | tail -20) || rc=1
fi
if has layer-memory; then
  step "MoE layer: memory plans over ${MEMORY_RANKS:-2 4 8} GPUs (mock GPU client, compiled only)"
  for r in ${MEMORY_RANKS:-2 4 8}; do
    (cd /tmp && timeout 300 $PY "$OLDPWD/benchmarks/bench_layer.py" --ranks "$r" \
       --mock-topology "1x${r}x1" --routing uniform --only "moe_ffn,expert compute alone" \
       --out "$OUT/layer_memory_r$r" 2>&1 | tee "$OUT/layer_memory_r$r.log" \
       | grep -E "^device|^==|moe_ffn |expert compute|ratios") || rc=1
  done
fi
if has bench-modes; then
  step "benchmark: one process vs one process per GPU"
  (cd /tmp && timeout 580 $PY "$OLDPWD/benchmarks/bench_modes.py" --ranks ${MODES_RANKS:-4} \
     --out "$OUT" -- ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_modes.log" | tail -40) || rc=1
fi
if has probe; then
  step "NVLink all-to-all bandwidth per method"
  nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/nvlink_probe benchmarks/nvlink_probe.cu \
    && timeout 300 /tmp/nvlink_probe --json "$OUT/nvlink_probe.json" ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/nvlink_probe.log" | tail -40 || rc=1
fi
if has ab; then
  step "kernel A/B: this tree against its files in ${AB_BASE:-(AB_BASE unset)}"
  if [ -z "${AB_BASE:-}" ] || [ ! -d "$AB_BASE" ] || [ -z "${AB_CMD:-}" ]; then
    echo "ab: AB_BASE must name a folder and AB_CMD a command"; rc=1
  else
    base=$(cd "$AB_BASE" && pwd) src=/tmp/jax_ep_ab_src prefix=/tmp/jax_ep_ab_base
    rm -rf "$src" "$prefix" && mkdir -p "$src"
    tar --exclude=./.git --exclude=./.out --exclude=./.whl --exclude=./.cutlass -cf - . \
      | tar -xf - -C "$src"
    cp -a "$base/." "$src/"
    if [ -f "$base/.ab-delete" ]; then (cd "$src" && xargs -r rm -f < "$base/.ab-delete"); fi
    if (cd "$src" && CMAKE_BUILD_PARALLEL_LEVEL=16 $PY -m pip install --no-build-isolation \
        --no-deps -v --target "$prefix" -C build-dir=/tmp/jax_ep_ab_build \
        -C cmake.define.JAX_EP_MUTATION=0 ${AB_PIP_ARGS:-} . > "$OUT/ab_build.log" 2>&1); then
      : > "$OUT/ab.log"
      # the base's runs must import the base (an editable install of the tree would win)
      got=$(cd /tmp && PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}" $PY -c \
        "import jax_ep; print(jax_ep.__file__)" 2>&1)
      case "$got" in
        "$prefix"/*) echo "ab: the base imports $got" ;;
        *) echo "ab: the base's runs would import $got, not the base in $prefix"; rc=1
           AB_ROUNDS=0 ;;
      esac
      for i in $(seq "${AB_ROUNDS:-2}"); do
        for v in new base; do
          pp=""; [ "$v" = base ] && pp="$prefix${PYTHONPATH:+:$PYTHONPATH}"
          (cd /tmp && R="$OLDPWD" PYTHONPATH="${pp:-${PYTHONPATH:-}}" bash -c "$AB_CMD" 2>&1 \
             | sed "s/^/$v $i | /" >> "$OUT/ab.log") || rc=1
        done
      done
      tail -40 "$OUT/ab.log"
    else
      tail -40 "$OUT/ab_build.log"; echo "ab: the base's build failed"; rc=1
    fi
  fi
fi
exit $rc
