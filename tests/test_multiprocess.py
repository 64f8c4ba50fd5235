"""Per-process mode on one host: N JAX processes, one GPU each, NVSHMEM transport.

Marked `gpu`: each test starts its own processes with `python -m jax_ep.launch` running
tests/mp_worker.py (the per-process GPU suite). With fewer GPUs than processes every process
runs on GPU 0 (NVSHMEM allows it) and computes the reference itself (NCCL does not), and the
MoE layer runs at its worst-case capacity there (one pass: no XLA all_gather of its counts).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))


def _num_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _launch(n, *args, timeout_s="20", wall=900, env=None, share_gpu=False):
    """n processes of tests/mp_worker.py, one GPU each; share_gpu: all on GPU 0 when there are
    fewer GPUs than processes (NVSHMEM runs several processes per GPU; NCCL does not, so only
    the modes that run jax_ep's kernels alone can share)."""
    gpus = _num_gpus()
    if gpus < (1 if share_gpu else n):
        pytest.skip(f"needs {n} GPUs")
    try:
        import nvshmem.core  # noqa: F401
    except ImportError:
        pytest.skip("needs nvshmem4py (pip install 'jax_ep[cuda13]')")
    env = dict(os.environ, JAX_EP_TIMEOUT_S=timeout_s, PYTHONUNBUFFERED="1", **(env or {}))
    place = []
    if gpus < n:
        place = ["--gpus", ",".join(["0"] * n)]
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.8 / n:.2f}"
        env["JAX_EP_MP_LOCAL_REFERENCE"] = "1"  # the reference without NCCL (mp_worker.py)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), "--grace", "60",
                        *place, os.path.join(HERE, "mp_worker.py"), *args], env=env, cwd=HERE,
                       capture_output=True, text=True, timeout=wall)
    return p, time.time() - t0


@pytest.mark.parametrize("n", [2, 4])
def test_per_process_suite(n):
    p, _ = _launch(n, share_gpu=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(n):
        assert f"PASS rank {r}:" in out, out[-6000:]
        assert f"rank {r}: {n} processes, one GPU each (NVSHMEM)" in out, out[-6000:]


@pytest.mark.parametrize("n", [2, 4])
def test_per_process_suite_remote_peers(n):
    """Every other process treated as remote: the NVSHMEM put-with-signal (low-latency) and get
    (high-throughput) kernels of nvshmem/remote.h run the whole suite, here over NVSHMEM's
    own NVLink transport. The worker checks that runtime_info lists every other PE as remote."""
    p, _ = _launch(n, env={"JAX_EP_FORCE_REMOTE_PEERS": "1"}, share_gpu=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(n):
        assert f"PASS rank {r}:" in out, out[-6000:]
        others = [q for q in range(n) if q != r]
        assert f"rank {r}: {n} processes" in out and f"remote PEs {others}" in out, out[-6000:]


REMOTE = {"JAX_EP_FORCE_REMOTE_PEERS": "1"}


@pytest.mark.parametrize("op,remote", [("ll", False), ("ll", True), ("ht", True)],
                         ids=["ll-mapped", "ll-remote", "ht-remote"])
def test_killed_process_fails_peers_within_timeout(op, remote):
    """remote: the peer reached only by NVSHMEM operations (the kernels of nvshmem/remote.h:
    puts with signals for "ll", gets for "ht", both behind bounded waits for the peer)."""
    p, dt = _launch(2, "--kill-rank", "1", "--kill-op", op, timeout_s="5", wall=300,
                    share_gpu=True, env=REMOTE if remote else None)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-6000:]
    assert "exiting after the compile, before the first op" in out, out[-6000:]
    assert "timed out" in out, out[-6000:]          # the kernel's message, naming the phase
    assert "rank 0: PeerTimeoutError after" in out, out[-6000:]
    if op == "ll":
        assert "(op ll_dispatch, peer 1)" in out, out[-6000:]
    else:  # the survivor gives up waiting for the peer, before it would get from it
        assert "(op ht_remote, peer 1)" in out, out[-6000:]
        assert "wait for a remote peer's staged operands" in out, out[-6000:]
    assert "unexpected" not in out, out[-6000:]
    assert dt < 240, f"took {dt:.0f} s"


def test_absent_process_is_named_within_timeout():
    """A process that never sets up jax_ep: the others raise within JAX_EP_TIMEOUT_S an error
    naming it (the set-up waits at a bounded barrier before NVSHMEM's collective set-up)."""
    p, dt = _launch(2, "--absent-rank", "1", timeout_s="10", wall=300, share_gpu=True)
    out = p.stdout + p.stderr
    assert "rank 0: set-up raised after" in out, out[-6000:]
    assert "process(es) [1] did not arrive" in out, out[-6000:]
    assert "JAX_EP_TIMEOUT_S" in out, out[-6000:]
    assert "without the absent rank" not in out, out[-6000:]
    assert dt < 200, f"took {dt:.0f} s"


@pytest.mark.parametrize("remote", [False, True], ids=["mapped", "remote"])
def test_a_process_compiling_an_extra_program_fails_every_compile_clearly(remote):
    """Process 0 compiles a program with a jax_ep op that process 1 never compiles (a cost
    analysis on one process, say), then both compile the same program. Without a check the
    processes' call sites would hold different slots and buffers and exchange rows through the
    wrong ones; the lease ledger makes both compiles fail, naming the disagreement. remote: the
    peer's ledger read through NVSHMEM gets, as for a process on another node."""
    p, dt = _launch(2, "--extra-compile-rank", "0", timeout_s="20", wall=300, share_gpu=True,
                    env=REMOTE if remote else None)
    out = p.stdout + p.stderr
    for r in (0, 1):  # each process names the disagreement itself
        line = [ln for ln in out.splitlines() if f"rank {r}: compile raised after" in ln]
        assert line and "disagree on their jax_ep call sites" in line[0], out[-6000:]
        assert "Compile such programs on every process" in line[0], out[-6000:]
    assert "unexpected" not in out, out[-6000:]
    assert dt < 200, f"took {dt:.0f} s"
