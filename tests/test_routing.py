"""jax_ep.routing against hand-written NumPy routers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ep import routing


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk(renormalize):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((37, 16)), jnp.bfloat16)  # the model dtype
    w, idx = routing.softmax_topk(logits, 4, renormalize=renormalize)
    p = _np_softmax(np.asarray(logits, np.float32))
    want_idx = np.argsort(-p, axis=1, kind="stable")[:, :4]
    want_w = np.take_along_axis(p, want_idx, 1)
    if renormalize:
        want_w = want_w / want_w.sum(1, keepdims=True)
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)


def _np_grouped_topk(logits, k, n_groups, topk_groups, bias, scale, renormalize):
    T, E = logits.shape
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    sel = scores + (0.0 if bias is None else bias[None, :])
    gsize = E // n_groups
    ws, ids = [], []
    for t in range(T):
        gs = [np.sort(sel[t, g * gsize:(g + 1) * gsize])[-2:].sum() for g in range(n_groups)]
        best = np.argsort(-np.asarray(gs), kind="stable")[:topk_groups]
        cand = [e for g in sorted(best) for e in range(g * gsize, (g + 1) * gsize)]
        order = sorted(cand, key=lambda e: (-sel[t, e], e))[:k]
        w = scores[t, order]
        if renormalize:
            w = w / w.sum()
        ws.append(w * scale)
        ids.append(order)
    return np.array(ws), np.array(ids)


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_deepseek(with_bias):
    rng = np.random.default_rng(1)
    T, E, k, G, TG = 23, 32, 6, 8, 3
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32) if with_bias else None
    w, idx = routing.grouped_topk(jnp.asarray(logits), k, n_groups=G, topk_groups=TG,
                                  bias=None if bias is None else jnp.asarray(bias),
                                  scaling_factor=2.5)
    want_w, want_idx = _np_grouped_topk(logits, k, G, TG, bias, 2.5, True)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)
    # the bias steers the choice, not the weights: no gradient reaches it
    if with_bias:
        gb = jax.grad(lambda b: jnp.sum(routing.grouped_topk(
            jnp.asarray(logits), k, n_groups=G, topk_groups=TG, bias=b)[0]))(jnp.asarray(bias))
        assert not np.any(np.asarray(gb))


def test_expert_load_statistics(mesh4):
    rng = np.random.default_rng(2)
    E = 8
    idx = rng.integers(-1, E + 2, (4 * 10, 2)).astype(np.int32)
    want = np.bincount(idx[(idx >= 0) & (idx < E)], minlength=E)
    np.testing.assert_array_equal(np.asarray(routing.expert_counts(jnp.asarray(idx), E)), want)
    load = jnp.zeros((E,), jnp.int32)
    for _ in range(3):
        load = routing.update_expert_load(load, jnp.asarray(idx))
    np.testing.assert_array_equal(np.asarray(load), 3 * want)
    f = jax.jit(jax.shard_map(lambda i: routing.expert_counts(i, E, axis_name="ep")[None],
                              mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))
    got = np.asarray(f(jnp.asarray(idx)))
    for r in range(4):
        np.testing.assert_array_equal(got[r], want)


def test_load_balance_loss():
    rng = np.random.default_rng(3)
    T, E, k = 64, 8, 2
    logits = rng.standard_normal((T, E)).astype(np.float32)
    _, idx = routing.softmax_topk(jnp.asarray(logits), k)
    loss = routing.load_balance_loss(jnp.asarray(logits), idx)
    p = _np_softmax(logits)
    f = np.bincount(np.asarray(idx).ravel(), minlength=E) / (T * k)
    np.testing.assert_allclose(float(loss), E * np.sum(f * p.mean(0)), rtol=1e-5)
    # an even router's loss is 1; the gradient reaches the logits
    even = routing.load_balance_loss(jnp.zeros((T, E)), idx)
    np.testing.assert_allclose(float(even), 1.0, rtol=1e-6)
    g = jax.grad(lambda x: routing.load_balance_loss(x, idx))(jnp.asarray(logits))
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_router_argument_errors():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="k=9 is more than the number of experts E=8"):
        routing.softmax_topk(x, 9)
    with pytest.raises(ValueError, match="n_groups=3: E=8 experts"):
        routing.grouped_topk(x, 2, n_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="topk_groups=5 is more than n_groups=4"):
        routing.grouped_topk(x, 2, n_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="k=5 is more than the 4 experts"):
        routing.grouped_topk(x, 5, n_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="bias: has 7 entries, expected E=8"):
        routing.grouped_topk(x, 2, n_groups=4, topk_groups=2, bias=jnp.zeros(7))
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        routing.softmax_topk(x, 2, renormalize="yes")
    with pytest.raises(ValueError, match=r"logits: expected a rank-2 array \[T, E\]"):
        routing.softmax_topk(x[0], 2)


def test_ties_go_to_the_lowest_index():
    """Equal logits (frequent in bfloat16) choose the lowest expert index first, for experts
    and for DeepSeek's groups."""
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0],
                          [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], jnp.bfloat16)
    w, idx = routing.softmax_topk(logits, 3)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2, 4], [0, 1, 2]])
    np.testing.assert_allclose(np.asarray(w), np.full((2, 3), 1 / 3), rtol=1e-6)
    # every score equal: groups 0 and 1 of four, then their lowest experts
    w, idx = routing.grouped_topk(jnp.zeros((2, 8)), 3, n_groups=4, topk_groups=2)
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2], [0, 1, 2]])
