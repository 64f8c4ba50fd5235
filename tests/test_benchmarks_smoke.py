"""Every benchmark script that can run without a GPU, run on a CPU as a user would run it.

Each script runs as a subprocess on the reference backend with tiny shapes (4 host devices,
PYTHONPATH at this checkout, output into a temporary folder) and must exit 0, write its JSON,
and print the line saying which CUDA-only parts it skipped. The figures mean nothing here; the
point is that no script can break unseen (bench.py's low-latency split combine once crashed
on GPUs with a TypeError that this test shows on a CPU).

A new file in benchmarks/ must be listed below, in SCRIPTS or in EXCLUDED with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

_COMM = ["--tokens", "16", "--hidden", "256", "--topk", "2", "--experts-per-rank", "2"]
_LL = ["--ll-tokens", "8"]
_MOE = ["--tokens", "16", "--hidden", "256", "--inter", "128", "--topk", "2"]

# script: (arguments, the JSON it writes into --out, lines it must print)
SCRIPTS = {
    # the command that crashed on 4 x H100, on the reference backend
    "bench.py": (["--backend", "reference", "--mode", "ht", "ll", "--ranks", "4", *_COMM, *_LL,
                  "--sms", "24", "132", "--iters", "4", "--reps", "1", "--overlap-matmul", "64",
                  "--kernel-times"],
                 "results.json", ["(--sms sweep skipped", "(lax.ragged_all_to_all baseline "
                                  "skipped: XLA:CPU"]),
    # one process over 2 host devices, then 2 processes (jax_ep.launch) of one each
    "bench_modes.py": (["--ranks", "2", "--", "--backend", "reference", "--mode", "ll",
                        "--ll-fused-only", *_COMM, *_LL, "--iters", "4", "--reps", "1"],
                       "results_modes.json", ["=== one process", "=== one per GPU"]),
    "bench_moe.py": (["--backend", "reference", *_MOE, "--experts", "4", "--quick",
                      "--rounds", "1", "--copy-blocks", "8"],
                     "bench_moe.json", ["(--copy-blocks / --combine-blocks skipped"]),
    "bench_moe_ranks.py": (["--backend", "reference", "--ranks", "4", *_MOE, "--experts", "2",
                            "--reps", "1", "--combine-blocks", "2"],
                           "bench_moe_ranks.json", ["(--copy-blocks / --combine-blocks skipped"]),
    "bench_gemm.py": (["--backend", "reference", "--quick", "--shapes", "256x256", "--rows",
                       "256", "--groups", "4", "--masked", "4,32,256,256", "--rounds", "1"],
                      "bench_gemm.json", ["reference backend: skipped the CUDA-only rows"]),
    "bench_layer.py": (["--backend", "reference", "--ranks", "2", "--routing", "zipf",
                        "--tokens", "8", "--hidden", "128", "--inter", "128", "--experts", "2",
                        "--topk", "2", "--reps", "1", "--rounds", "2", "--check-tokens", "4"],
                       "bench_layer.json", ["same-run ratios (medians of the rounds' ratios)",
                                            "2 paired rounds of"]),
    "layer_kernels.py": (["--backend", "reference", "--ranks", "2", "--tokens", "8", "--hidden",
                          "128", "--inter", "128", "--experts", "2", "--topk", "2", "--calls",
                          "1", "--routing", "balanced", "--timeline", "--only",
                          "moe_ffn(fused=True),expert compute alone"],
                         "layer_kernels.json", ["no GPU kernels in the trace (a CPU run)",
                                                "balanced routing"]),
    "bench_virtual.py": (["--backend", "reference", "--ranks", "2", *_COMM, *_LL, "--reps", "1"],
                         "bench_virtual.json", []),
    "fused_activation.py": (["--backend", "reference", "--ranks", "2", "--tokens", "8",
                             "--hidden", "128", "--inter", "128", "--experts", "2", "--topk",
                             "2", "--reps", "1"],
                            "fused_activation.json", ["(reference backend: no epilogue"]),
    "pass_loop_cost.py": (["--backend", "reference", "--ranks", "2", "--tokens", "8", "--hidden",
                           "128", "--inter", "128", "--experts", "2", "--topk", "2", "--rounds",
                           "1", "--scan", "1,2"],
                          "pass_loop_cost.json", ["one pass forced (no loop)"]),
    # the layout's placing step in XLA's ops alone (its CUDA kernels need a GPU)
    "layout_plan.py": (["--backend", "reference", "--ranks", "1,2", "--tokens", "8", "--experts",
                        "2", "--topk", "2", "--reps", "1", "--rounds", "1", "--trace", "1"],
                       "layout_plan.json", ["(reference backend: the CUDA kernels' row skipped)"]),
    # the program Nsight Compute profiles (docs/kernels.md#fused-kernels-profiled), on a CPU
    "ncu_layer.py": (["--backend", "reference", "--ranks", "2", "--tokens", "8", "--hidden",
                      "128", "--inter", "128", "--experts", "2", "--topk", "2", "--calls", "2",
                      "--runs", "1", "--op", "fwd+bwd"],
                     "ncu_layer.json", ["moe_ffn(fused=True) fwd+bwd, R = 2: 1 runs of 2 calls"]),
    # the fused halves against themselves with the backward on the unfused ops (the same on the
    # reference backend; a checkout's fused.py as the baseline: tests/test_bench_harness.py)
    "fused_ab.py": (["--baseline", "env:JAX_EP_FUSED_BACKWARD=0", "--ranks", "2",
                     "--tokens", "8", "--hidden", "128", "--inter", "128", "--experts", "2",
                     "--topk", "2", "--rounds", "1", "--scan", "1,2"],
                    "fused_ab.json", ["  baseline "]),
}

# 4 host devices; XLA:CPU's cheapest code generation (compiling is most of each run's time)
XLA_FLAGS = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")

EXCLUDED = {
    "trace_phases.py": "reads the CUDA kernels' in-kernel phase marks "
                       "(jax_ep.runtime.phase_traces): the reference backend has none",
    "nvlink_probe.cu": "a CUDA program (NVLink bandwidth between GPUs)",
    "sm_read_probe.cu": "a CUDA program (a few SMs' read rates beside a busy GPU)",
    "cutlass_example57.sh": "builds CUTLASS example 57 with nvcc (bench_gemm.py's baseline)",
    "deepgemm.sh": "prepares DeepGEMM, which needs torch and a GPU (bench_gemm.py's baseline)",
    "deepgemm_baseline.py": "module of bench_gemm.py: DeepGEMM needs torch and a GPU (bench_gemm "
                            "skips it on the reference backend, with a line)",
    "harness.py": "module of the scripts (timing), tested in tests/test_bench_harness.py",
    "kernel_times.py": "module of bench.py (--kernel-times, run above), tested in "
                       "tests/test_bench_harness.py",
    "baselines.py": "module of the scripts (lax baselines), run by bench.py and bench_moe.py",
    "moe_parts.py": "module of bench_moe.py and bench_moe_ranks.py, run by them",
}


def test_every_benchmark_file_is_listed():
    files = sorted(f for f in os.listdir(BENCH)
                   if os.path.isfile(os.path.join(BENCH, f)) and not f.startswith("."))
    unlisted = [f for f in files if f not in SCRIPTS and f not in EXCLUDED]
    assert not unlisted, (f"benchmarks/{unlisted}: add to SCRIPTS (a CPU run on the reference "
                          "backend) or to EXCLUDED (why it cannot run without a GPU)")
    gone = [f for f in list(SCRIPTS) + list(EXCLUDED) if f not in files]
    assert not gone, f"listed but not in benchmarks/: {gone}"


def run_script(script, args, tmp_path):
    """(stdout, log, the --out folder) of a benchmark script run on the CPU; fails the test with
    the log when it exits with an error."""
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS,
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("OUT", None)
    cmd = [sys.executable, os.path.join(BENCH, script), "--out", str(out), *args]
    p = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=600)
    log = f"$ {' '.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert p.returncode == 0, log
    return p.stdout, log, out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_on_cpu(script, tmp_path):
    args, out_json, lines = SCRIPTS[script]
    stdout, log, out = run_script(script, args, tmp_path)
    path = out / out_json
    assert path.is_file(), f"{path} not written\n{log}"
    data = json.loads(path.read_text())
    rows = data.get("rows", data.get("results"))
    assert rows, f"{path}: no rows\n{log}"
    for line in lines:
        assert line in stdout, f"expected a line with {line!r}\n{log}"


def test_bench_layer_compile_only_plans_memory_and_runs_nothing(tmp_path):
    """bench_layer.py --compile-only: every layer's memory plans from abstract inputs, no
    timing, no check against the dense MoE (the mode that --mock-topology uses on a GPU)."""
    stdout, log, out = run_script(
        "bench_layer.py", ["--backend", "reference", "--ranks", "2", "--routing", "balanced",
                           "--tokens", "8", "--hidden", "128", "--inter", "128", "--experts",
                           "2", "--topk", "2", "--compile-only", "--only",
                           "moe_ffn,expert compute alone"], tmp_path)
    assert "compiled only" in stdout and "(not drawn)" in stdout, log
    rows = json.loads((out / "bench_layer.json").read_text())["results"]
    assert [r["name"] for r in rows] == ["moe_ffn", "expert compute alone"], log
    for r in rows:
        assert r["step_bytes"] > 0 and r["train_step_bytes"] > 0, r
        assert "fwd_ms" not in r and "rel_err_vs_dense" not in r, r


def test_bench_layer_draws_each_block_from_the_same_seed(tmp_path):
    """bench_layer.py: a block's routing does not depend on the blocks run before it, so the
    command of one block reproduces that block of a longer run (the Zipf draw, whose hot
    experts decide each rank's load, is drawn twice here with a uniform one between)."""
    stdout, log, _ = run_script(
        "bench_layer.py", ["--backend", "reference", "--ranks", "4", "--routing",
                           "zipf,uniform,zipf", "--tokens", "64", "--hidden", "128", "--inter",
                           "128", "--experts", "4", "--topk", "2", "--reps", "1", "--only",
                           "communication alone", "--check-tokens", "4"], tmp_path)
    loads = {}
    for line in stdout.splitlines():
        if line.startswith("== R=4") and "pairs per rank" in line:
            routing = line.split(":")[0].split()[-1]
            loads.setdefault(routing, []).append(line.split("pairs per rank / T*K:")[1])
    assert len(loads.get("zipf", [])) == 2 and len(loads.get("uniform", [])) == 1, log
    assert loads["zipf"][0] == loads["zipf"][1], log


def test_bench_layer_does_not_rerun_a_backward_that_ran_out_of_memory(tmp_path):
    """bench_layer.py: a layer whose forward + backward ran out of memory under one routing is
    reported as such under the next without being built again (its buffers follow the shapes,
    not the routing; the ragged layer's backward compiles for minutes before it fails on
    GPUs). Here the GShard layer's backward raises XLA's out-of-memory status when it is traced
    (XLA:CPU cannot run the ragged layer at all)."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import sys
sys.path.insert(0, {BENCH!r})
import bench_layer
traced = []
real = bench_layer.with_backward
def with_backward(fn, argnums):
    if getattr(fn, "func", None) is not bench_layer.gshard_layer:
        return real(fn, argnums)
    def out_of_memory(*args):
        traced.append(1)
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate (test)")
    return out_of_memory
bench_layer.with_backward = with_backward
bench_layer.main()
print("backward traced", len(traced), "times")
""")
    stdout, log, out = run_script(  # (an absolute path: the driver, not a script of BENCH)
        str(driver), ["--backend", "reference", "--ranks", "2", "--routing", "uniform,zipf",
                      "--tokens", "16", "--hidden", "128", "--inter", "128", "--experts", "2",
                      "--topk", "2", "--reps", "1", "--only", "GShard capacity 1.25 + einsum",
                      "--check-tokens", "4"], tmp_path)
    assert "backward traced 1 times" in stdout, log
    rows = json.loads((out / "bench_layer.json").read_text())["results"]
    assert [r["routing"] for r in rows] == ["uniform", "zipf"], log
    assert "RESOURCE_EXHAUSTED" in rows[0]["failed"] and "fwd_ms" in rows[0], rows[0]
    assert rows[1]["failed"].startswith("not run: out of memory under uniform routing"), rows[1]
    assert "fwd_ms" in rows[1], rows[1]
