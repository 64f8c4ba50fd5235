"""One run of tests/test_gpu_timeouts.py, in a process of its own (a wait that gives up ends
every later communication op of its process): R = 2 virtual ranks on one GPU, rank 1 absent
from the op named on the command line. Prints one JSON line: what happened, and whether each
result of rank 0 (whose wait gave up) holds the poison (NaN, or the int sentinel)."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import testing

R, T, H, K, E, M = 2, 8, 256, 2, 8, 8
op = sys.argv[1]
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
idx = jnp.asarray(np.stack([[rng.permutation(E)[:K] for _ in range(T)] for _ in range(R)]),
                  jnp.int32)
w = jnp.asarray(rng.random((R, T, K)), jnp.float32)


def ll_dispatch(x, i):
    return jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M, use_fp8=False)


def ll_combine(x, i, w, handle):
    return jax_ep.low_latency_combine(x, i, w, handle)


def ll_dispatch_split(x, i):
    p = jax_ep.low_latency_dispatch_send(x, i, num_experts=E, max_tokens_per_rank=M,
                                         use_fp8=False)
    return jax_ep.low_latency_dispatch_recv(p)


def ll_combine_split(y, i, w, handle):
    p = jax_ep.low_latency_combine_send(y, i, w, handle)
    return p.arrays[0], jax_ep.low_latency_combine_recv(p)   # (the send's ticket, the output)


def ht_dispatch_expert(x, i, w):
    return jax_ep.dispatch(x, i, w, num_experts=E, layout="expert")


def ht_gather(rows, handle):
    """The rank-major row gather alone (combine's transpose)."""
    from jax_ep import high_throughput as ht
    return ht._gather_core(rows, handle, ht._Config(E, handle.recv_src.shape[0], "ep", "cuda"))


def moe_weights():
    I = 128
    wgu = jnp.asarray(rng.standard_normal((R, E // R, H, 2 * I)) / 16, jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((R, E // R, I, H)) / 16, jnp.bfloat16)
    return wgu, wd


def moe(mode, fused=False):
    def layer(x, i, w, wgu, wd):
        return jax_ep.moe_ffn(x, i, w, wgu, wd, num_experts=E, mode=mode, fused=fused)
    return layer


def ht_dispatch(x, i, w):
    return jax_ep.dispatch(x, i, w, num_experts=E)


def ht_combine(y, handle):
    return jax_ep.combine(y, handle)


def ht_gather_gemm(x, rows_src, sizes, wgu):
    """The fused kernel alone (its routing would be the first op to time out otherwise)."""
    from jax_ep import fused, high_throughput as ht
    C = rows_src.shape[0]
    fcfg = fused._GatherMatmulConfig(ht._Config(E, C, "ep", "cuda"), K, 0)
    unused = jnp.zeros((C,), jnp.int32)   # the backward's residuals
    no_dups = jnp.zeros((C, 0), jnp.int32)
    # no backward here: no dispatch handle among its residuals, no weight-gradient sum (None)
    return fused._gather_matmul(x, wgu, rows_src, no_dups, sizes, unused, unused, unused, None,
                                None, fcfg)


def ht_gemm_combine(a, sizes, wd, row_of, weights, send_rows):
    """The fused GEMM + combine kernel alone."""
    import types
    from jax_ep import fused, high_throughput as ht
    ccfg = fused._GemmCombineConfig(ht._Config(0, row_of.shape[0], "ep", "cuda"), K, 0)
    rank = types.SimpleNamespace(send_rows=send_rows)
    return fused._gemm_combine_call(a, wd, weights, sizes, row_of, rank, ccfg)


run = lambda fn: jax.jit(testing.virtual_ranks(fn, R))  # noqa: E731
if op == "ll_dispatch":
    f, args = run(ll_dispatch), (x, idx)
elif op == "ll_combine":
    r = jax.block_until_ready(run(ll_dispatch)(x, idx))
    y = r.recv_x.astype(jnp.bfloat16)
    f, args = run(ll_combine), (y, idx, w, r.handle)
elif op == "ht_dispatch":
    f, args = run(ht_dispatch), (x, idx, w)
elif op == "ht_combine":
    r = jax.block_until_ready(run(ht_dispatch)(x, idx, w))
    f, args = run(ht_combine), (r.recv_x, r.handle)
elif op == "ht_gather_gemm":
    rows = jax_ep.runtime.extension().fused_block_rows
    C, L = 2 * rows, E // R
    # every rank reads rows of both ranks' tokens, in two segments of one row block each
    rows_src = jnp.asarray(np.tile(np.arange(C) % (R * T), (R, 1)), jnp.int32)
    sizes = jnp.asarray(np.tile([rows, rows] + [0] * (L - 2), (R, 1)), jnp.int32)
    wgu = jnp.asarray(rng.standard_normal((R, L, H, 128)) / 16, jnp.bfloat16)
    f, args = run(ht_gather_gemm), (x, rows_src, sizes, wgu)
elif op == "ht_gemm_combine":
    rows = jax_ep.runtime.extension().fused_block_rows
    C, L, Cr = 2 * rows, E // R, R * T
    a = jnp.asarray(rng.standard_normal((R, C, 128)) / 16, jnp.bfloat16)
    sizes = jnp.asarray(np.tile([rows, rows] + [0] * (L - 2), (R, 1)), jnp.int32)
    wd = jnp.asarray(rng.standard_normal((R, L, 128, H)) / 16, jnp.bfloat16)
    # every received slot names a row; token t of rank q is row q * T + t on every rank
    row_of = jnp.asarray(np.tile(np.arange(Cr * K).reshape(Cr, K) % C, (R, 1, 1)), jnp.int32)
    weights = jnp.ones((R, Cr, K), jnp.float32)
    send_rows = jnp.asarray(np.stack([np.tile((q * T + np.arange(T))[:, None], (1, R))
                                      for q in range(R)]), jnp.int32)
    f, args = run(ht_gemm_combine), (a, sizes, wd, row_of, weights, send_rows)
elif op == "ll_dispatch_split":
    f, args = run(ll_dispatch_split), (x, idx)
elif op == "ll_combine_split":
    r = jax.block_until_ready(run(ll_dispatch)(x, idx))
    f, args = run(ll_combine_split), (r.recv_x.astype(jnp.bfloat16), idx, w, r.handle)
elif op == "ht_dispatch_expert":
    f, args = run(ht_dispatch_expert), (x, idx, w)
elif op == "ht_gather":
    r = jax.block_until_ready(run(ht_dispatch)(x, idx, w))
    f, args = run(ht_gather), (x, r.handle)
elif op in ("moe_ffn_ht", "moe_ffn_ll", "moe_ffn_fused"):
    mode = "low_latency" if op == "moe_ffn_ll" else "high_throughput"
    f, args = run(moe(mode, fused=op == "moe_ffn_fused")), (x, idx, w) + moe_weights()
else:
    raise SystemExit(f"unknown op {op}")


def poisoned(results):
    """{result path: (kind, all of rank 0's values poisoned, its first values)}."""
    sentinel = jax_ep.runtime.poison_int()
    report = {}
    for path, a in jax.tree_util.tree_leaves_with_path(results):
        a0 = np.asarray(a[0])
        if a0.size == 0:
            continue
        if jnp.issubdtype(a0.dtype, jnp.floating):
            kind, ok = "float", bool(np.isnan(a0.astype(np.float32)).all())
        else:
            kind, ok = "int", bool((a0 == sentinel).all())
        report[jax.tree_util.keystr(path)] = (kind, ok, a0.reshape(-1)[:4].astype(float).tolist())
    return report


def scribble():
    """Fill device memory with 0x11 bytes and free it: a result left unwritten (in memory the
    allocator hands out again) then holds neither NaN nor the sentinel."""
    for _ in range(4):
        jax.block_until_ready(jnp.full((64 << 20,), 0x11, jnp.uint8)).delete()


out = {"op": op}
healthy = jax.block_until_ready(f(*args))  # compiled, and every rank present: no timeout
out["healthy_error"] = None if jax_ep._faults.timeout_error() is None else "recorded"
out["healthy"] = poisoned(healthy)   # (nothing poisoned: the check itself is sound)
del healthy
scribble()
t0 = time.monotonic()
try:
    with testing.absent_ranks([1]):
        # two calls queued back to back: the second must not wait a timeout of its own
        first = f(*args)
        second = f(*args)
        jax.block_until_ready((first, second))
    out["absent_seconds"] = time.monotonic() - t0
    out["absent_run"] = "returned"
    out["poison"] = {"first": poisoned(first), "second": poisoned(second)}
except Exception as e:  # noqa: BLE001 - a kernel that traps (planted bug 8): a CUDA error
    out["absent_run"] = f"{type(e).__name__}: {e}"[:400]
out.setdefault("absent_seconds", time.monotonic() - t0)
err = jax_ep._faults.timeout_error()
if err is not None:
    out["error"] = {"type": type(err).__name__, "op": err.op, "rank": err.rank,
                    "peer": err.peer, "num_ranks": err.num_ranks, "phase": err.phase,
                    "timeout_s": err.timeout_s, "message": str(err)}
try:
    jax.block_until_ready(f(*args))
    out["next_call"] = "returned"
except Exception as e:  # noqa: BLE001
    out["next_call"] = f"{type(e).__name__}: {e}"[:1200]
try:
    out["checked"] = "returned" if jax_ep.checked(lambda: jnp.ones(3))() is not None else None
except Exception as e:  # noqa: BLE001
    out["checked"] = type(e).__name__
try:  # the CUDA context is still usable
    out["plain_jax"] = float(jax.block_until_ready(jnp.arange(10.0).sum()))
except Exception as e:  # noqa: BLE001
    out["plain_jax"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out), flush=True)
