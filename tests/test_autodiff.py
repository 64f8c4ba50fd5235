"""Gradients: combine == dispatch^T, numerical checks, scan + remat, FP8 is forward only."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_ep
import numpy_oracle as oracle
from helpers import BACKEND, BF16, dyadic, ep_groups, ep_size, num_shards, routing, smap, \
    to_np

E = 8


def vdot(a, b):
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


# --------------------------------------------------------------------------------------------
# high throughput
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def ht_vjp_fn(mesh, capacity):
    """Per shard: D x, D^T g (vjp), combine(g), d<rw, gw>/dw, combine(y), vjp of combine."""

    def f(x, idx, w, g, gw, y, h):
        def disp(x, w):
            res = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity, backend=BACKEND)
            return (res.recv_x, res.recv_topk_weights), res.handle

        (rx, rw), vjp, handle = jax.vjp(disp, x, w, has_aux=True)
        dx, dw = vjp((g, gw))
        comb_g = jax_ep.combine(g, handle, backend=BACKEND)
        out, vjp_c = jax.vjp(lambda y: jax_ep.combine(y, handle, backend=BACKEND), y)
        (dy,) = vjp_c(h)
        gathered = jax_ep.dispatch(h, idx, w, num_experts=E, capacity=capacity,
                                   backend=BACKEND).recv_x
        return rx, rw, dx, dw, comb_g, out, dy, gathered, handle.recv_src

    return smap(mesh, f)


@pytest.mark.parametrize("mesh_name,capacity", [("ep4", None), ("ep4", 6), ("dp_ep", None),
                                                ("ep4_perm", 11)])
def test_combine_is_dispatch_transpose(meshes, mesh_name, capacity):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(1)
    n, T, K, H = num_shards(mesh), 6, 3, 16
    R = ep_size(mesh)
    C = R * T if capacity is None else capacity
    x = rng.standard_normal((n, T, H)).astype(np.float32)
    idx = np.stack(routing(rng, n, T, K, E, "invalid"))
    w = rng.random((n, T, K)).astype(np.float32)
    g = rng.standard_normal((n, C, H)).astype(np.float32)
    gw = rng.standard_normal((n, C, K)).astype(np.float32)
    y = rng.standard_normal((n, C, H)).astype(np.float32)
    h = rng.standard_normal((n, T, H)).astype(np.float32)
    rx, rw, dx, dw, comb_g, out, dy, gathered, recv_src = to_np(
        ht_vjp_fn(mesh, capacity)(*map(jnp.asarray, (x, idx, w, g, gw, y, h))))
    # <D x, g> == <x, D^T g> and <rw(w), gw> == <w, dw>, within each EP group
    for grp in ep_groups(mesh):
        np.testing.assert_allclose(vdot(rx[grp], g[grp]), vdot(x[grp], dx[grp]), rtol=1e-5)
        np.testing.assert_allclose(vdot(rw[grp], gw[grp]), vdot(w[grp], dw[grp]), rtol=1e-5)
        np.testing.assert_allclose(vdot(out[grp], h[grp]), vdot(y[grp], dy[grp]), rtol=1e-5)
        # and against the oracle's combine of the cotangent
        exp = oracle.ht_combine([g[i] for i in grp], [recv_src[i] for i in grp], T)
        for j, i in enumerate(grp):
            np.testing.assert_allclose(dx[i], exp[j], rtol=1e-6, atol=1e-6)
    # the cotangent of dispatch is exactly combine, that of combine exactly dispatch
    np.testing.assert_array_equal(dx, comb_g)
    np.testing.assert_array_equal(dy, gathered)
    assert np.abs(dw).sum() > 0 and np.abs(dx).sum() > 0


def test_numerical_gradients_ht(mesh2):
    """check_grads (finite differences, float32) of dispatch in x and w, combine in y."""
    rng = np.random.default_rng(2)
    n, T, K, H = 2, 3, 2, 8
    x = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, "masked")))
    w = jnp.asarray(rng.random((n, T, K)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((n, 2 * T, H)), jnp.float32)

    def disp(x, idx, w):
        res = jax_ep.dispatch(x, idx, w, num_experts=E, backend=BACKEND)
        return res.recv_x, res.recv_topk_weights

    f_disp = smap(mesh2, disp)

    def comb(x, idx, y):
        res = jax_ep.dispatch(x, idx, num_experts=E, backend=BACKEND)
        return jax_ep.combine(jnp.tanh(y), res.handle, backend=BACKEND)  # non-linear in y

    f_comb = smap(mesh2, comb)
    kw = dict(order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)
    check_grads(lambda x: f_disp(x, idx, w)[0], (x,), **kw)
    check_grads(lambda w: f_disp(x, idx, w)[1], (w,), **kw)
    check_grads(lambda w: f_disp(x * 1.5, idx, w ** 2)[1], (w,), **kw)
    check_grads(lambda y: f_comb(x, idx, y), (y,), **kw)


def test_scan_remat_gradients_match_dense(mesh4):
    """lax.scan over layers (fresh routing each layer) with jax.checkpoint: values and grads
    in x and topk_weights equal those of the dense per-token formula."""
    rng = np.random.default_rng(3)
    n, T, K, H, layers = 4, 5, 3, 8, 3
    L = E // 4
    x0 = jnp.asarray(rng.standard_normal((n, T, H)) * 0.5, jnp.float32)
    idx = jnp.asarray(np.stack([np.stack(routing(rng, n, T, K, E, kind))
                                for kind in ("masked", "invalid", "dups")], 1))
    w = jnp.asarray(rng.random((n, layers, T, K)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((layers, E)) * 0.5, jnp.float32)
    G = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)

    def moe_layer(x, inp):
        i, wi, ci = inp
        r = jax.lax.axis_index("ep")
        res = jax_ep.dispatch(x, i, wi, num_experts=E, backend=BACKEND)
        local = jax.lax.dynamic_slice_in_dim(ci, r * L, L)
        coef = jnp.where(res.recv_topk_idx >= 0,
                         res.recv_topk_weights * local[jnp.maximum(res.recv_topk_idx, 0)],
                         0.0).sum(1)
        y = res.recv_x * coef[:, None] + jnp.sin(res.recv_x) * 0.1
        return x + jax_ep.combine(y, res.handle, backend=BACKEND), None

    def dense_layer(x, inp):
        i, wi, ci = inp
        valid = (i >= 0) & (i < E)
        coef = jnp.where(valid, wi * ci[jnp.clip(i, 0, E - 1)], 0.0).sum(1)
        sent = jnp.stack([jnp.any(valid & (i // L == q), 1) for q in range(4)], 1).sum(1)
        return x + x * coef[:, None] + jnp.sin(x) * 0.1 * sent[:, None], None

    def loss_fn(layer, remat):
        layer = jax.checkpoint(layer) if remat else layer

        def loss(x, i, w, c, g):
            xf, _ = jax.lax.scan(layer, x, (i, w, c))
            return jnp.sum(xf * g)[None], xf
        return loss

    def grads(layer, remat):
        lf = loss_fn(layer, remat)

        def per_shard(x, i, w, c, g):
            dx, dw = jax.grad(lambda x, w: lf(x, i, w, c, g)[0].sum(), argnums=(0, 1))(x, w)
            return lf(x, i, w, c, g)[1], dx, dw

        return smap(mesh4, per_shard, jit=True)

    # c is replicated: pass it per shard
    cs = jnp.broadcast_to(c[None], (n,) + c.shape)
    got = to_np(grads(moe_layer, True)(x0, idx, w, cs, G))
    got_noremat = to_np(grads(moe_layer, False)(x0, idx, w, cs, G))
    want = to_np(grads(dense_layer, False)(x0, idx, w, cs, G))
    for a, b, name in zip(got, want, ("x_final", "dx", "dw")):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    for a, b in zip(got, got_noremat):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.abs(got[2]).sum() > 0


# --------------------------------------------------------------------------------------------
# low latency
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def ll_fns(mesh, M):
    def fwd(x, idx):
        res = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                          use_fp8=False, backend=BACKEND)
        return res.recv_count, res.handle

    def cost(x, idx, y, w, g):
        res = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                          use_fp8=False, backend=BACKEND)
        out = jax_ep.low_latency_combine(y, idx, w, res.handle, backend=BACKEND)
        return jnp.sum(out.astype(jnp.float32) * g)[None]

    def grad(x, idx, y, w, g):
        return jax.grad(lambda y, w: cost(x, idx, y, w, g).sum(), argnums=(0, 1))(y, w)

    def dispatch_vjp(x, idx, gr):
        def d(x):
            return jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                               use_fp8=False, backend=BACKEND).recv_x

        rx, vjp = jax.vjp(d, x)
        return rx, vjp(gr)[0]

    return smap(mesh, fwd), smap(mesh, cost), smap(mesh, grad), smap(mesh, dispatch_vjp)


@pytest.mark.parametrize("mesh_name", ["ep2", "dp_ep_perm"])
def test_ll_combine_numerical_gradients(meshes, mesh_name):
    """Dyadic data: bf16 is exact, so central differences equal <grad, d> exactly."""
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(4)
    n, T, K, H, M = num_shards(mesh), 3, 2, 16, 4
    R = ep_size(mesh)
    L = E // R
    x = jnp.asarray(dyadic(rng, (n, T, H)), jnp.bfloat16)
    idx = np.stack(routing(rng, n, T, K, E, "invalid"))
    idx[0, 1] = [2, 2]  # a duplicate slot
    idx = jnp.asarray(idx)
    y = dyadic(rng, (n, L, R * M, H)).astype(BF16)
    w = dyadic(rng, (n, T, K), 0, 8, 8)
    g = dyadic(rng, (n, T, H), -2, 2)
    _, cost, grad, _ = ll_fns(mesh, M)
    dy, dw = to_np(grad(x, idx, jnp.asarray(y), jnp.asarray(w), jnp.asarray(g)))
    assert dy.dtype == BF16 and dy.shape == y.shape and dw.dtype == np.float32
    assert np.abs(dy.astype(np.float32)).sum() > 0 and np.abs(dw).sum() > 0
    for trial in range(3):
        d_y = dyadic(rng, y.shape, -2, 2).astype(BF16)
        d_w = dyadic(rng, w.shape, -8, 8, 8)
        fy = [np.asarray(cost(x, idx, jnp.asarray((y.astype(np.float32) + s * d_y.astype(
            np.float32)).astype(BF16)), jnp.asarray(w), jnp.asarray(g))) for s in (1, -1)]
        fw = [np.asarray(cost(x, idx, jnp.asarray(y), jnp.asarray(w + s * d_w), jnp.asarray(g)))
              for s in (1, -1)]
        for grp in ep_groups(mesh):
            num_y = (fy[0][grp].sum() - fy[1][grp].sum()) / 2
            num_w = (fw[0][grp].sum() - fw[1][grp].sum()) / 2
            assert num_y == vdot(dy[grp].astype(np.float32), d_y[grp].astype(np.float32))
            assert num_w == vdot(dw[grp], d_w[grp])
    # rows of y that no token reads (past recv_count) get a zero gradient
    fwd = ll_fns(mesh, M)[0]
    cnt, handle = to_np(fwd(x, idx))
    unused = handle.recv_src < 0
    assert unused.any()
    assert (dy[unused].astype(np.float32) == 0).all()
    # dw of slots with an invalid / -1 id is 0
    clean = np.asarray(idx)
    bad = (clean < 0) | (clean >= E)
    assert (dw[bad] == 0).all()


@pytest.mark.parametrize("mesh_name", ["ep4", "dp_ep"])
def test_ll_dispatch_bf16_transpose(meshes, mesh_name):
    """<D x, g> == <x, D^T g> (float32 math on exact dyadic bf16), ignoring unspecified rows."""
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(5)
    n, T, K, H, M = num_shards(mesh), 4, 3, 16, 5
    R = ep_size(mesh)
    L = E // R
    x = jnp.asarray(dyadic(rng, (n, T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, "dups")))
    fwd, _, _, dvjp = ll_fns(mesh, M)
    _, handle = to_np(fwd(x, idx))
    valid = handle.recv_src >= 0                                       # [n, L, R*M]
    g = dyadic(rng, (n, L, R * M, H), -3, 3)
    g_garbage = np.where(valid[..., None], g, 1e4).astype(BF16)       # junk on unused rows
    rx, dx = to_np(dvjp(x, idx, jnp.asarray(g_garbage)))
    assert dx.dtype == BF16 and dx.shape == x.shape
    gm = np.where(valid[..., None], g, 0)
    for grp in ep_groups(mesh):
        lhs = vdot(np.where(valid[grp][..., None], rx[grp].astype(np.float32), 0), gm[grp])
        assert lhs == vdot(np.asarray(x, np.float32)[grp], dx[grp].astype(np.float32))
        # dx[t] = sum over the distinct experts of t of g at t's row
        for j, s in enumerate(grp):
            clean, _ = oracle.sanitize(np.asarray(idx[s]), E)
            want = np.zeros((T, H), np.float32)
            for t in range(T):
                for e in set(int(v) for v in clean[t] if v >= 0):
                    q, l = grp[e // L], e % L
                    row = list(handle.recv_src[q, l]).index(j * M + t)
                    want[t] += g[q, l, row]
            np.testing.assert_array_equal(dx[s].astype(np.float32), want)
    assert np.abs(dx.astype(np.float32)).sum() > 0


# --------------------------------------------------------------------------------------------
# FP8 is forward only
# --------------------------------------------------------------------------------------------

def test_fp8_dispatch_not_differentiable(mesh2):
    rng = np.random.default_rng(6)
    n, T, K, H = 2, 3, 2, 128
    q, s = oracle.quantize_fp8(rng.standard_normal((n, T, H)).astype(np.float32))
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, "random")))
    w = jnp.ones((n, T, K), jnp.float32)

    def f(s, w):
        res = jax_ep.dispatch((jnp.asarray(q[0]), s), idx[0], w, num_experts=E, backend=BACKEND)
        return jnp.sum(res.recv_x[1]) + jnp.sum(res.recv_topk_weights)

    def per_shard_grad(argnum):
        return smap(mesh2, lambda s, w: jax.grad(f, argnums=argnum)(s, w)[None], jit=True)

    for argnum in (0, 1):
        with pytest.raises(TypeError, match=r"FP8.*not differentiable"):
            per_shard_grad(argnum)(jnp.asarray(s), w)
    # forward (no differentiation) is fine
    smap(mesh2, lambda s, w: f(s, w)[None])(jnp.asarray(s), w)


def test_fp8_low_latency_dispatch_not_differentiable(mesh2):
    def f(x, idx):
        res = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=4,
                                          use_fp8=True, backend=BACKEND)
        return jnp.sum(res.recv_x[1])

    g = smap(mesh2, lambda x, i: jax.grad(f)(x, i), jit=True)
    with pytest.raises(TypeError, match=r"use_fp8=True.*forward only"):
        g(jnp.ones((2, 3, 128), jnp.bfloat16), jnp.zeros((2, 3, 2), jnp.int32))
