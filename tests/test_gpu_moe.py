"""GPU suite of `moe_ffn`: the whole layer on the CUDA kernels (dispatch, grouped GEMMs,
combine) against the same layer on the reference backend, in one program, forward and
gradients, over R ranks (R GPUs, or R virtual ranks on one GPU: jax_ep.testing).

Marked `gpu` (skipped without CUDA GPUs). Run: scripts/gpu_check.sh moe, or
`pytest -m gpu tests/test_gpu_moe.py`.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from helpers import gpu_devices, gpu_ranks, moe_layer_and_grads, poison_gpu_memory

pytestmark = pytest.mark.gpu


def _setup(R, T, H, I, K, L, dtype, seed, masked):
    E = L * R
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), dtype)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    if masked:   # unused slots and a token naming one expert twice
        idx[rng.random(idx.shape) < 0.25] = -1
        idx[0, :2] = idx[0, 0] if idx[0, 0] >= 0 else 0
    w = jnp.asarray(rng.random((R * T, K)), dtype)
    wgu = jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), dtype)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), dtype)
    return x, jnp.asarray(idx), w, wgu, wd, E


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values (rows never written?)"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


NAMES = ("out", "d x", "d topk_weights", "d w_gate_up", "d w_down")


def _cuda_and_reference(R, kw, args):
    """moe_ffn(**kw)'s output and gradients (NAMES) over R ranks on the CUDA kernels (memory
    poisoned first) and on the reference backend, on the host."""
    got = gpu_ranks(moe_layer_and_grads("cuda", **kw), R)
    want = gpu_ranks(moe_layer_and_grads("reference", **kw), R)
    poison_gpu_memory()
    return jax.device_get(got(*args)), jax.device_get(want(*args))


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_moe_ffn_matches_reference(R, mode):
    T, H, I, K, L = 48, 512, 256, 4, 4
    x, idx, w, wgu, wd, E = _setup(R, T, H, I, K, L, jnp.bfloat16, R, masked=True)
    kw = dict(num_experts=E, mode=mode)
    if mode == "low_latency":
        kw["max_tokens_per_rank"] = T
    g, r = _cuda_and_reference(R, kw, (x, idx, w, wgu, wd))
    for name, a, b in zip(NAMES, g, r):
        assert a.dtype == b.dtype, name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_ffn_extra_passes_match_reference(R, fused):
    """Half the tokens name experts 0 and 1 first, and the capacity is the smallest a pass
    takes: the layer needs extra passes (a while loop, replayed in the backward), CUDA
    against the reference, forward and gradients."""
    T, H, I, K, L = 48, 512, 256, 4, 4
    x, idx, w, wgu, wd, E = _setup(R, T, H, I, K, L, jnp.bfloat16, 20 + R, masked=True)
    idx = idx.at[::2, 0].set(0).at[::2, 1].set(1)
    align = jax_ep.runtime.extension().fused_block_rows if fused else 1
    cap = max(R * T, (L - 1) * (align - 1) + 32)
    kw = dict(num_experts=E, capacity=cap, fused=fused)
    g, r = _cuda_and_reference(R, kw, (x, idx, w, wgu, wd))
    for name, a, b in zip(NAMES, g, r):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("R, T", [(4, 128), (8, 96)])
def test_moe_ffn_fused_extra_passes_hold_fewer_rows_than_tokens(R, T):
    """The fused kernels given extra passes of fewer rows than the R * T tokens (each sends only
    the pairs it keeps, docs/design.md#layer-capacity): two experts of rank 0 take half the
    tokens' first two slots, so rank 0 needs several passes; CUDA against the reference,
    forward and gradients."""
    from jax_ep import moe
    H, I, K, L = 512, 256, 4, 2
    x, idx, w, wgu, wd, E = _setup(R, T, H, I, K, L, jnp.bfloat16, 60 + R, masked=True)
    idx = idx.at[::2, 0].set(0).at[::2, 1].set(1)
    A = jax_ep.runtime.extension().fused_block_rows
    cap = max(R * T, (L - 1) * (A - 1) + 32)
    extra = moe._extra_capacity(T, K, E, L, A, cap)
    assert extra < R * T, (extra, R * T)   # the case this test is for
    kw = dict(num_experts=E, capacity=cap, fused=True)
    g, r = _cuda_and_reference(R, kw, (x, idx, w, wgu, wd))
    for name, a, b in zip(NAMES, g, r):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("fused", [False, True])
def test_moe_ffn_on_a_dp_ep_mesh_with_replicated_weights(fused):
    """A (dp, ep) = (2, 2) mesh of 4 GPUs, the experts sharded over ep and replicated over dp,
    shard_map's default check_vma, a capacity that needs extra passes: CUDA against the
    reference, forward and gradients (the weights' summed over the replicas)."""
    devs = gpu_devices()
    if len(devs) < 4:
        pytest.skip("needs 4 GPUs")
    from jax.sharding import Mesh, PartitionSpec as P
    dp, R, T, H, I, K, L = 2, 2, 48, 512, 256, 4, 4
    x, idx, w, wgu, wd, E = _setup(dp * R, T, H, I, K, L, jnp.bfloat16, 40, masked=True)
    wgu, wd = wgu[:R * L], wd[:R * L]           # E = R * L experts, replicated over dp
    E = R * L
    idx = jnp.where(idx >= 0, idx % E, -1).at[::2, 0].set(0).at[::2, 1].set(1)
    align = jax_ep.runtime.extension().fused_block_rows if fused else 1
    kw = dict(num_experts=E, capacity=max(R * T, (L - 1) * (align - 1) + 32), fused=fused)
    mesh = Mesh(np.array(devs[:dp * R]).reshape(dp, R), ("dp", "ep"))
    tok, ep = P(("dp", "ep")), P("ep")

    def run(backend):
        return jax.jit(jax.shard_map(moe_layer_and_grads(backend, **kw), mesh=mesh,
                                     in_specs=(tok, tok, tok, ep, ep),
                                     out_specs=(tok, tok, tok, ep, ep)))
    args = (x, idx, w, wgu, wd)
    want = jax.device_get(run("reference")(*args))
    poison_gpu_memory()
    got = jax.device_get(run("cuda")(*args))
    for name, a, b in zip(NAMES, got, want):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("R", [1, 4])
def test_moe_ffn_fp8_forward(R):
    """FP8 dispatch into the FP8 grouped GEMM of w_gate_up, against the same FP8 layer on the
    reference backend."""
    T, H, I, K, L = 64, 1024, 256, 4, 4
    x, idx, w, wgu, wd, E = _setup(R, T, H, I, K, L, jnp.bfloat16, 10 + R, masked=True)
    wq = jax.vmap(jax_ep.quantize_fp8_weights)(wgu.reshape(R, L, H, 2 * I))

    def run(backend):
        def body(x, idx, w, data, scales, wd):
            return jax_ep.moe_ffn(x, idx, w, jax_ep.Fp8Weights(data, scales), wd,
                                  num_experts=E, use_fp8=True, backend=backend)
        return gpu_ranks(body, R)

    merge = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    args = (x, idx, w, merge(wq.data), merge(wq.scales), wd)
    poison_gpu_memory()
    got = np.asarray(run("cuda")(*args), np.float32)
    want = np.asarray(run("reference")(*args), np.float32)
    assert _rel(got, want) < 2e-2


def test_moe_ffn_in_a_long_scan():
    """200 layers in one scan with fresh routing each step (HT, R = 4): every step's
    dispatch, GEMM sizes and combine change."""
    R, T, H, I, K, L, steps = 4, 16, 256, 128, 2, 2, 200
    if not gpu_devices():
        pytest.skip("needs a GPU")
    x, _, w, wgu, wd, E = _setup(R, T, H, I, K, L, jnp.bfloat16, 5, masked=False)
    rng = np.random.default_rng(6)
    idx = jnp.asarray(rng.integers(-1, E, (steps, R * T, K)).astype(np.int32))

    def run(backend):
        def body(x, idx, w, wgu, wd):      # idx [T, steps, K]: the ranks split its first axis
            def step(h, i):
                out = jax_ep.moe_ffn(h, i, w, wgu, wd, num_experts=E, backend=backend)
                return (h + out).astype(h.dtype) * 0.5, jnp.sum(out.astype(jnp.float32))
            return jax.lax.scan(step, x, jnp.swapaxes(idx, 0, 1))
        return gpu_ranks(body, R)

    idx_t = jnp.swapaxes(idx, 0, 1)             # [R*T, steps, K]
    poison_gpu_memory()
    hc, sc = jax.device_get(run("cuda")(x, idx_t, w, wgu, wd))
    hr, sr = jax.device_get(run("reference")(x, idx_t, w, wgu, wd))
    assert _rel(hc, hr) < 2e-2
    assert _rel(sc, sr) < 2e-2
