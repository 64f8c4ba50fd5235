"""GPU suite: waits that give up cleanly (docs/design.md#clean-timeouts).

Rank 1 of R = 2 virtual ranks on one GPU never runs the op (jax_ep.testing.absent_ranks), so
rank 0's waits for it give up after JAX_EP_TIMEOUT_S. Checked, for each kind of op, in a process
of its own (tests/timeout_child.py): the program returns within about one timeout (two calls
queued back to back included), the CUDA context stays usable, `jax_ep.PeerTimeoutError` names
the op, the rank, the peer and the phase, every later communication op fails with the same
message naming the setting, and `jax_ep.checked` raises the error; and every result of the op
on the rank whose wait gave up is poisoned (floats NaN, ints the extension's sentinel), for
every kind of op and through `moe_ffn`. Marked `gpu`.
"""
from __future__ import annotations

import functools
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


FUSED = ("ht_gather_gemm", "ht_gemm_combine", "moe_ffn_fused")


@functools.lru_cache(maxsize=None)
def _child(op):
    """The child's report for `op` (one process per op, shared by the tests of this file)."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S=str(TIMEOUT_S), JAX_EP_VIRTUAL_RANKS="1")
    p = subprocess.run([sys.executable, str(CHILD), op], env=env, capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return json.loads(lines[-1])


def _skip_unless_runnable(op):
    if not gpu_devices():
        pytest.skip("needs a GPU")
    if op in FUSED and not jax_ep.runtime.extension().gemm_built():
        pytest.skip("a build without the CUTLASS GEMMs has no fused kernel")


@pytest.mark.parametrize("op", ["ll_dispatch", "ll_combine", "ht_dispatch", "ht_combine",
                                "ht_gather_gemm", "ht_gemm_combine"])
def test_a_wait_that_times_out_raises_and_keeps_the_context(op):
    _skip_unless_runnable(op)
    out = _child(op)
    print(json.dumps({k: v for k, v in out.items() if k not in ("healthy", "poison")}, indent=1))
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


# Results that are not the op's own, by op: inputs passed through (the handle's topk_idx), and
# in the first call only, results of a send half whose own wait had nothing to wait for (the
# receive after it gave up; the second call's send runs after the failure and is poisoned).
NOT_POISONED = {
    "ll_dispatch": {".handle.topk_idx"},
    "ll_dispatch_split": {".handle.topk_idx"},
}
# The layer's extra-pass loop reads its trip count on the host in the middle of the step: when
# the first pass's wait gave up by then, the next handler raises the timeout from the step
# (which of the two happens depends on the host's pace).
MAY_RAISE_IN_THE_STEP = {"moe_ffn_ht", "moe_ffn_fused"}
NOT_POISONED_FIRST = {
    "ll_dispatch_split": {".handle.num_invalid"},
    "ll_combine_split": {"[0]"},
}


@pytest.mark.parametrize("op", ["ll_dispatch", "ll_combine", "ll_dispatch_split",
                                "ll_combine_split", "ht_dispatch", "ht_dispatch_expert",
                                "ht_combine", "ht_gather", "ht_gather_gemm", "ht_gemm_combine",
                                "moe_ffn_ht", "moe_ffn_ll", "moe_ffn_fused"])
def test_the_results_of_an_op_that_gave_up_are_poisoned(op):
    """Rank 0's results of both calls whose waits gave up: every float NaN, every int the
    extension's sentinel (memory scribbled with 0x11 before, so that a result left unwritten
    cannot pass), for each kind of op, the split halves and the layer. The healthy run's
    float results hold no NaN (the check itself is sound)."""
    _skip_unless_runnable(op)
    out = _child(op)
    print(json.dumps({k: out.get(k) for k in ("healthy", "poison")}, indent=1))
    if op in MAY_RAISE_IN_THE_STEP and out["absent_run"] != "returned":
        # no numbers at all: the step itself raised the timeout
        # (the child keeps the message's first 400 characters)
        assert "DEADLINE_EXCEEDED" in out["absent_run"] and "timed out" in out["absent_run"], \
            out["absent_run"]
        return
    assert out["absent_run"] == "returned", out["absent_run"]
    assert not [k for k, (kind, bad, _) in out["healthy"].items() if kind == "float" and bad]
    for call in ("first", "second"):
        res = out["poison"][call]
        skip = NOT_POISONED.get(op, set()) | (NOT_POISONED_FIRST.get(op, set())
                                              if call == "first" else set())
        assert set(res) >= skip and len(res) > len(skip), res.keys()
        left = {k: v for k, v in res.items() if k not in skip and not v[1]}
        assert not left, (call, left)
