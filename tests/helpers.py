"""Test helpers: per-rank inputs -> shard_map'd jax_ep calls -> per-rank NumPy outputs.

Every per-shard input and output carries a leading axis of size 1 inside the shard_map, so a
global array is [num_shards, ...] and shard i is mesh position i (row-major over the mesh axes;
for a ("dp", "ep") mesh shard i = dp * R + ep). Jitted functions are cached per configuration so
that tests reuse compilations.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import jax_ep

warnings.filterwarnings("ignore", message="jax_ep: the CUDA extension is not built")

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
BACKEND = "auto"  # the public default: the reference on CPU, the CUDA kernels on GPUs


def spec(mesh):
    names = tuple(mesh.axis_names)
    return P(names if len(names) > 1 else names[0])


def ep_size(mesh):
    return mesh.shape["ep"]


def ep_groups(mesh):
    """Shard indices of every EP group, each in ep-axis order."""
    n = int(np.prod(list(mesh.shape.values())))
    R = ep_size(mesh)
    return [list(range(g * R, (g + 1) * R)) for g in range(n // R)]


def num_shards(mesh):
    return int(np.prod(list(mesh.shape.values())))


def smap(mesh, fn, jit=True):
    """shard_map fn over every axis of mesh; per-shard args/outputs lose/gain a leading 1."""
    sp = spec(mesh)

    def body(*args):
        args = jax.tree.map(lambda a: a[0], args)
        out = fn(*args)
        return jax.tree.map(lambda a: a[None], out)

    f = jax.shard_map(body, mesh=mesh, in_specs=sp, out_specs=sp)
    return jax.jit(f) if jit else f


def to_np(tree):
    return jax.tree.map(lambda a: np.asarray(a), tree)


# ---------------------------------------------------------------------------------------------
# routing generators (NumPy, per shard)
# ---------------------------------------------------------------------------------------------

def routing(rng, n, T, K, E, kind="random"):
    """[n] int32 arrays [T, K] of expert ids.

    random: K distinct experts per token; skewed: every token of every rank -> expert E // 2 + 1
    in slot 0, that expert again in slot 1 (a duplicate) and -1 elsewhere; masked: random with
    about a third of the slots -1 (some tokens fully masked); invalid: random with some ids
    outside [-1, E) (E, E + 5, -2, -9); dups: experts drawn with replacement.
    """
    out = []
    for _ in range(n):
        if kind == "skewed":
            idx = np.full((T, K), -1, np.int32)
            idx[:, 0] = E // 2 + 1
            if K > 1:
                idx[:, 1] = E // 2 + 1
        elif kind == "dups":
            idx = rng.integers(0, E, size=(T, K)).astype(np.int32)
        else:
            idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
            if kind == "masked":
                idx = np.where(rng.random((T, K)) < 0.35, -1, idx).astype(np.int32)
                idx[0] = -1  # a token that goes nowhere
            elif kind == "invalid":
                bad = rng.choice(np.array([E, E + 5, -2, -9], np.int32), size=(T, K))
                idx = np.where(rng.random((T, K)) < 0.3, bad, idx).astype(np.int32)
                idx[0, 0] = E  # at least one on every rank
            else:
                assert kind == "random", kind
        out.append(idx)
    return out


def dyadic(rng, shape, lo=-4, hi=4, denom=1):
    """Small integers / denom: exact in bf16 / f16 / f32 sums (exact finite differences)."""
    return (rng.integers(lo, hi + 1, size=shape) / denom).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# cached jitted ops
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def ht_fn(mesh, num_experts, capacity=None, has_w=True, check=None, backend=BACKEND):
    """(x, idx, w, y) -> (DispatchResult, combine(y, handle))."""

    def f(x, idx, w, y):
        res = jax_ep.dispatch(x, idx, w if has_w else None, num_experts=num_experts,
                              capacity=capacity, backend=backend, check=check)
        out = jax_ep.combine(y, res.handle, backend=backend)
        return res, out

    return smap(mesh, f)


@functools.lru_cache(maxsize=None)
def ll_fn(mesh, num_experts, max_tokens, use_fp8, round_scale=False, check=None,
          backend=BACKEND, split=False):
    """(x, idx, w, y) -> (LowLatencyResult, low_latency_combine(y, idx, w, handle)).

    split: the send / receive halves instead, with other work between them.
    """

    def f(x, idx, w, y):
        kw = dict(num_experts=num_experts, max_tokens_per_rank=max_tokens, use_fp8=use_fp8,
                  round_scale=round_scale, backend=backend, check=check)
        if not split:
            res = jax_ep.low_latency_dispatch(x, idx, **kw)
            return res, jax_ep.low_latency_combine(y, idx, w, res.handle, backend=backend)
        pending = jax_ep.low_latency_dispatch_send(x, idx, **kw)
        y = (y.astype(jnp.float32) * 1.0).astype(y.dtype)  # work between the halves
        res = jax_ep.low_latency_dispatch_recv(pending)
        cpending = jax_ep.low_latency_combine_send(y, idx, w, res.handle, backend=backend)
        return res, jax_ep.low_latency_combine_recv(cpending)

    return smap(mesh, f)


def stack(arrs, dtype=None):
    a = np.stack([np.asarray(x) for x in arrs])
    return jnp.asarray(a if dtype is None else a.astype(dtype))


def run_with_command_buffers(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with XLA command buffers (CUDA graphs) on for fusions and
    custom calls, from one op up: the custom calls are captured and replayed."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def gpu_devices():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def split_ranks(a, R, ep_dim=0):
    """Global array a with axis ep_dim split over R ranks, stacked on a new leading rank axis
    (rank r's shard at index r, as shard_map's P("ep") / P(None, "ep") would hand it out)."""
    a = jnp.asarray(a)
    n = a.shape[ep_dim]
    a = a.reshape(a.shape[:ep_dim] + (R, n // R) + a.shape[ep_dim + 1:])
    return jnp.moveaxis(a, ep_dim, 0)


def gpu_ranks(body, R, ep_dim=0):
    """body (per rank, as given to shard_map) over R ranks, on global arrays whose axis ep_dim
    is split over the ranks (shard_map's P("ep") for ep_dim 0, P(None, "ep") for 1): on R GPUs,
    or as R virtual ranks on one GPU (jax_ep.testing.run_ranks). Skips without a GPU."""
    import pytest
    if not gpu_devices():
        pytest.skip("needs a GPU")
    f = jax_ep.testing.run_ranks(body, R)

    def merge(a):
        a = jnp.moveaxis(a, 0, ep_dim)
        return a.reshape(a.shape[:ep_dim] + (-1,) + a.shape[ep_dim + 2:])

    return lambda *args: jax.tree.map(merge,
                                      f(*jax.tree.map(lambda a: split_ranks(a, R, ep_dim), args)))


def poison_gpu_memory(mib=64):
    """Fill and free a large buffer of NaN bytes on every GPU, so that reused memory is not
    zero and unwritten output rows show up."""
    for d in gpu_devices():
        a = jax.device_put(jnp.full((mib << 20,), 0xFF, jnp.uint8), d)
        a.block_until_ready()
        del a


def moe_layer_and_grads(backend, **kw):
    """Per rank: `jax_ep.moe_ffn(..., backend=backend, **kw)`'s output and the gradients (x,
    topk_weights, w_gate_up, w_down) of a fixed projection of it."""
    def body(x, idx, w, wgu, wd):
        T, H = x.shape

        def loss(x, w, wgu, wd):
            out = jax_ep.moe_ffn(x, idx, w, wgu, wd, backend=backend, **kw)
            proj = jnp.cos(jnp.arange(T * H, dtype=jnp.float32).reshape(T, H))
            return jnp.sum(out.astype(jnp.float32) * proj), out
        (_, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, w, wgu, wd)
        return (out,) + g
    return body


def eqns_by_loop(jaxpr, wanted, in_loop=False):
    """[(inside a while loop, eqn)] for the equations of a jaxpr, and of the jaxprs it calls
    (custom rules and shard_map bodies included), for which wanted(eqn) holds."""
    found = []
    for eqn in jaxpr.eqns:
        if wanted(eqn):
            found.append((in_loop, eqn))
        for sub in jaxprs_in_params(eqn.params):
            found += eqns_by_loop(sub, wanted, in_loop or eqn.primitive.name == "while")
    return found
