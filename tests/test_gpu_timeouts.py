"""GPU suite: waits that give up cleanly (docs/design.md#clean-timeouts).

Rank 1 of R = 2 virtual ranks on one GPU never runs the op (jax_ep.testing.absent_ranks), so
rank 0's waits for it give up after JAX_EP_TIMEOUT_S. Checked, for each kind of op, in a process
of its own (tests/timeout_child.py): the program returns within about one timeout (two calls
queued back to back included), the CUDA context stays usable, `jax_ep.PeerTimeoutError` names
the op, the rank, the peer and the phase, every later communication op fails with the same
message naming the setting, and `jax_ep.checked` raises the error. Marked `gpu`.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jax_ep
from helpers import gpu_devices

pytestmark = pytest.mark.gpu

TIMEOUT_S = 3
CHILD = pathlib.Path(__file__).with_name("timeout_child.py")


@pytest.mark.parametrize("op", ["ll_dispatch", "ll_combine", "ht_dispatch", "ht_combine",
                                "ht_gather_gemm", "ht_gemm_combine"])
def test_a_wait_that_times_out_raises_and_keeps_the_context(op):
    if not gpu_devices():
        pytest.skip("needs a GPU")
    if op in ("ht_gather_gemm", "ht_gemm_combine") and not jax_ep.runtime.extension().gemm_built():
        pytest.skip("a build without the CUTLASS GEMMs has no fused kernel")
    env = dict(os.environ, JAX_EP_TIMEOUT_S=str(TIMEOUT_S), JAX_EP_VIRTUAL_RANKS="1")
    p = subprocess.run([sys.executable, str(CHILD), op], env=env, capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    out = json.loads(lines[-1])
    print(json.dumps(out, indent=1))
    assert out["healthy_error"] is None
    # the program ends by itself: no trap, no CUDA error, within about one timeout
    assert out["absent_run"] == "returned", out["absent_run"]
    # one timeout for both calls: the second gives up as soon as it sees the first's failure
    assert out["absent_seconds"] < TIMEOUT_S + 2 < 2 * TIMEOUT_S, out["absent_seconds"]
    e = out["error"]
    assert e["type"] == "PeerTimeoutError"
    assert e["op"] == op and e["phase"].startswith(op + ": "), e
    assert (e["rank"], e["num_ranks"], e["timeout_s"]) == (0, 2, TIMEOUT_S), e
    assert e["peer"] in (1, -1), e
    for word in (op, "rank 0", "JAX_EP_TIMEOUT_S", "timed out"):
        assert word in e["message"], (word, e["message"])
    # every later communication op fails with the same message; other work still runs
    assert "timed out" in out["next_call"] and "JAX_EP_TIMEOUT_S" in out["next_call"], out
    assert out["checked"] == "PeerTimeoutError"
    assert out["plain_jax"] == 45.0
