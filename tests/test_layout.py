"""get_dispatch_layout (local layout count, no communication) against the NumPy oracle."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import numpy_oracle as oracle
from helpers import BACKEND, routing, smap, stack, to_np


@functools.lru_cache(maxsize=None)
def layout_fn(num_experts, num_ranks):
    return jax.jit(functools.partial(jax_ep.get_dispatch_layout, num_experts=num_experts,
                                     num_ranks=num_ranks, backend=BACKEND))


def check(idx, E, R, got):
    tpr, tpe, in_rank, bad = oracle.layout(idx, E, R)
    g_tpr, g_tpe, g_in, g_bad = to_np(got)
    T = idx.shape[0]
    assert g_tpr.shape == (R,) and g_tpr.dtype == np.int32
    assert g_tpe.shape == (E,) and g_tpe.dtype == np.int32
    assert g_in.shape == (T, R) and g_in.dtype == np.bool_
    assert g_bad.shape == () and g_bad.dtype == np.int32
    np.testing.assert_array_equal(g_tpr, tpr)
    np.testing.assert_array_equal(g_tpe, tpe)
    np.testing.assert_array_equal(g_in, in_rank)
    assert int(g_bad) == bad


@pytest.mark.parametrize("kind", ["random", "skewed", "masked", "invalid", "dups"])
@pytest.mark.parametrize("E,R,T,K", [(8, 2, 7, 3), (16, 4, 9, 4), (8, 8, 1, 2), (12, 3, 5, 1)])
def test_layout_vs_oracle(kind, E, R, T, K):
    rng = np.random.default_rng(E * 100 + R * 10 + T)
    idx = routing(rng, 1, T, K, E, kind)[0]
    check(idx, E, R, layout_fn(E, R)(jnp.asarray(idx)))
    if kind == "invalid":
        assert int(layout_fn(E, R)(jnp.asarray(idx))[3]) > 0


def test_layout_eager_and_in_shard_map(mesh4):
    """Runs outside jit too, and per shard inside shard_map (each shard its own count)."""
    rng = np.random.default_rng(1)
    E, R = 8, 4
    idxs = routing(rng, 4, 6, 2, E, "invalid")
    check(idxs[0], E, R, jax_ep.get_dispatch_layout(jnp.asarray(idxs[0]), num_experts=E,
                                                    num_ranks=R, backend=BACKEND))
    f = smap(mesh4, lambda i: jax_ep.get_dispatch_layout(i, num_experts=E, num_ranks=R,
                                                         backend=BACKEND))
    got = to_np(f(stack(idxs)))
    for s in range(4):
        check(idxs[s], E, R, tuple(a[s] for a in got))


def test_layout_matches_dispatch(mesh4):
    """tokens_per_rank of every source, summed, is what each rank receives in a dispatch."""
    rng = np.random.default_rng(2)
    E, T = 8, 7
    idxs = routing(rng, 4, T, 3, E, "masked")

    def f(i):
        tpr = jax_ep.get_dispatch_layout(i, num_experts=E, num_ranks=4, backend=BACKEND)[0]
        res = jax_ep.dispatch(jnp.zeros((T, 16)), i, num_experts=E, backend=BACKEND)
        return tpr, res.recv_count

    tpr, cnt = to_np(smap(mesh4, f)(stack(idxs)))
    np.testing.assert_array_equal(tpr.sum(0), cnt)


def test_layout_int64():
    idx = np.array([[0, 2 ** 32 + 1], [3, -1], [-(2 ** 32) + 5, 7]], np.int64)
    with jax.enable_x64(True):
        got = jax_ep.get_dispatch_layout(jnp.asarray(idx), num_experts=8, num_ranks=2,
                                         backend=BACKEND)
    check(idx, 8, 2, got)
    assert int(got[3]) == 2
