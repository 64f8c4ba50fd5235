"""Low-latency dispatch / combine against the NumPy oracle (API.md, low-latency mode).

Rows of recv_x[l] are valid up to recv_count[l] in any order: the checks map rows to tokens by
handle.recv_src and never look at the content of rows past recv_count.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import numpy_oracle as oracle
from helpers import BACKEND, BF16, FP8, ep_groups, ep_size, ll_fn, num_shards, routing, smap, \
    stack, to_np

E = 8


def make_inputs(rng, mesh, T, K, H, M, kind):
    n = num_shards(mesh)
    R = ep_size(mesh)
    L = E // R
    xs = [(rng.standard_normal((T, H)) * 2).astype(BF16) for _ in range(n)]
    idxs = routing(rng, n, T, K, E, kind)
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    ys = [rng.standard_normal((L, R * M, H)).astype(BF16) for _ in range(n)]
    return xs, idxs, ws, ys


def run_ll(mesh, xs, idxs, ws, ys, M, use_fp8, round_scale=False, split=False):
    fn = ll_fn(mesh, E, M, use_fp8, round_scale, split=split)
    return to_np(fn(stack(xs), stack(idxs), stack(ws), stack(ys)))


def u8(a):
    return np.ascontiguousarray(a).view(np.uint8)


def check_ll(mesh, xs, idxs, ws, ys, res, out, M, use_fp8, round_scale=False):
    n = num_shards(mesh)
    R = ep_size(mesh)
    L = E // R
    T, K = idxs[0].shape
    H = xs[0].shape[1]
    # contract shapes / dtypes
    if use_fp8:
        q, sc = res.recv_x
        assert q.shape == (n, L, R * M, H) and q.dtype == FP8
        assert sc.shape == (n, L, R * M, H // 128) and sc.dtype == np.float32
    else:
        assert res.recv_x.shape == (n, L, R * M, H) and res.recv_x.dtype == BF16
    assert res.recv_count.shape == (n, L) and res.recv_count.dtype == np.int32
    assert res.handle.recv_src.shape == (n, L, R * M) and res.handle.recv_src.dtype == np.int32
    assert res.handle.num_invalid.shape == (n,) and res.handle.num_invalid.dtype == np.int32
    assert out.shape == (n, T, H) and out.dtype == BF16
    for group in ep_groups(mesh):
        exp = oracle.ll_dispatch([xs[i] for i in group], [idxs[i] for i in group], E, M,
                                 use_fp8, round_scale)
        for j, i in enumerate(group):
            assert res.handle.num_invalid[i] == exp[j]["num_invalid"]
            assert res.handle.src_rows.shape == (n, R * M, K)
            np.testing.assert_array_equal(
                res.handle.src_rows[i],
                oracle.ll_src_rows([idxs[g] for g in group], res.handle.recv_src[i], j, E, M),
                err_msg=f"src_rows of shard {i}")
            for l in range(L):
                where = f"shard {i} expert {l}"
                want = exp[j]["sets"][l]
                c = int(res.recv_count[i, l])
                assert c == len(want), where
                src = res.handle.recv_src[i, l]
                assert sorted(src[:c].tolist()) == sorted(want), where
                assert (src[c:] == -1).all(), where
                assert res.handle.recv_count[i, l] == c, where
                # recv_slot: the first top-k slot of the source token naming this expert
                slot = res.handle.recv_slot[i, l]
                assert (slot[c:] == -1).all(), where
                for row in range(c):
                    s_rank, t = divmod(int(src[row]), M)
                    clean, _ = oracle.sanitize(idxs[group[s_rank]], E)
                    first = int(np.flatnonzero(clean[t] == j * L + l)[0])
                    assert slot[row] == first, (where, row)
                for row in range(c):
                    w = want[int(src[row])]
                    if use_fp8:
                        np.testing.assert_array_equal(u8(res.recv_x[0][i, l, row]), u8(w[0]),
                                                      where)
                        np.testing.assert_array_equal(u8(res.recv_x[1][i, l, row]), u8(w[1]),
                                                      where)
                    else:
                        np.testing.assert_array_equal(u8(res.recv_x[i, l, row]), u8(w), where)
        exp_out = oracle.ll_combine([ys[i] for i in group], [idxs[i] for i in group],
                                    [ws[i] for i in group],
                                    [res.handle.recv_src[i] for i in group],
                                    [res.recv_count[i] for i in group], E, M)
        for j, i in enumerate(group):
            want = exp_out[j].astype(BF16).astype(np.float32)
            np.testing.assert_allclose(out[i].astype(np.float32), want, rtol=1e-2,
                                       atol=1e-2 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("kind", ["random", "skewed", "masked", "invalid", "dups"])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4", "dp_ep", "ep4_perm", "dp_ep_perm"])
def test_bf16_vs_oracle(meshes, mesh_name, kind):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(hash((mesh_name, kind, "ll")) % 2**32)
    T, K, H, M = 5, 3, 32, 7
    xs, idxs, ws, ys = make_inputs(rng, mesh, T, K, H, M, kind)
    res, out = run_ll(mesh, xs, idxs, ws, ys, M, False)
    check_ll(mesh, xs, idxs, ws, ys, res, out, M, False)
    assert (res.handle.num_invalid > 0).all() == (kind == "invalid")


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("mesh_name", ["ep4", "dp_ep_perm"])
def test_split_send_recv(meshes, mesh_name, use_fp8):
    """The send / receive halves give what the fused ops give (same oracle checks)."""
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(hash((mesh_name, use_fp8, "split")) % 2**32)
    T, K, H, M = 5, 3, 128, 6
    xs, idxs, ws, ys = make_inputs(rng, mesh, T, K, H, M, "dups")
    res, out = run_ll(mesh, xs, idxs, ws, ys, M, use_fp8, split=True)
    check_ll(mesh, xs, idxs, ws, ys, res, out, M, use_fp8)


def test_split_ops_reject_bad_use(mesh2):
    """The split halves: forward only, and the receive takes only the matching send."""
    T, K, H, M = 2, 2, 128, 2
    x = jnp.ones((2, T, H), jnp.bfloat16)
    idx = jnp.zeros((2, T, K), jnp.int32)
    w = jnp.ones((2, T, K), jnp.float32)

    def loss(x):
        p = jax_ep.low_latency_dispatch_send(x, idx[0], num_experts=E, max_tokens_per_rank=M,
                                             use_fp8=False, backend=BACKEND)
        return jnp.sum(jax_ep.low_latency_dispatch_recv(p).recv_x.astype(jnp.float32))

    with pytest.raises(TypeError, match="forward only"):
        smap(mesh2, lambda x: jax.grad(loss)(x))(x)

    def wrong(x, idx, w):
        p = jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, max_tokens_per_rank=M,
                                             backend=BACKEND)
        return jax_ep.low_latency_combine_recv(p)

    with pytest.raises(TypeError, match="low_latency_combine_send"):
        smap(mesh2, wrong)(x, idx, w)
    with pytest.raises(TypeError, match="low_latency_dispatch_send"):
        smap(mesh2, lambda x: jax_ep.low_latency_dispatch_recv(x))(x)


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("mesh_name,H", [("ep2", 256), ("ep4", 128), ("dp_ep_perm", 128)])
def test_fp8_vs_oracle(meshes, mesh_name, H, round_scale):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(H + round_scale)
    T, K, M = 4, 2, 5
    xs, idxs, ws, ys = make_inputs(rng, mesh, T, K, H, M, "masked")
    xs[0][1, :128] = 0                 # a zero group: the 1e-4 amax floor
    xs[-1][2, 3] = BF16(3e4)          # a large outlier in one group
    res, out = run_ll(mesh, xs, idxs, ws, ys, M, True, round_scale)
    check_ll(mesh, xs, idxs, ws, ys, res, out, M, True, round_scale)
    scales = res.recv_x[1]
    valid = res.handle.recv_src >= 0
    s = scales[valid]
    assert s.size and (s > 0).all()
    if round_scale:
        mant, _ = np.frexp(s)
        assert (mant == 0.5).all(), "round_scale scales must be powers of two"
    else:
        assert not (np.frexp(s)[0] == 0.5).all()


@pytest.mark.parametrize("T,M", [(1, 1), (1, 4), (6, 6)])
def test_token_counts(mesh4, T, M):
    rng = np.random.default_rng(T * 10 + M)
    xs, idxs, ws, ys = make_inputs(rng, mesh4, T, 2, 32, M, "random")
    res, out = run_ll(mesh4, xs, idxs, ws, ys, M, False)
    check_ll(mesh4, xs, idxs, ws, ys, res, out, M, False)


def test_duplicate_slots_received_once(mesh2):
    """A token naming one expert in two slots gives one row; combine sums both weights."""
    T, K, H, M = 3, 2, 32, 3
    rng = np.random.default_rng(11)
    xs, _, ws, ys = make_inputs(rng, mesh2, T, K, H, M, "random")
    idxs = [np.array([[5, 5], [1, 5], [-1, 5]], np.int32)] * 2
    res, out = run_ll(mesh2, xs, idxs, ws, ys, M, False)
    check_ll(mesh2, xs, idxs, ws, ys, res, out, M, False)
    np.testing.assert_array_equal(res.recv_count[1], [0, 6, 0, 0])  # expert 5 = rank 1, local 1
    np.testing.assert_array_equal(res.recv_count[0], [0, 2, 0, 0])  # expert 1 = rank 0, local 1


def test_decode_scan_fresh_routing(mesh4):
    """lax.scan over decode steps, new routing every step, x <- combine(scale * dispatch(x))."""
    rng = np.random.default_rng(12)
    n, T, K, H, M, steps = 4, 3, 2, 32, 4, 3
    L = E // 4
    x0 = [(rng.standard_normal((T, H))).astype(BF16) for _ in range(n)]
    idx = np.stack([np.stack(routing(rng, n, T, K, E, "masked")) for _ in range(steps)], 1)
    w = (rng.random((n, steps, T, K)) + 0.5).astype(np.float32)

    def per_shard(x, idx, w):
        def step(x, inp):
            i, wi = inp
            res = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                              use_fp8=False, backend=BACKEND)
            y = (res.recv_x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
            return jax_ep.low_latency_combine(y, i, wi, res.handle, backend=BACKEND), None

        return jax.lax.scan(step, x, (idx, w))[0]

    got = np.asarray(smap(mesh4, per_shard)(stack(x0), jnp.asarray(idx), jnp.asarray(w)))
    xs = x0
    for s in range(steps):
        ids = [idx[q, s] for q in range(n)]
        exp = oracle.ll_dispatch(xs, ids, E, M)
        new = []
        for q in range(n):
            clean, _ = oracle.sanitize(ids[q], E)
            o = np.zeros((T, H), np.float32)
            for t in range(T):
                for k in range(K):
                    e = clean[t, k]
                    if e >= 0:
                        row = exp[e // L]["sets"][e % L][q * M + t].astype(np.float32)
                        o[t] += w[q, s, t, k] * (row * 0.5).astype(BF16).astype(np.float32)
            new.append(o.astype(BF16))
        xs = new
    for q in range(n):
        np.testing.assert_allclose(got[q].astype(np.float32), xs[q].astype(np.float32),
                                   rtol=2e-2, atol=2e-2)


def test_int64_topk_idx(mesh2):
    """int64 ids outside [-1, E) are invalid (counted), never wrapped into a valid id."""
    rng = np.random.default_rng(14)
    T, K, H, M = 4, 2, 32, 4
    xs, idxs, ws, ys = make_inputs(rng, mesh2, T, K, H, M, "random")
    idxs = [i.astype(np.int64) for i in idxs]
    for i in idxs:
        i[0, 0] = 2 ** 32 + 1
        i[3, 1] = -(2 ** 32) + 2
    with jax.enable_x64(True):
        fn = ll_fn(mesh2, E, M, False)
        res, out = to_np(fn(stack(xs), stack(idxs), stack(ws), stack(ys)))
    check_ll(mesh2, xs, idxs, ws, ys, res, out, M, False)
    np.testing.assert_array_equal(res.handle.num_invalid, [2, 2])


def _changed_ids(idx, E, rng):
    """idx with, per token, one slot changed: an unused slot given an expert (an extra slot), a
    used one given another expert, or a used one set to -1."""
    out = idx.copy()
    for t in range(idx.shape[0]):
        k = int(rng.integers(idx.shape[1]))
        out[t, k] = -1 if (idx[t, k] >= 0 and t % 3 == 0) else (idx[t, k] + 1 + t) % E
    return out


@pytest.mark.parametrize("split", [False, True])
def test_combine_with_changed_topk_idx(mesh4, split):
    """The combine reads the rows the dispatch sent (the handle's topk_idx); a slot whose
    topk_idx names another expert contributes nothing, on both backends; check=True raises."""
    T, K, H, M = 6, 3, 32, 8
    rng = np.random.default_rng(21)
    xs, idxs, ws, _ = make_inputs(rng, mesh4, T, K, H, M, "masked")
    changed = [_changed_ids(i, E, rng) for i in idxs]

    def per_shard(x, i, i2, w):
        r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                        use_fp8=False, backend=BACKEND)
        if split:
            got = jax_ep.low_latency_combine_recv(jax_ep.low_latency_combine_send(
                r.recv_x, i2, w, r.handle, backend=BACKEND))
        else:
            got = jax_ep.low_latency_combine(r.recv_x, i2, w, r.handle, backend=BACKEND)
        want = jax_ep.low_latency_combine(r.recv_x, i, jnp.where(i2 == i, w, 0.0), r.handle,
                                          backend=BACKEND)
        return got, want

    got, want = smap(mesh4, per_shard)(stack(xs), stack(idxs), stack(changed), stack(ws))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert any((c != i).any() for c, i in zip(changed, idxs))

    def checked(x, i, i2, w):
        r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                        use_fp8=False, backend=BACKEND)
        return jax_ep.low_latency_combine(r.recv_x, i2, w, r.handle, backend=BACKEND,
                                          check=True)

    with pytest.raises(Exception, match="name another expert than the dispatch did"):
        jax.block_until_ready(
            smap(mesh4, checked)(stack(xs), stack(idxs), stack(changed), stack(ws)))
    same = smap(mesh4, checked)(stack(xs), stack(idxs), stack(idxs), stack(ws))
    np.testing.assert_array_equal(np.asarray(same, np.float32),
                                  np.asarray(smap(mesh4, per_shard)(
                                      stack(xs), stack(idxs), stack(idxs), stack(ws))[0],
                                      np.float32))


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_pending_carried_across_scan_iterations(mesh2, kind):
    """A pending send carried across lax.scan iterations (the send before the loop and the one
    in its body name one pair): each iteration receives the previous one's send. Without a pair
    the two sends are distinct call sites and JAX rejects the carry, on every backend."""
    T, K, H, M, steps = 3, 2, 128, 4, 5
    rng = np.random.default_rng(23)
    xs = jnp.asarray(np.stack([np.stack(make_inputs(rng, mesh2, T, K, H, M, "masked")[0])
                               for _ in range(steps + 1)]), jnp.bfloat16)     # [S+1, n, T, H]
    idx = jnp.asarray(np.stack([np.stack(routing(rng, 2, T, K, E, "masked"))
                                for _ in range(steps + 1)]))
    w = jnp.asarray(rng.random((steps + 1, 2, T, K)), jnp.float32)
    kw = dict(num_experts=E, max_tokens_per_rank=M, use_fp8=False, backend=BACKEND)

    def send(x, i, ww, pair):
        if kind == "dispatch":
            return jax_ep.low_latency_dispatch_send(x, i, pair=pair, **kw)
        r = jax_ep.low_latency_dispatch(x, i, **kw)
        return jax_ep.low_latency_combine_send(r.recv_x, i, ww, r.handle, backend=BACKEND,
                                               pair=pair)

    def recv(p):
        if kind == "dispatch":
            r = jax_ep.low_latency_dispatch_recv(p)
            return r.recv_x.astype(jnp.float32).sum((0, 1))[:4]
        return jax_ep.low_latency_combine_recv(p).astype(jnp.float32)[:, :4]

    def fused(x, i, ww):
        r = jax_ep.low_latency_dispatch(x, i, **kw)
        if kind == "dispatch":
            return r.recv_x.astype(jnp.float32).sum((0, 1))[:4]
        return jax_ep.low_latency_combine(r.recv_x, i, ww, r.handle,
                                          backend=BACKEND).astype(jnp.float32)[:, :4]

    def carried(pair):
        def body(xs, idx, w):
            p0 = send(xs[0], idx[0], w[0], pair)

            def step(p, inp):
                x, i, ww = inp
                out = recv(p)
                return send(x, i, ww, pair), out
            p, outs = jax.lax.scan(step, p0, (xs[1:], idx[1:], w[1:]))
            return outs, recv(p)
        return body

    per = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [S, n, ...] -> [n, S, ...] per shard
    got, last = smap(mesh2, carried("layer0"))(per(xs), per(idx), per(w))
    want = smap(mesh2, lambda xs, idx, w: jax.vmap(fused)(xs, idx, w))(per(xs), per(idx), per(w))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:, :steps])
    np.testing.assert_array_equal(np.asarray(last), np.asarray(want)[:, steps])
    with pytest.raises(TypeError, match="carry"):
        smap(mesh2, carried(None))(per(xs), per(idx), per(w))
    with pytest.raises(TypeError, match="pair must be a non-empty str"):
        smap(mesh2, carried(3))(per(xs), per(idx), per(w))


def test_pair_names_share_a_call_site_only_for_one_layout(mesh2):
    """Sends naming one pair share a call site when their shapes and settings agree; a send of
    other shapes under the same name stays a call site of its own."""
    x = jnp.ones((2, 3, 128), jnp.bfloat16)
    idx = jnp.zeros((2, 3, 2), jnp.int32)
    sites = {}

    def body(x, i):
        for name, M in [("a", 4), ("b", 4), ("c", 8)]:
            p = jax_ep.low_latency_dispatch_send(x, i, num_experts=E, max_tokens_per_rank=M,
                                                 backend=BACKEND, pair="layer")
            sites[name] = p.meta[4]
        return x

    jax.eval_shape(smap(mesh2, body), x, idx)
    assert sites["a"] == sites["b"] != sites["c"]
