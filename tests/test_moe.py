"""moe_ffn against a dense MoE written here (every token through each of its top-k experts),
forward and gradients, on the reference backend."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import num_shards, spec

T, H, I, K = 8, 128, 64, 3


def _dense_moe(x, idx, w, wgu, wd):
    """x [N, H], idx / w [N, K], wgu [E, H, 2I], wd [E, I, H] (all experts) -> [N, H]."""
    out = jnp.zeros(x.shape, jnp.float32)
    for k in range(idx.shape[1]):
        e = jnp.maximum(idx[:, k], 0)
        h = jnp.einsum("nh,nhf->nf", x.astype(jnp.float32), wgu[e].astype(jnp.float32))
        a = jax.nn.silu(h[:, :I]) * h[:, I:]
        y = jnp.einsum("nf,nfh->nh", a, wd[e].astype(jnp.float32))
        out = out + jnp.where(idx[:, k:k + 1] >= 0, w[:, k:k + 1].astype(jnp.float32) * y, 0.0)
    return out


def _setup(mesh, dtype, seed=0):
    S = num_shards(mesh)
    R = mesh.shape["ep"]
    E = 2 * R
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((S * T, H)), dtype)
    idx = rng.integers(-1, E, (S * T, K)).astype(np.int32)
    idx[0, :] = [1, 1, -1]  # a token naming one expert twice
    w = jnp.asarray(rng.random((S * T, K)), dtype)
    wgu = jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), dtype)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), dtype)
    return x, jnp.asarray(idx), w, wgu, wd, E, S


def _run(mesh, mode, x, idx, w, wgu, wd, E, **extra):
    sp = spec(mesh)
    ep_only = P("ep")     # experts are sharded over the EP axis only (replicated over dp)
    kw = dict(num_experts=E, mode=mode, backend="reference", **extra)
    if mode == "low_latency":
        kw["max_tokens_per_rank"] = T

    def body(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, **kw)
    return jax.shard_map(body, mesh=mesh, in_specs=(sp, sp, sp, ep_only, ep_only),
                         out_specs=sp)(x, idx, w, wgu, wd)


@pytest.mark.parametrize("mode,dtype", [("high_throughput", np.float32),
                                        ("high_throughput", jnp.bfloat16),
                                        ("low_latency", jnp.bfloat16)])  # LL ops take bf16
@pytest.mark.parametrize("mesh_name", ["ep4", "dp_ep"])
def test_moe_ffn_matches_dense(meshes, mode, dtype, mesh_name):
    mesh = meshes[mesh_name]
    x, idx, w, wgu, wd, E, S = _setup(mesh, dtype)
    got = jax.jit(functools.partial(_run, mesh, mode, E=E))(x, idx, w, wgu, wd)
    want = _dense_moe(x, idx, w, wgu, wd)
    tol = 1e-5 if dtype == np.float32 else 3e-2
    assert got.dtype == jnp.dtype(dtype)
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert err < tol, err

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * jnp.cos(
            jnp.arange(S * T * H, dtype=jnp.float32).reshape(S * T, H)))
    g = jax.jit(jax.grad(loss(functools.partial(_run, mesh, mode, E=E)),
                         argnums=(0, 2, 3, 4)))(x, idx, w, wgu, wd)
    gw = jax.grad(loss(_dense_moe), argnums=(0, 2, 3, 4))(x, idx, w, wgu, wd)
    for name, a, b in zip(("x", "topk_weights", "w_gate_up", "w_down"), g, gw):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert rel < (1e-4 if dtype == np.float32 else 5e-2), (name, rel)


def test_moe_ffn_bad_arguments(mesh4):
    x, idx, w, wgu, wd, E, _ = _setup(mesh4, np.float32)

    def call(**kw):
        args = dict(num_experts=E, backend="reference")
        args.update(kw)
        f = lambda x, i, w, a, b: jax_ep.moe_ffn(x, i, w, a, b, **args)  # noqa: E731
        return jax.shard_map(f, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(
            x, idx, w, wgu, wd)
    with pytest.raises(ValueError, match="mode='fast'"):
        call(mode="fast")
    with pytest.raises(TypeError, match="x: dtype float32; mode='low_latency' takes bfloat16"):
        call(mode="low_latency")
    with pytest.raises(ValueError, match="max_tokens_per_rank is a low-latency setting"):
        call(max_tokens_per_rank=T)
    xb, wgub, wdb = (a.astype(jnp.bfloat16) for a in (x, wgu, wd))
    ll = lambda x, i, a, b: jax_ep.moe_ffn(x, i, None, a, b, num_experts=E,  # noqa: E731
                                           mode="low_latency", backend="reference")
    with pytest.raises(ValueError, match="topk_weights: None .* mode='low_latency' takes"):
        jax.shard_map(ll, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(xb, idx, wgub, wdb)
    with pytest.raises(TypeError, match="w_gate_up: use_fp8=True takes FP8 weights"):
        call(use_fp8=True)
    with pytest.raises(TypeError, match="use_fp8 must be a bool"):
        call(use_fp8="yes")
    with pytest.raises(TypeError, match="fused must be a bool"):
        call(fused="yes")
    with pytest.raises(ValueError, match="fused=True: the fused dispatch"):
        call(fused=True, mode="low_latency", max_tokens_per_rank=T)
    with pytest.raises(ValueError, match="fused=True: the fused dispatch"):
        call(fused=True, use_fp8=True)
    with pytest.raises(ValueError, match="fused_combine_blocks must be >= 0, got -1"):
        call(fused=True, fused_combine_blocks=-1)
    with pytest.raises(TypeError, match="fused_copy_blocks must be a static Python int"):
        call(fused=True, fused_copy_blocks=1.5)
    f = lambda x, i, w, a, b: jax_ep.moe_ffn(x, i, w, a, b, num_experts=E,  # noqa: E731
                                             fused=True, backend="reference")
    with pytest.raises(ValueError, match="fused=True needs 2I > 0"):
        jax.shard_map(f, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(
            x, idx, w, wgu[:, :, :0], wd[:, :0])


def test_moe_ffn_fused_on_the_reference_backend_is_the_layer(mesh4):
    """fused=True is the same layer (the reference backend runs its unfused ops), gradients
    included; the CUDA kernel is checked against both in tests/test_gpu_fused.py."""
    x, idx, w, wgu, wd, E, S = _setup(mesh4, jnp.bfloat16, seed=3)
    run = functools.partial(_run, mesh4, "high_throughput", E=E)
    got = jax.jit(functools.partial(run, fused=True))(x, idx, w, wgu, wd)
    want = _dense_moe(x, idx, w, wgu, wd)
    err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
    assert err < 3e-2, err
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
    g = jax.jit(jax.grad(loss(functools.partial(run, fused=True)), argnums=(0, 2, 3, 4)))(
        x, idx, w, wgu, wd)
    gu = jax.jit(jax.grad(loss(run), argnums=(0, 2, 3, 4)))(x, idx, w, wgu, wd)
    for a, b in zip(g, gu):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_moe_ffn_with_empty_shards(mesh4, mode):
    """T = 0 on every rank: an empty output, and zero gradients of the weights."""
    x, idx, w, wgu, wd, E, _ = _setup(mesh4, jnp.bfloat16)
    x, idx, w = x[:0], idx[:0], w[:0]
    kw = dict(num_experts=E, mode=mode, backend="reference")
    if mode == "low_latency":
        kw["max_tokens_per_rank"] = 1

    def loss(x, w, wgu, wd):
        f = lambda x, i, w, a, b: jax_ep.moe_ffn(x, i, w, a, b, **kw)  # noqa: E731
        out = jax.shard_map(f, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(
            x, idx, w, wgu, wd)
        return jnp.sum(out.astype(jnp.float32)), out
    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, wgu, wd)
    assert out.shape == (0, H)
    assert float(jnp.abs(g[2].astype(jnp.float32)).sum()) == 0.0
    assert float(jnp.abs(g[3].astype(jnp.float32)).sum()) == 0.0


@pytest.mark.parametrize("tokens", [T, 0])
def test_moe_ffn_low_latency_max_tokens_defaults_to_T(mesh4, tokens):
    """Low-latency mode without max_tokens_per_rank takes this shard's T (1 when T = 0): the
    same layer as with it given."""
    x, idx, w, wgu, wd, E, S = _setup(mesh4, jnp.bfloat16, seed=4)
    keep = np.arange(S * T).reshape(S, T)[:, :tokens].reshape(-1)
    x, idx, w = x[keep], idx[keep], w[keep]

    def ll(M):
        extra = {} if M is None else {"max_tokens_per_rank": M}
        kw = dict(num_experts=E, mode="low_latency", backend="reference", **extra)
        f = lambda x, i, w, a, b: jax_ep.moe_ffn(x, i, w, a, b, **kw)  # noqa: E731
        return jax.jit(jax.shard_map(f, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))(
            x, idx, w, wgu, wd)
    got = ll(None)
    assert got.shape == (S * tokens, H) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ll(max(tokens, 1)), np.float32))
    if tokens:
        want = np.asarray(_dense_moe(x, idx, w, wgu, wd))
        err = np.linalg.norm(np.asarray(got, np.float32) - want) / np.linalg.norm(want)
        assert err < 3e-2, err
