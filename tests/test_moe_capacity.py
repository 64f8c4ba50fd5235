"""moe_ffn's capacity: buffers sized from the expected load, and no pair ever dropped past them
(extra passes), against a dense MoE written in the tests, on the reference backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from jax_ep import expert_layout as el
from helpers import eqns_by_loop
from test_moe import H, I, T, _dense_moe

K = 3


def _mesh(R):
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _routing(kind, rng, R, E):
    if kind == "hot":        # most pairs on rank 0's experts: R passes of R * T rows
        p = np.full(E, 0.1 / (E - 2))
        p[:2] = 0.45
        idx = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(R * T)])
    elif kind == "one_rank":     # every token to experts 1 (twice) and 0: two passes on rank 0
        idx = np.zeros((R * T, K))
        idx[:, :2] = 1
    else:
        idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)])
        idx = np.where(rng.random(idx.shape) < 0.2, -1, idx)
        idx[0, 0] = E + 3    # an invalid id acts as -1
    return jnp.asarray(idx, jnp.int32)


def _setup(R, kind, seed=0, L=2):
    E = L * R
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.float32)
    return x, _routing(kind, rng, R, E), w, wgu, wd, E


def _layer(R, E, **kw):
    def body(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, backend="reference", **kw)
    return jax.jit(jax.shard_map(body, mesh=_mesh(R), in_specs=P("ep"), out_specs=P("ep")))


def _check_gradients(layer, x, idx, w, wgu, wd, seed):
    """layer's gradients of sum(out * a random cotangent) in x, the routing weights and both
    expert matrices against the dense MoE's."""
    ct = jnp.asarray(np.random.default_rng(seed).standard_normal(x.shape), jnp.float32)

    def loss(f):
        return lambda x, w, wgu, wd: jnp.sum(f(x, idx, w, wgu, wd) * ct)
    got = jax.grad(loss(layer), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    want = jax.grad(loss(_dense_moe), argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    for name, g, r in zip(("x", "w", "w_gate_up", "w_down"), got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=name)


def _passes_run(R, E, idx, capacity):
    """The run flags of the layer's passes: which passes the routing needs."""
    n = el.passes_needed(T, num_ranks=R, num_local_experts=E // R, num_topk=K,
                         capacity=capacity, alignment=1)
    clean = jnp.where((idx >= 0) & (idx < E), idx, -1)

    def body(i):
        return el.pass_ids(i, num_experts=E, axis_name="ep", capacity=capacity, alignment=1,
                           passes=n)[1][None]
    return np.asarray(jax.shard_map(body, mesh=_mesh(R), in_specs=P("ep"),
                                    out_specs=P("ep"))(clean))[0]


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "hot", "one_rank"])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_ffn_drops_nothing_past_its_capacity(R, kind, fused):
    """The smallest capacity (R * T rows a pass): skewed routing needs several passes, and the
    layer still equals the dense MoE, every (token, expert) pair computed once; fused, the
    passes after the first are summed between its two halves
    (docs/design.md#layer-passes-early)."""
    x, idx, w, wgu, wd, E = _setup(R, kind)
    cap = R * T
    run = _passes_run(R, E, idx, cap)
    if kind != "random":
        assert run[1], "the routing must overflow the first pass"
    out = _layer(R, E, capacity=cap, fused=fused)(x, idx, w, wgu, wd)
    valid = jnp.where(idx < E, idx, -1)     # the dense MoE's ids: invalid ones act as -1
    np.testing.assert_allclose(out, _dense_moe(x, valid, w, wgu, wd), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_moe_ffn_extra_passes_hold_fewer_rows_than_tokens_and_drop_nothing(R):
    """A first pass larger than R * T rows: the extra passes take a quarter of a rank's
    expected pairs (fewer rows than the R * T tokens that reach the hot rank: each pass sends
    only the pairs it keeps), more of them; forward and gradients still equal the dense
    MoE's."""
    x, _, w, wgu, wd, E = _setup(R, "random", seed=3, L=4)
    # every token to rank 0's experts 0, 1 and 2 (a few slots unused): up to 3 * R * T pairs
    rng = np.random.default_rng(5)
    idx = jnp.asarray(np.where(rng.random((R * T, K)) < 0.1, -1, np.arange(K)[None, :]),
                      jnp.int32)
    cap = 3 * R * T // 2
    L = E // R
    extra = 8    # T * K / 4 = 6 pairs, rounded up to 8 rows (alignment 1: no padding)
    assert jax_ep.moe._extra_capacity(T, K, E, L, 1, cap) == extra < R * T
    big = el.passes_needed(T, num_ranks=R, num_local_experts=L, num_topk=K, capacity=cap,
                           alignment=1)
    small = el.passes_needed(T, num_ranks=R, num_local_experts=L, num_topk=K, capacity=cap,
                             alignment=1, extra_capacity=extra)
    assert small > big, (small, big)
    clean = jnp.where((idx >= 0) & (idx < E), idx, -1)

    def plan(i):
        ids, run = el.pass_ids(i, num_experts=E, axis_name="ep", capacity=cap, alignment=1,
                               passes=small, extra_capacity=extra)
        return ids[None], run[None]
    ids, run = jax.shard_map(plan, mesh=_mesh(R), in_specs=P("ep"), out_specs=P("ep"))(clean)
    assert np.asarray(run)[0][2], "the routing must need two extra passes"
    # each later pass sends at most `extra` tokens to rank 0 (R * T if it sent every pair left)
    sent = np.asarray(ids).reshape(R, small, T, K)[:, 1:]
    tokens = (sent >= 0).any(axis=3).sum(axis=(0, 2))
    assert tokens.max() <= extra < R * T, tokens
    layer = _layer(R, E, capacity=cap)
    valid = jnp.where(idx < E, idx, -1)
    np.testing.assert_allclose(layer(x, idx, w, wgu, wd), _dense_moe(x, valid, w, wgu, wd),
                               rtol=2e-5, atol=2e-5)
    _check_gradients(layer, x, idx, w, wgu, wd, seed=4)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("R", [2, 4])
def test_moe_ffn_gradients_through_extra_passes(R, fused):
    """Gradients in x, the weights and both expert matrices equal the dense MoE's when the
    routing needs extra passes (which replay their forward in the backward and add their
    weight gradients to the running sum), fused or not."""
    x, idx, w, wgu, wd, E = _setup(R, "hot", seed=1)
    cap = R * T
    assert _passes_run(R, E, idx, cap)[1]
    _check_gradients(_layer(R, E, capacity=cap, fused=fused), x, idx, w, wgu, wd, seed=2)


def test_moe_ffn_default_capacity_is_the_expected_load():
    """The default is moe_capacity's: with uniform routing one pass, the same numbers as a
    worst-case capacity (which never needs a second pass), under jit and in a scan."""
    R = 4
    x, idx, w, wgu, wd, E = _setup(R, "random", seed=3)
    cap = jax_ep.moe_capacity(T, num_experts=E, num_topk=K, num_ranks=R)
    assert cap == max(-(-int(np.ceil(T * K * 1.25)) // 8) * 8, R * T)
    worst = _layer(R, E, capacity=R * T * K)(x, idx, w, wgu, wd)
    np.testing.assert_array_equal(_layer(R, E)(x, idx, w, wgu, wd), worst)

    def scanned(x, idx, w, wgu, wd):
        def step(h, _):
            return jax_ep.moe_ffn(h, idx, w, wgu, wd, num_experts=E, backend="reference"), None
        return jax.lax.scan(step, x, None, length=3)[0]
    out = jax.jit(jax.shard_map(scanned, mesh=_mesh(R), in_specs=P("ep"),
                                out_specs=P("ep")))(x, idx, w, wgu, wd)
    ref = x
    for _ in range(3):
        ref = _dense_moe(ref, jnp.where(idx < E, idx, -1), w, wgu, wd)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_moe_capacity_values():
    cap = jax_ep.moe_capacity
    # T * min(K, E) * factor rounded up to 8, at least R * T, at most R * T * min(K, L)
    assert cap(4096, num_experts=128, num_topk=8, num_ranks=4) == 40960
    assert cap(4096, num_experts=128, num_topk=8, num_ranks=4, capacity_factor=2) == 65536
    assert cap(4096, num_experts=128, num_topk=8, num_ranks=4, capacity_factor=9) == 131072
    assert cap(100, num_experts=16, num_topk=1, num_ranks=8) == 800          # R * T
    assert cap(10, num_experts=4, num_topk=8, num_ranks=2) == 40             # K > E: the worst
    assert cap(64, num_experts=16, num_topk=8, num_ranks=4) == 640           # K > L: T * K * 1.25
    assert cap(0, num_experts=4, num_topk=2, num_ranks=2) == 1                # T = 0


@pytest.mark.parametrize("kw,err,match", [
    (dict(capacity_factor=0), ValueError, "capacity_factor"),
    (dict(capacity_factor=float("nan")), ValueError, "capacity_factor"),
    (dict(num_ranks=3), ValueError, "num_experts=8 .*divisible|num_experts"),
    (dict(num_topk=0), ValueError, "num_topk"),
    (dict(fused="yes"), TypeError, "fused"),
])
def test_moe_capacity_bad_arguments(kw, err, match):
    args = dict(num_experts=8, num_topk=2, num_ranks=2) | kw
    with pytest.raises(err, match=match):
        jax_ep.moe_capacity(16, **args)


def test_moe_ffn_capacity_below_one_token_per_source_is_refused():
    R = 2
    x, idx, w, wgu, wd, E = _setup(R, "random")
    with pytest.raises(ValueError, match=r"capacity=15: .* at least R \* T = 16"):
        _layer(R, E, capacity=R * T - 1)(x, idx, w, wgu, wd)


@pytest.mark.parametrize("fused", [False, True])
def test_moe_ffn_gradients_through_extra_passes_with_data_parallel(fused):
    """A (dp, ep) mesh, the experts sharded over ep and replicated over dp, shard_map's default
    check_vma: with extra passes the weights' gradients are the dense MoE's, each shard's
    partial sums added over the passes and then over the replicas."""
    dp, R = 2, 2
    x, idx, w, wgu, wd, E = _setup(dp * R, "hot", seed=3)    # dp * R shards of T tokens
    mesh = Mesh(np.array(jax.devices()[:dp * R]).reshape(dp, R), ("dp", "ep"))
    tok = P(("dp", "ep"))

    def body(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, capacity=R * T, fused=fused,
                              backend="reference")
    layer = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, P("ep"), P("ep")),
                                  out_specs=tok))
    _check_gradients(layer, x, idx, w, wgu, wd, seed=4)


def _outside_loops(jaxpr, wanted):
    """The equations of a jaxpr for which wanted(eqn) holds and that no while loop holds,
    sub-jaxprs included."""
    return sum(not inside for inside, _ in eqns_by_loop(jaxpr, wanted))


def _layer_jaxprs(R, E, capacity, idx, *args):
    """The jaxprs of sum(moe_ffn) on the reference backend over R ranks, and of its gradients
    in x, the routing weights and both expert matrices (args)."""
    def loss(x, w, wgu, wd):
        body = lambda *a: jax_ep.moe_ffn(*a, num_experts=E, backend="reference",  # noqa: E731
                                         capacity=capacity)
        f = jax.shard_map(body, mesh=_mesh(R), in_specs=P("ep"), out_specs=P("ep"))
        return jnp.sum(f(x, idx, w, wgu, wd).astype(jnp.float32))
    return (jax.make_jaxpr(loss)(*args).jaxpr,
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args).jaxpr)


@pytest.mark.parametrize("kind", ["random", "one_rank"])
def test_extra_passes_cost_no_sort_unless_they_run(kind):
    """A capacity that may need extra passes adds no sort outside their loop (forward and
    backward): their ids are found in the loop, only when the routing needs them; the first
    pass sends every pair."""
    R = 2
    x, idx, w, wgu, wd, E = _setup(R, kind)

    def sorts(capacity):
        return tuple(_outside_loops(j, lambda e: e.primitive.name == "sort")
                     for j in _layer_jaxprs(R, E, capacity, idx, x, w, wgu, wd))
    one_pass = sorts(R * T * K)           # the worst case: a single pass, no loop
    assert one_pass[0] > 0
    assert sorts(R * T) == one_pass       # R * T rows a pass: a loop of extra passes
    # the first pass's ids are the routing's own
    done = jnp.zeros((R, E), jnp.int32)
    clean = jnp.where((idx >= 0) & (idx < E), idx, -1)
    got = jax.shard_map(lambda i: el.pass_slots(i, done, num_experts=E, axis_name="ep"),
                        mesh=_mesh(R), in_specs=P("ep"), out_specs=P("ep"))(clean)
    np.testing.assert_array_equal(got, clean)
