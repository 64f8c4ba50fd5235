"""Edge cases of the communication ops found by trying the API as a new user would, on the
reference backend (the CUDA backend shares every check below, and T = 0 runs the reference on
every backend): empty shards, differentiating with replicated weights, router weights in the
model dtype, and arguments of the wrong kind."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import BACKEND, num_shards, routing, smap

R, T, H, K, E = 4, 8, 16, 2, 8


def _smap(mesh, fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _inputs(seed=0, T=T, H=H):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    return x, idx, w


def _ranks_per_token(idx):
    L = E // R
    idx = np.asarray(idx)
    return np.array([len({int(e) // L for e in row if e >= 0}) for row in idx])


@pytest.mark.parametrize("weights", ["none", "constant"])
def test_grad_in_x_with_replicated_or_no_weights(mesh4, weights):
    """d/dx sum(combine(2 * recv_x)) = 2 * (ranks that receive the token): with no weights, or
    weights made inside the shard (not varying along the EP axis)."""
    x, idx, _ = _inputs()

    def loss(x, idx):
        def body(x, idx):
            w = None if weights == "none" else jnp.ones((T, K), jnp.float32)
            r = jax_ep.dispatch(x, idx, w, num_experts=E)
            return jax_ep.combine(r.recv_x * 2, r.handle)
        return jnp.sum(jax.shard_map(body, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(
            x, idx))
    dx = np.asarray(jax.jit(jax.grad(loss))(x, idx))
    want = 2.0 * _ranks_per_token(idx)[:, None] * np.ones((1, H))
    np.testing.assert_allclose(dx, want, rtol=1e-6)


def test_ll_combine_grad_with_constant_weights(mesh4):
    """low_latency_combine with weights made inside the shard: the same gradient in y as with
    the same weights passed in (varying)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((R * T, 128)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    kw = dict(num_experts=E, max_tokens_per_rank=T, use_fp8=False)

    def grads(const):
        def loss(x, idx, w):
            def body(x, idx, w):
                r = jax_ep.low_latency_dispatch(x, idx, **kw)
                ww = jnp.full((T, K), 0.5, jnp.float32) if const else w
                return jax_ep.low_latency_combine(r.recv_x, idx, ww, r.handle)
            out = jax.shard_map(body, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.grad(loss))(x, idx, jnp.full((R * T, K), 0.5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(grads(True), np.float32),
                                  np.asarray(grads(False), np.float32))


def test_empty_shards_high_throughput(mesh4):
    """T = 0 on every shard: empty outputs, no error (both backends: nothing moves)."""
    x, idx, w = _inputs(T=0)

    def body(x, idx, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=E)
        return (r.recv_x, r.recv_count[None], r.recv_tokens_per_expert,
                jax_ep.combine(r.recv_x, r.handle))
    rx, cnt, per_expert, out = _smap(mesh4, body)(x, idx, w)
    assert rx.shape == (0, H) and out.shape == (0, H)
    assert not np.asarray(cnt).any() and not np.asarray(per_expert).any()
    g = jax.grad(lambda x: jnp.sum(_smap(mesh4, lambda x, i, w: jax_ep.combine(
        jax_ep.dispatch(x, i, w, num_experts=E).recv_x, jax_ep.dispatch(
            x, i, w, num_experts=E).handle))(x, idx, w)))(x)
    assert g.shape == (0, H)


def test_empty_shards_low_latency(mesh4):
    x = jnp.zeros((0, 128), jnp.bfloat16)
    idx = jnp.zeros((0, K), jnp.int32)
    w = jnp.zeros((0, K), jnp.float32)

    one = jnp.ones((R, 1), jnp.float32)  # a non-empty operand: XLA's partitioner needs one

    def body(x, idx, w, one):
        r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=4,
                                        use_fp8=False)
        return r.recv_count * one.astype(jnp.int32), jax_ep.low_latency_combine(
            r.recv_x, idx, w, r.handle)
    cnt, out = _smap(mesh4, body)(x, idx, w, one)
    assert not np.asarray(cnt).any() and out.shape == (0, 128)


def test_router_weights_in_the_model_dtype(mesh4):
    """bfloat16 / float16 topk_weights: the same outputs as their float32 values."""
    x, idx, w = _inputs(2)
    for dt in (jnp.bfloat16, jnp.float16):
        wl = w.astype(dt)

        def body(x, idx, w):
            r = jax_ep.dispatch(x, idx, w, num_experts=E)
            return r.recv_topk_weights
        got = np.asarray(_smap(mesh4, body)(x, idx, wl))
        want = np.asarray(_smap(mesh4, body)(x, idx, wl.astype(jnp.float32)))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    xb = x[:, :16].astype(jnp.bfloat16)
    xb = jnp.pad(xb, ((0, 0), (0, 112)))

    def ll(x, idx, w):
        r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                        use_fp8=False)
        return jax_ep.low_latency_combine(r.recv_x, idx, w, r.handle)
    np.testing.assert_array_equal(
        np.asarray(_smap(mesh4, ll)(xb, idx, w.astype(jnp.bfloat16)), np.float32),
        np.asarray(_smap(mesh4, ll)(xb, idx, w.astype(jnp.bfloat16).astype(jnp.float32)),
                   np.float32))


def test_arguments_of_the_wrong_kind(mesh4):
    x, idx, w = _inputs(3)
    xb = jnp.zeros((R * T, 128), jnp.bfloat16)

    def run(fn, *args):
        return _smap(mesh4, fn)(*args)
    with pytest.raises(ValueError, match="topk_idx: K = 0"):
        run(lambda x, i: jax_ep.dispatch(x, i, num_experts=E).recv_x, x, idx[:, :0])
    with pytest.raises(ValueError, match="x: hidden size H = 0"):
        run(lambda x, i: jax_ep.dispatch(x, i, num_experts=E).recv_x, x[:, :0], idx)
    with pytest.raises(ValueError, match="x: hidden size H = 0"):
        run(lambda x, i: jax_ep.dispatch((x.astype(jnp.float8_e4m3fn), x), i,
                                         num_experts=E).recv_count[None], x[:, :0], idx)
    with pytest.raises(TypeError, match=r"use_fp8 must be a bool, got str \('no'\)"):
        run(lambda x, i: jax_ep.low_latency_dispatch(
            x, i, num_experts=E, max_tokens_per_rank=T, use_fp8="no").recv_count, xb, idx)
    with pytest.raises(TypeError, match="round_scale must be a bool"):
        run(lambda x, i: jax_ep.low_latency_dispatch(
            x, i, num_experts=E, max_tokens_per_rank=T, round_scale=1).recv_count, xb, idx)
    with pytest.raises(TypeError, match="check must be a bool or None"):
        run(lambda x, i: jax_ep.dispatch(x, i, num_experts=E, check="yes").recv_x, x, idx)
    with pytest.raises(ValueError, match="capacity=2147483648: rows are indexed in int32"):
        run(lambda x, i: jax_ep.dispatch(x, i, num_experts=E, capacity=2**31).recv_x, x, idx)
    with pytest.raises(TypeError, match="topk_weights: dtype int32"):
        run(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E).recv_x, x, idx,
            w.astype(jnp.int32))


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "soon", "1e30"])
def test_timeout_setting_must_be_finite_and_positive(monkeypatch, value):
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"JAX_EP_TIMEOUT_S='{value}': expected a finite"):
        jax_ep.runtime.timeout_ns()
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "2.5")
    assert jax_ep.runtime.timeout_ns() == 2_500_000_000


@pytest.mark.parametrize("mesh_name", ["ep4", "dp_ep"])
def test_high_throughput_grad_of_grad(meshes, mesh_name):
    """Second derivatives through dispatch and combine (their backward passes are the
    differentiable ops themselves, so this holds on every backend) against the dense formula:
    out[t] = (sum of the token's routed weights) * sin(x[t]) per receiving rank, summed."""
    mesh = meshes[mesh_name]
    n = num_shards(mesh)
    rng = np.random.default_rng(21)
    T, K, H = 5, 2, 3
    x = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, "masked")))
    w = jnp.asarray(rng.random((n, T, K)), jnp.float32)

    def layer(x, idx, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=E, backend=BACKEND)
        y = jnp.sin(r.recv_x) * jnp.sum(r.recv_topk_weights, axis=1, keepdims=True)
        return jax_ep.combine(y, r.handle, backend=BACKEND)

    def dense(x, idx, w):
        # rank q adds sin(x) * (the weights of the token's experts on q); over all ranks, every
        # weight
        tot = jnp.sum(jnp.where(idx >= 0, w, 0.0), axis=-1, keepdims=True)
        return jnp.sin(x) * tot

    def loss(f):
        def g(x, w):
            out = f(x, idx, w)
            return jnp.sum(out ** 2 * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return g

    ep = lambda x, idx, w: smap(mesh, layer, jit=False)(x, idx, w)  # noqa: E731
    for argnum in (0, 1):
        hv = lambda f: jax.grad(lambda x, w: jnp.sum(  # noqa: E731
            jax.grad(loss(f), argnums=argnum)(x, w) ** 2), argnums=(0, 1))
        got = jax.jit(hv(ep))(x, w)
        want = hv(dense)(x, w)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_low_latency_grad_of_grad(mesh4):
    """Second derivatives through low_latency_dispatch and low_latency_combine (bfloat16)
    against the dense formula out[t] = (sum of the token's routed weights) * sin(x[t])."""
    rng = np.random.default_rng(22)
    T, K, H = 4, 2, 8
    x = jnp.asarray(rng.standard_normal((4, T, H)) * 0.5, jnp.bfloat16)
    idx = jnp.asarray(np.stack(routing(rng, 4, T, K, E, "masked")))
    w = jnp.asarray(rng.random((4, T, K)), jnp.float32)

    def layer(x, idx, w):
        r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                        use_fp8=False, backend=BACKEND)
        y = jnp.sin(r.recv_x.astype(jnp.float32)).astype(jnp.bfloat16)
        return jax_ep.low_latency_combine(y, idx, w, r.handle, backend=BACKEND)

    def dense(x, idx, w):
        tot = jnp.sum(jnp.where(idx >= 0, w, 0.0), axis=-1, keepdims=True)
        return jnp.sin(x.astype(jnp.float32)) * tot

    def hv(f, argnum):
        def loss(x, w):
            out = f(x, idx, w).astype(jnp.float32)
            return jnp.sum(out ** 2 * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return jax.grad(lambda x, w: jnp.sum(
            jax.grad(loss, argnums=argnum)(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))

    ep = lambda x, idx, w: smap(mesh4, layer, jit=False)(x, idx, w)  # noqa: E731
    for argnum in (0, 1):
        got = jax.jit(hv(ep, argnum))(x, w)
        want = hv(dense, argnum)(x, w)
        for a, b in zip(got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * np.abs(b).max())


def test_forward_mode_raises_a_clear_error(mesh4):
    """jax.jvp is not supported: the same TypeError from JAX on every backend (the ops are
    custom VJPs whatever the backend)."""
    x, idx, w = _inputs()

    def f(x):
        return _smap(mesh4, lambda x, i: jax_ep.dispatch(x, i, num_experts=E,
                                                         backend=BACKEND).recv_x)(x, idx)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(f, (x,), (x,))
