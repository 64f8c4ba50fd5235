"""High-throughput dispatch / combine against the NumPy oracle (API.md, high-throughput mode)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import numpy_oracle as oracle
from helpers import (BF16, FP8, BACKEND, ep_groups, ep_size, ht_fn, num_shards, routing, smap,
                     stack, to_np)

E = 8
DTYPES = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}
TOL = {np.dtype(np.float32): 1e-6, np.dtype(BF16): 1e-2, np.dtype(np.float16): 2e-3}


def make_x(rng, n, T, H, dtype):
    """Per-shard x: an array of `dtype`, or the FP8 tuple (q, scales) for dtype == 'fp8'."""
    xs = [rng.standard_normal((T, H)).astype(np.float32) * 3 for _ in range(n)]
    if dtype == "fp8":
        return [oracle.quantize_fp8(x) for x in xs]
    return [x.astype(DTYPES[dtype]) for x in xs]


def x_arg(xs):
    if isinstance(xs[0], tuple):
        return (stack([x[0] for x in xs]), stack([x[1] for x in xs]))
    return stack(xs)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def run_ht(mesh, xs, idxs, ws, *, capacity=None, ydtype=None, seed=1):
    """Dispatch + combine on the mesh; returns (per-shard results, per-shard outputs, ys)."""
    rng = np.random.default_rng(seed)
    n = num_shards(mesh)
    R = ep_size(mesh)
    T = idxs[0].shape[0]
    H = (xs[0][0] if isinstance(xs[0], tuple) else xs[0]).shape[1]
    C = R * T if capacity is None else capacity
    if ydtype is None:
        ydtype = BF16 if isinstance(xs[0], tuple) else xs[0].dtype
    # y is random on every row, padding rows included: combine must ignore the padding rows
    ys = [(rng.standard_normal((C, H)) * 2).astype(ydtype) for _ in range(n)]
    w_arg = stack(ws) if ws is not None else jnp.zeros((n,) + idxs[0].shape, jnp.float32)
    fn = ht_fn(mesh, E, capacity, ws is not None)
    res, out = to_np(fn(x_arg(xs), stack(idxs), w_arg, stack(ys)))
    return res, out, ys


def check_against_oracle(mesh, xs, idxs, ws, res, out, ys, capacity=None):
    R = ep_size(mesh)
    T, K = idxs[0].shape
    L = E // R
    C = R * T if capacity is None else capacity
    fp8 = isinstance(xs[0], tuple)
    for group in ep_groups(mesh):
        exp = oracle.ht_dispatch([xs[i] for i in group], [idxs[i] for i in group],
                                 None if ws is None else [ws[i] for i in group], E, capacity)
        exp_out = oracle.ht_combine([ys[i] for i in group], [e["recv_src"] for e in exp], T)
        for j, i in enumerate(group):
            e = exp[j]
            where = f"shard {i} (ep rank {j})"
            if fp8:
                assert isinstance(res.recv_x, tuple) and len(res.recv_x) == 2
                assert_same_bits(res.recv_x[0][i], e["recv_x"][0], f"recv_x[0] {where}")
                assert_same_bits(res.recv_x[1][i], e["recv_x"][1], f"recv_x[1] {where}")
            else:
                assert_same_bits(res.recv_x[i], e["recv_x"], f"recv_x {where}")
            np.testing.assert_array_equal(res.recv_topk_idx[i], e["recv_topk_idx"], where)
            assert res.recv_topk_idx.dtype == np.int32
            if ws is None:
                assert res.recv_topk_weights is None
            else:
                assert res.recv_topk_weights.dtype == np.float32
                np.testing.assert_array_equal(res.recv_topk_weights[i], e["recv_topk_weights"],
                                              where)
            assert res.recv_count[i] == e["recv_count"], where
            assert res.handle.recv_count[i] == e["recv_count"], where
            np.testing.assert_array_equal(res.recv_tokens_per_expert[i],
                                          e["recv_tokens_per_expert"], where)
            np.testing.assert_array_equal(res.handle.recv_src[i], e["recv_src"], where)
            assert res.handle.num_dropped[i] == e["num_dropped"], where
            assert res.handle.num_invalid[i] == e["num_invalid"], where
            # combine
            ydt = np.asarray(ys[0]).dtype
            assert out.dtype == ydt and out.shape[1:] == (T,) + ys[0].shape[1:]
            want = exp_out[j].astype(ydt).astype(np.float32)
            tol = TOL[np.dtype(ydt)]
            np.testing.assert_allclose(out[i].astype(np.float32), want, rtol=tol,
                                       atol=tol * max(1.0, np.abs(want).max()), err_msg=where)
    # contract shapes and dtypes
    n = num_shards(mesh)
    H = (xs[0][0] if fp8 else xs[0]).shape[1]
    if fp8:
        assert res.recv_x[0].shape == (n, C, H) and res.recv_x[0].dtype == FP8
        assert res.recv_x[1].shape == (n, C, H // 128) and res.recv_x[1].dtype == np.float32
    else:
        assert res.recv_x.shape == (n, C, H) and res.recv_x.dtype == xs[0].dtype
    assert res.recv_topk_idx.shape == (n, C, K)
    assert res.recv_count.shape == (n,) and res.recv_count.dtype == np.int32
    assert res.recv_tokens_per_expert.shape == (n, L)
    assert res.recv_tokens_per_expert.dtype == np.int32
    assert res.handle.recv_src.shape == (n, C) and res.handle.recv_src.dtype == np.int32
    for name in ("num_dropped", "num_invalid"):
        a = getattr(res.handle, name)
        assert a.shape == (n,) and a.dtype == np.int32, name


def check_case(mesh, xs, idxs, ws, capacity=None, seed=1):
    res, out, ys = run_ht(mesh, xs, idxs, ws, capacity=capacity, seed=seed)
    check_against_oracle(mesh, xs, idxs, ws, res, out, ys, capacity)
    return res, out, ys


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "skewed", "masked", "invalid", "dups"])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4", "dp_ep", "ep4_perm", "dp_ep_perm"])
def test_routing_vs_oracle(meshes, mesh_name, kind):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(hash((mesh_name, kind)) % 2**32)
    n, T, K, H = num_shards(mesh), 7, 3, 16
    xs = make_x(rng, n, T, H, "float32")
    idxs = routing(rng, n, T, K, E, kind)
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    res, _, _ = check_case(mesh, xs, idxs, ws)
    if kind == "invalid":
        assert (res.handle.num_invalid > 0).all()
    else:
        assert (res.handle.num_invalid == 0).all()
    assert (res.handle.num_dropped == 0).all()  # default capacity R * T never drops
    if kind == "skewed":  # all tokens on the rank of expert E // 2 + 1, once each
        R = ep_size(mesh)
        owner = (E // 2 + 1) // (E // R)
        for g in ep_groups(mesh):
            for j, i in enumerate(g):
                assert res.recv_count[i] == (R * T if j == owner else 0)


@pytest.mark.parametrize("dtype,H", [("float32", 48), ("bfloat16", 48), ("float16", 48),
                                     ("bfloat16", 256), ("fp8", 128), ("fp8", 256)])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4"])
def test_dtypes_vs_oracle(meshes, mesh_name, dtype, H):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(H + len(dtype))
    n, T, K = num_shards(mesh), 5, 2
    xs = make_x(rng, n, T, H, dtype)
    idxs = routing(rng, n, T, K, E, "masked")
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    check_case(mesh, xs, idxs, ws)


@pytest.mark.parametrize("mesh_name", ["ep2", "ep4", "dp_ep"])
def test_single_token(meshes, mesh_name):
    mesh = meshes[mesh_name]
    rng = np.random.default_rng(3)
    n = num_shards(mesh)
    xs = make_x(rng, n, 1, 16, "float32")
    idxs = routing(rng, n, 1, 2, E, "random")
    ws = [rng.random((1, 2)).astype(np.float32) for _ in range(n)]
    check_case(mesh, xs, idxs, ws)


def test_without_weights(mesh4):
    rng = np.random.default_rng(4)
    xs = make_x(rng, 4, 7, 16, "float32")
    idxs = routing(rng, 4, 7, 3, E, "masked")
    res, _, _ = check_case(mesh4, xs, idxs, None)
    assert res.recv_topk_weights is None


@pytest.mark.parametrize("capacity", [1, 4, 9, 40])
def test_capacity(mesh4, capacity):
    """Too small: the first `capacity` rows are right, the rest dropped and counted."""
    rng = np.random.default_rng(capacity)
    n, T, K = 4, 5, 3
    xs = make_x(rng, n, T, 16, "float32")
    idxs = routing(rng, n, T, K, E, "random")
    idxs[1] = routing(rng, 1, T, K, E, "skewed")[0]  # rank 1 sends everything to one rank
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    res, out, ys = check_case(mesh4, xs, idxs, ws, capacity=capacity)
    exp = oracle.ht_dispatch(xs, idxs, ws, E, capacity)
    if capacity < 9:
        assert sum(e["num_dropped"] for e in exp) > 0  # the case does overflow
    for r in range(4):
        total = exp[r]["recv_count"] + exp[r]["num_dropped"]
        assert res.recv_count[r] == min(total, capacity)
        assert res.handle.num_dropped[r] == max(total - capacity, 0)
        assert res.recv_x.shape[1] == capacity  # nothing past capacity: the buffer is C rows


@pytest.mark.parametrize("sent,capacity,kept", [
    ([8, 8, 8, 8], 12, [3, 3, 3, 3]),     # equal shares
    ([8, 1, 8, 2], 12, [4, 1, 5, 2]),     # small senders keep all; one row left, to source 2
    ([8, 1, 8, 2], 3, [0, 1, 1, 1]),      # the leftover rows go first to sources 1, 2, 3
    ([8, 0, 3, 2], 40, [8, 0, 3, 2]),     # enough room: nothing dropped
])
def test_capacity_drops_are_fair_across_sources(mesh4, sent, capacity, kept):
    """Short of capacity, rank 0 keeps min(sent, level) rows of each source (the largest level
    that fits) and gives the rows left over one each to the larger senders, from source 1 on:
    no source loses all its tokens while another keeps more than an equal share."""
    rng = np.random.default_rng(3)
    n, T, K = 4, 8, 2
    xs = make_x(rng, n, T, 16, "float32")
    idxs = []
    for s in range(n):  # source s: its first sent[s] tokens to expert 0 (rank 0), the rest none
        i = np.full((T, K), -1, np.int32)
        i[:sent[s], 0] = 0
        idxs.append(i)
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    res, out, ys = check_case(mesh4, xs, idxs, ws, capacity=capacity)
    src = np.asarray(res.handle.recv_src[0])
    got = [int(np.sum((src >= 0) & (src // T == s))) for s in range(n)]
    assert got == kept
    assert res.handle.num_dropped[0] == sum(sent) - sum(kept)
    # each source keeps its first tokens, in order
    for s in range(n):
        assert sorted(src[(src >= 0) & (src // T == s)] % T) == list(range(kept[s]))


def test_padding_and_order(mesh4):
    """Rows >= recv_count: zero / -1; valid rows sorted by (source rank, source token)."""
    rng = np.random.default_rng(5)
    n, T, K = 4, 7, 2
    xs = [x + 1.0 for x in make_x(rng, n, T, 16, "float32")]  # no accidental zero rows
    xs = [np.where(x == 0, 1.0, x).astype(np.float32) for x in xs]
    idxs = routing(rng, n, T, K, E, "masked")
    ws = [rng.random((T, K)).astype(np.float32) + 0.5 for _ in range(n)]
    res, _, _ = run_ht(mesh4, xs, idxs, ws)
    for r in range(n):
        c = int(res.recv_count[r])
        assert 0 < c < R_T(mesh4, T)
        assert (res.recv_x[r, c:] == 0).all()
        assert (res.recv_topk_idx[r, c:] == -1).all()
        assert (res.recv_topk_weights[r, c:] == 0).all()
        assert (res.handle.recv_src[r, c:] == -1).all()
        src = res.handle.recv_src[r, :c]
        assert (np.diff(src) > 0).all() and src.min() >= 0
        assert (np.abs(res.recv_x[r, :c]).sum(1) > 0).all()
        # each valid row names at least one local expert, with its weight
        mine = res.recv_topk_idx[r, :c] >= 0
        assert mine.any(1).all()
        assert ((res.recv_topk_weights[r, :c] > 0) == mine).all()
        for j, s in enumerate(src):
            np.testing.assert_array_equal(res.recv_x[r, j], xs[s // T][s % T])


def R_T(mesh, T):
    return ep_size(mesh) * T


def test_combine_ignores_padding_rows(mesh4):
    rng = np.random.default_rng(6)
    n, T, K, H = 4, 7, 3, 16
    xs = make_x(rng, n, T, H, "float32")
    idxs = routing(rng, n, T, K, E, "masked")
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    fn = ht_fn(mesh4, E, None, True)
    res, out1 = fn(stack(xs), stack(idxs), stack(ws), jnp.zeros((n, 4 * T, H)))
    cnt = np.asarray(res.recv_count)
    y = rng.standard_normal((n, 4 * T, H)).astype(np.float32)
    y_pad = y.copy()
    for r in range(n):
        y_pad[r, cnt[r]:] = 1e6
        y[r, cnt[r]:] = 0
    _, a = fn(stack(xs), stack(idxs), stack(ws), jnp.asarray(y))
    _, b = fn(stack(xs), stack(idxs), stack(ws), jnp.asarray(y_pad))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), 0)
    np.testing.assert_array_equal(np.asarray(out1), 0)


def test_dp_groups_are_independent(mesh_dp_ep):
    """Changing the inputs of one dp row leaves the other EP group's outputs unchanged."""
    rng = np.random.default_rng(7)
    n, T, K, H = 4, 5, 2, 16
    xs = make_x(rng, n, T, H, "float32")
    idxs = routing(rng, n, T, K, E, "random")
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    res_a, out_a, ys = run_ht(mesh_dp_ep, xs, idxs, ws)
    xs2 = [x if i < 2 else x * 2 + 1 for i, x in enumerate(xs)]
    idxs2 = [ix if i < 2 else routing(rng, 1, T, K, E, "skewed")[0] for i, ix in enumerate(idxs)]
    res_b, out_b, _ = run_ht(mesh_dp_ep, xs2, idxs2, ws)
    for a, b in zip(jax.tree.leaves(res_a), jax.tree.leaves(res_b)):
        np.testing.assert_array_equal(a[:2], b[:2])
    np.testing.assert_array_equal(out_a[:2], out_b[:2])
    assert not np.array_equal(res_a.recv_x[2:], res_b.recv_x[2:])
    # tokens never cross groups: the recv_src of group 1 only names its own 2 ranks
    assert res_b.handle.recv_src[2:].max() < 2 * T


def test_permuted_mesh_matches_ordered(mesh4, mesh_permuted):
    """Values depend on the ep-axis position, not on the device ids."""
    rng = np.random.default_rng(8)
    n, T, K, H = 4, 7, 3, 16
    xs = make_x(rng, n, T, H, "float32")
    idxs = routing(rng, n, T, K, E, "random")
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    a = run_ht(mesh4, xs, idxs, ws)
    b = run_ht(mesh_permuted, xs, idxs, ws)
    for u, v in zip(jax.tree.leaves(a[:2]), jax.tree.leaves(b[:2])):
        np.testing.assert_array_equal(u, v)


def test_scan_over_layers_fresh_routing(mesh4):
    """lax.scan over layers, new routing each layer, under jit: x <- x + combine(expert(recv))."""
    rng = np.random.default_rng(9)
    n, T, K, H, layers = 4, 5, 2, 16, 3
    L = E // 4
    x0 = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(n)]
    idx = np.stack([np.stack(routing(rng, n, T, K, E, "masked")) for _ in range(layers)], 1)
    w = rng.random((n, layers, T, K)).astype(np.float32)
    scale = rng.random((layers, E)).astype(np.float32) + 0.5  # expert e multiplies by scale[e]

    def per_shard(x, idx, w):
        r = jax.lax.axis_index("ep")

        def layer(x, inp):
            i, wi, sc = inp
            res = jax_ep.dispatch(x, i, wi, num_experts=E, backend=BACKEND)
            local = jax.lax.dynamic_slice_in_dim(sc, r * L, L)
            coef = jnp.where(res.recv_topk_idx >= 0,
                             res.recv_topk_weights * local[jnp.maximum(res.recv_topk_idx, 0)],
                             0.0).sum(1)
            y = res.recv_x * coef[:, None]
            return x + jax_ep.combine(y, res.handle, backend=BACKEND), res.recv_count

        return jax.lax.scan(layer, x, (idx, w, jnp.asarray(scale)))

    got, counts = to_np(smap(mesh4, per_shard)(stack(x0), jnp.asarray(idx), jnp.asarray(w)))
    xs = [a.copy() for a in x0]
    for layer in range(layers):
        ids = [idx[s, layer] for s in range(n)]
        ws = [w[s, layer] for s in range(n)]
        exp = oracle.ht_dispatch(xs, ids, ws, E)
        ys = []
        for r in range(n):
            e = exp[r]
            loc = scale[layer, r * L:(r + 1) * L]
            coef = np.where(e["recv_topk_idx"] >= 0,
                            e["recv_topk_weights"] * loc[np.maximum(e["recv_topk_idx"], 0)],
                            0).sum(1)
            ys.append((e["recv_x"] * coef[:, None]).astype(np.float32))
            assert counts[r, layer] == e["recv_count"]
        outs = oracle.ht_combine(ys, [e["recv_src"] for e in exp], T)
        xs = [xs[s] + outs[s] for s in range(n)]
    for s in range(n):
        np.testing.assert_allclose(got[s], xs[s], rtol=1e-5, atol=1e-5)


def test_fp8_roundtrip_helpers():
    """jax_ep.quantize_fp8 / dequantize_fp8 are bit-exact with the oracle (both scale modes)."""
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((6, 384)) * np.array([1e-7, 1.0, 300.0])[None].repeat(128, 1)
         ).astype(np.float32)
    x[0, :128] = 0  # amax clamp
    x[1, 5] = 1e5   # saturation neighbourhood
    # groups whose amax * float32(1/448) is exactly a power of two (round_scale keeps it)
    c = np.float32(1) / np.float32(448)
    for row, k in ((2, -3), (3, 0), (4, 2)):
        amax = np.float32(np.float32(2.0 ** k) / c)
        assert amax * c == np.float32(2.0 ** k)
        x[row, 128:256] = np.linspace(-amax, amax * np.float32(0.5), 128, dtype=np.float32)
        x[row, 128] = -amax
    for rs in (False, True):
        q, s = jax.jit(jax_ep.quantize_fp8, static_argnums=1)(jnp.asarray(x), rs)
        qo, so = oracle.quantize_fp8(x, rs)
        assert_same_bits(np.asarray(q), qo, "q")
        assert_same_bits(np.asarray(s), so, "scales")
        np.testing.assert_array_equal(np.asarray(jax_ep.dequantize_fp8(q, s)),
                                      oracle.dequantize_fp8(qo, so))
        if rs:
            m, _ = np.frexp(so)
            assert (m == 0.5).all()  # powers of two
            np.testing.assert_array_equal(np.asarray(s)[2:5, 1], [2.0 ** -3, 1.0, 4.0])


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_nonfinite_groups_stay_nan(round_scale):
    """A NaN or an infinity in a 128-column group makes the whole group NaN (scale and values),
    bit-exact with the oracle; the other groups are untouched."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 384)).astype(np.float32)
    x[0, 5], x[1, 130], x[2, 300], x[3, 0] = np.nan, np.inf, -np.inf, -np.nan
    x[3, 200] = np.inf
    q, s = jax.jit(jax_ep.quantize_fp8, static_argnums=1)(jnp.asarray(x), round_scale)
    qo, so = oracle.quantize_fp8(x, round_scale)
    assert_same_bits(np.asarray(q), qo, "q")
    assert_same_bits(np.asarray(s), so, "scales")
    back = np.asarray(jax_ep.dequantize_fp8(q, s)).reshape(4, 3, 128)
    bad = ~np.isfinite(x.reshape(4, 3, 128)).all(-1)
    np.testing.assert_array_equal(bad.sum(), 5)
    assert np.isnan(back[bad]).all()
    assert np.isfinite(back[~bad]).all()


def int64_routing(rng, n, T, K):
    """int64 ids, some far outside [-1, E): they must not wrap into valid int32 ids."""
    idxs = [i.astype(np.int64) for i in routing(rng, n, T, K, E, "random")]
    for i in idxs:
        i[0, 0] = 2 ** 32 + 1       # wraps to expert 1 if cast to int32 first
        i[1, K - 1] = -(2 ** 32) + 3
        i[2, 0] = 2 ** 40
    return idxs


def test_int64_topk_idx(mesh2):
    rng = np.random.default_rng(13)
    n, T, K, H = 2, 5, 2, 16
    idxs = int64_routing(rng, n, T, K)
    xs = make_x(rng, n, T, H, "float32")
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    with jax.enable_x64(True):
        assert stack(idxs).dtype == np.int64
        res, out, ys = run_ht(mesh2, xs, idxs, ws)
    check_against_oracle(mesh2, xs, idxs, ws, res, out, ys)
    np.testing.assert_array_equal(res.handle.num_invalid, [3, 3])


def test_recommended_capacity():
    """Expected rows per rank under uniform top-k routing, times the factor, rounded up, capped
    at the worst case; checked against a simulation of that routing."""
    R, T, E, K = 8, 512, 64, 8
    c = jax_ep.recommended_capacity(T, num_experts=E, num_topk=K, num_ranks=R)
    L = E // R
    miss = np.prod([(E - L - i) / (E - i) for i in range(K)])
    assert c == int(-(-int(np.ceil(R * T * (1 - miss) * 1.25)) // 8) * 8)
    assert c % 8 == 0 and c < R * T
    rng = np.random.default_rng(0)
    loads = []
    for _ in range(20):  # rows received per rank under uniform routing
        ids = np.stack([rng.permutation(E)[:K] for _ in range(R * T)])
        loads.append(max(int(np.sum(np.any(ids // L == q, axis=1))) for q in range(R)))
    exact = jax_ep.recommended_capacity(T, num_experts=E, num_topk=K, num_ranks=R,
                                        capacity_factor=1.0, multiple=1)
    assert max(loads) <= c  # 1.25x the mean holds every rank's load in every trial
    assert abs(np.mean(loads) - exact) < 0.05 * exact
    # every token reaches every rank: the worst case, never more
    assert jax_ep.recommended_capacity(T, num_experts=8, num_topk=8, num_ranks=R) == R * T
    assert jax_ep.recommended_capacity(0, num_experts=E, num_topk=K, num_ranks=R) == 1
    for kw, exc, match in [({"num_experts": 60}, ValueError, "divisible"),
                           ({"num_topk": 65}, ValueError, "num_topk=65"),
                           ({"capacity_factor": 0}, ValueError, "capacity_factor"),
                           ({"capacity_factor": float("inf")}, ValueError, "capacity_factor"),
                           ({"num_ranks": 2.0}, TypeError, "num_ranks")]:
        args = {**dict(num_experts=E, num_topk=K, num_ranks=R), **kw}
        with pytest.raises(exc, match=match):
            jax_ep.recommended_capacity(T, **args)
