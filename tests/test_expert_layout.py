"""dispatch(layout="expert") and the combine of expert-major rows against the NumPy oracle, and
their gradients against the same layer written with the rank-major layout."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import numpy_oracle as oracle
from helpers import BACKEND, BF16, ep_groups, ep_size, num_shards, routing, smap, stack, to_np
from test_errors import expect_runtime_error
from test_high_throughput import TOL, assert_same_bits, make_x, x_arg

E = 8


@functools.lru_cache(maxsize=None)
def expert_fn(mesh, alignment=1, capacity=None, has_w=True, check=None, backend=BACKEND,
              num_experts=E):
    """(x, idx, w, y) -> (ExpertDispatchResult, combine(y, handle))."""

    def f(x, idx, w, y):
        res = jax_ep.dispatch(x, idx, w if has_w else None, num_experts=num_experts,
                              layout="expert",
                              expert_alignment=alignment, capacity=capacity, backend=backend,
                              check=check)
        return res, jax_ep.combine(y, res.handle, backend=backend)

    return smap(mesh, f)


def capacity_of(mesh, T, K, alignment, capacity, num_experts=E):
    R = ep_size(mesh)
    L = num_experts // R
    return R * T * min(K, L) + L * (alignment - 1) if capacity is None else capacity


def check_case(mesh, xs, idxs, ws, alignment=1, capacity=None, seed=1, num_experts=E):
    rng = np.random.default_rng(seed)
    n = num_shards(mesh)
    T, K = idxs[0].shape
    fp8 = isinstance(xs[0], tuple)
    H = (xs[0][0] if fp8 else xs[0]).shape[1]
    C = capacity_of(mesh, T, K, alignment, capacity, num_experts)
    ydt = BF16 if fp8 else xs[0].dtype
    ys = [(rng.standard_normal((C, H)) * 2).astype(ydt) for _ in range(n)]  # padding random too
    w_arg = stack(ws) if ws is not None else jnp.zeros((n, T, K), jnp.float32)
    res, out = to_np(expert_fn(mesh, alignment, capacity, ws is not None,
                               num_experts=num_experts)(x_arg(xs), stack(idxs), w_arg, stack(ys)))
    L = num_experts // ep_size(mesh)
    for group in ep_groups(mesh):
        exp = oracle.expert_dispatch([xs[i] for i in group], [idxs[i] for i in group],
                                     None if ws is None else [ws[i] for i in group],
                                     num_experts, alignment, capacity)
        exp_out = oracle.expert_combine([ys[i] for i in group], exp, T)
        for j, i in enumerate(group):
            e, where = exp[j], f"shard {i} (ep rank {j})"
            if fp8:
                for p in range(2):
                    assert_same_bits(res.recv_x[p][i], e["recv_x"][p], f"recv_x[{p}] {where}")
            else:
                assert_same_bits(res.recv_x[i], e["recv_x"], f"recv_x {where}")
            if ws is None:
                assert res.recv_weights is None
            else:
                assert_same_bits(res.recv_weights[i], e["recv_weights"], f"recv_weights {where}")
            for name in ("expert_sizes", "expert_offsets", "recv_tokens_per_expert"):
                got = getattr(res, name)
                assert got.shape == (n, L) and got.dtype == np.int32, name
                np.testing.assert_array_equal(got[i], e[name], f"{name} {where}")
            assert res.recv_count[i] == e["recv_count"], where
            # the token of each row (source rank * T + token), -1 on padding
            src, recv_src = res.handle.src[i], res.handle.rank.recv_src[i]
            row_src = np.where(src >= 0, recv_src[np.maximum(src, 0) // K], -1)
            np.testing.assert_array_equal(row_src, e["row_src"], f"row sources {where}")
            assert res.handle.num_dropped[i] == e["num_dropped"], where
            assert res.handle.num_invalid[i] == e["num_invalid"], where
            want = exp_out[j].astype(ydt).astype(np.float32)
            tol = TOL[np.dtype(ydt)]
            np.testing.assert_allclose(out[i].astype(np.float32), want, rtol=tol,
                                       atol=tol * max(1.0, np.abs(want).max()), err_msg=where)
    assert (res.recv_x[0] if fp8 else res.recv_x).shape == (n, C, H)
    return res


@pytest.mark.parametrize("bound", [1, 31, 255, 256, 65535, 65536])
def test_the_layout_order_sorts_by_expert_on_a_narrow_key(bound):
    """order_by_key (the layout's sort, on the narrowest unsigned type that holds the bound):
    the keys below the bound in stable order, every key from the bound up after them, at each
    width's edge."""
    from jax_ep._common import order_by_key
    rng = np.random.default_rng(bound)
    key = rng.integers(0, bound + 3, 4096).astype(np.int32)
    key[:8] = [bound - 1, 0, bound, bound + 2, bound - 1, 0, bound + 1, bound]
    got = np.asarray(order_by_key(jnp.asarray(key), bound))
    below = np.flatnonzero(key < bound)
    want = below[np.argsort(key[below], kind="stable")]
    np.testing.assert_array_equal(got[:below.size], want)
    assert sorted(got[below.size:]) == sorted(np.flatnonzero(key >= bound).tolist())


@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("kind", ["random", "skewed", "masked", "invalid", "dups"])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4", "dp_ep_perm"])
def test_expert_layout_vs_oracle(meshes, mesh_name, kind, alignment):
    mesh = meshes[mesh_name]
    n = num_shards(mesh)
    rng = np.random.default_rng(hash((mesh_name, kind, alignment)) % 2**32)
    T, K = 7, 3
    xs = make_x(rng, n, T, 16, "float32")
    idxs = routing(rng, n, T, K, E, kind)
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(n)]
    check_case(mesh, xs, idxs, ws, alignment)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "fp8"])
def test_expert_layout_dtypes(mesh4, dtype):
    rng = np.random.default_rng(3)
    xs = make_x(rng, 4, 5, 256, dtype)
    idxs = routing(rng, 4, 5, 2, E, "masked")
    ws = [rng.random((5, 2)).astype(np.float32) for _ in range(4)]
    check_case(mesh4, xs, idxs, ws, alignment=8)


def test_expert_layout_without_weights_weighs_one(mesh2):
    rng = np.random.default_rng(4)
    xs = make_x(rng, 2, 6, 8, "float32")
    idxs = routing(rng, 2, 6, 2, E, "dups")
    check_case(mesh2, xs, idxs, None, alignment=2)


def test_expert_layout_segments(mesh2):
    """Segments aligned and ordered by source rank then token, padding zero: spelled out."""
    T, K, A = 3, 2, 4
    # rank 0 holds experts 0..3. Rank 0's tokens: t0 -> (1, 0), t1 -> (5, -1), t2 -> (1, 1).
    # Rank 1's tokens: t0 -> (0, 6), t1 -> (-1, 1), t2 -> (7, 4).
    idx = [np.array([[1, 0], [5, -1], [1, 1]], np.int32),
           np.array([[0, 6], [-1, 1], [7, 4]], np.int32)]
    xs = [np.arange(T, dtype=np.float32)[:, None] + 10 * s + np.zeros((T, 4), np.float32)
          for s in range(2)]
    ws = [np.full((T, K), 0.5, np.float32)] * 2
    res = check_case(mesh2, xs, idx, ws, alignment=A)
    # On rank 0: expert 0 gets (s0 t0), (s1 t0); expert 1 gets (s0 t0), (s0 t2) once with both
    # slots' weights, (s1 t1).
    np.testing.assert_array_equal(res.expert_offsets[0], [0, 4, 8, 8])
    np.testing.assert_array_equal(res.expert_sizes[0], [4, 4, 0, 0])
    np.testing.assert_array_equal(res.recv_tokens_per_expert[0], [2, 3, 0, 0])
    np.testing.assert_array_equal(res.recv_x[0][:8, 0], [0, 10, 0, 0, 0, 2, 11, 0])
    np.testing.assert_array_equal(res.recv_weights[0][:8], [.5, .5, 0, 0, .5, 1, .5, 0])
    assert not res.recv_x[0][8:].any()


def test_expert_layout_capacity_drops_are_counted(mesh2):
    rng = np.random.default_rng(5)
    xs = make_x(rng, 2, 6, 8, "float32")
    idxs = routing(rng, 2, 6, 3, E, "random")
    ws = [rng.random((6, 3)).astype(np.float32) for _ in range(2)]
    res = check_case(mesh2, xs, idxs, ws, alignment=4, capacity=9)
    assert (res.handle.num_dropped > 0).all()
    x, idx = x_arg(xs), stack(idxs)
    total = int(res.handle.num_dropped.sum())
    expect_runtime_error(
        lambda: expert_fn(mesh2, 4, 9, True, True)(x, idx, stack(ws), jnp.zeros((2, 9, 8))),
        rf"tokens or \(token, expert\) rows dropped.*\(0 and {total} over all shards\)")


@pytest.mark.parametrize("case", ["one_expert", "two_experts"])
def test_expert_layout_short_capacity_drops_in_two_stages(mesh2, case):
    """A short capacity first limits the tokens a rank receives to min(capacity, R * T), shared
    fairly across the sources, then drops the kept tokens' rows at or past capacity (last
    expert first); num_dropped counts the tokens of the first stage and the rows of the second.
    R = 2, T = 2: token t of source s carries the value 10 * s + t."""
    T = 2
    xs = [np.full((T, 4), 10 * s, np.float32) + np.arange(T, dtype=np.float32)[:, None]
          for s in range(2)]
    ws = [np.full((T, 2), 0.5, np.float32)] * 2
    if case == "one_expert":
        # E = 2, every token -> expert 0, capacity 2: one token of each source crosses (the
        # fair share), not both tokens of source 0; the two others are dropped.
        idxs = [np.zeros((T, 1), np.int32)] * 2
        res = check_case(mesh2, xs, idxs, [w[:, :1] for w in ws], capacity=2, num_experts=2)
        np.testing.assert_array_equal(res.recv_x[0][:, 0], [0, 10])
        np.testing.assert_array_equal(res.recv_tokens_per_expert[0], [2])
        np.testing.assert_array_equal(res.handle.num_dropped, [2, 0])
    else:
        # E = 4, every token -> experts 0 and 1 (both on rank 0), capacity 3: three of the
        # four tokens cross (a source's fair share is 1, the row left over goes to source 1,
        # the next after rank 0); expert 0's rows fill the buffer, expert 1's three are
        # dropped: 1 token + 3 rows.
        idxs = [np.tile(np.array([0, 1], np.int32), (T, 1))] * 2
        res = check_case(mesh2, xs, idxs, ws, capacity=3, num_experts=4)
        np.testing.assert_array_equal(res.recv_x[0][:, 0], [0, 10, 11])
        np.testing.assert_array_equal(res.recv_tokens_per_expert[0], [3, 0])
        np.testing.assert_array_equal(res.expert_offsets[0], [0, 3])
        np.testing.assert_array_equal(res.handle.num_dropped, [4, 0])


def test_expert_layout_empty_shards(mesh2):
    f = expert_fn(mesh2, 4)
    res, out = to_np(f(jnp.zeros((2, 0, 8)), jnp.zeros((2, 0, 2), jnp.int32),
                       jnp.zeros((2, 0, 2)), jnp.zeros((2, E // 2 * 3, 8))))
    assert res.recv_x.shape == (2, E // 2 * 3, 8) and out.shape == (2, 0, 8)
    assert not res.recv_x.any() and not res.expert_sizes.any()


def _dense(x, idx, w, L, R):
    """out[t] = sum_k w[t, k] * (1 + e_k % L) * x[t]^2 over valid slots (all tokens of every
    rank stacked)."""
    ok = (idx >= 0) & (idx < R * L)
    scale = jnp.where(ok, w * (1 + jnp.where(ok, idx, 0) % L), 0.0)
    return jnp.sum(scale, axis=1)[:, None] * x * x


@pytest.mark.parametrize("mesh_name,kind", [("ep4", "invalid"), ("dp_ep", "dups")])
def test_expert_layout_gradients(meshes, mesh_name, kind):
    """x^2 times a per-expert factor, through dispatch -> rows -> combine: values and gradients
    in x and topk_weights equal the dense formula's."""
    mesh = meshes[mesh_name]
    n, R = num_shards(mesh), ep_size(mesh)
    L = E // R
    rng = np.random.default_rng(6)
    T, K, H = 5, 3, 4
    x = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, kind)))
    w = jnp.asarray(rng.random((n, T, K)), jnp.float32)

    def layer(x, idx, w):
        res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", expert_alignment=2,
                              backend=BACKEND)
        rows = jnp.arange(res.recv_x.shape[0])
        local = jnp.sum(rows[:, None] >= res.expert_offsets[None, 1:], axis=1)   # expert of row
        y = res.recv_x * res.recv_x * (1.0 + local)[:, None]
        return jax_ep.combine(y, res.handle, backend=BACKEND)

    def loss_ep(x, w):
        out = smap(mesh, layer, jit=False)(x, idx, w)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    def loss_dense(x, w):
        out = _dense(x.reshape(n * T, H), idx.reshape(n * T, K), w.reshape(n * T, K), L, R)
        return jnp.sum(out.reshape(n, T, H) * jnp.cos(jnp.arange(n * T * H).reshape(n, T, H)))

    got = jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(loss_dense, argnums=(0, 1))(x, w)
    for g, e, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("loss", "dx", "dw")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_expert_layout_bad_arguments(mesh2):
    x = jnp.zeros((2, 4, 8))
    idx = jnp.zeros((2, 4, 2), jnp.int32)

    def call(**kw):
        return smap(mesh2, lambda x, idx: jax_ep.dispatch(x, idx, num_experts=E,
                                                          **kw).recv_x)(x, idx)

    with pytest.raises(ValueError, match="layout='bogus'"):
        call(layout="bogus")
    with pytest.raises(ValueError, match="expert_alignment must be >= 1"):
        call(layout="expert", expert_alignment=0)
    with pytest.raises(ValueError, match="expert_alignment=4 applies to layout='expert'"):
        call(expert_alignment=4)
    with pytest.raises(TypeError, match="expert_alignment must be a static Python int"):
        call(layout="expert", expert_alignment=2.0)
    with pytest.raises(ValueError, match=r"expert_alignment=536870912: .* must be < 2\^31"):
        call(layout="expert", expert_alignment=2**29)

    def bad_rows(x, idx):
        res = jax_ep.dispatch(x, idx, num_experts=E, layout="expert")
        return jax_ep.combine(res.recv_x[:-1], res.handle)
    with pytest.raises(ValueError, match="y: has 15 rows, expected capacity=16"):
        smap(mesh2, bad_rows)(x, idx)


@pytest.mark.parametrize("R,K,L,max_dups", [(1, 4, 3, 32), (4, 4, 3, 32), (2, 40, 40, 32),
                                             (4, 8, 8, 3)])
def test_fused_gather_reads_each_token_of_another_rank_once(R, K, L, max_dups):
    """The fused gather's plan against a NumPy oracle: a token of another rank with several
    distinct rows here is read by its lowest row, which also writes the others (listed in
    rows_dups, highest first, at most D = min(K - 1, max_dups)), and the listed rows are marked
    -2; tokens of this rank and tokens with one row are left alone. One rank: nothing changes.
    (The kernel's max_dups is jax_ep._C.fused_max_dups; the plan takes any.)"""
    from jax_ep import fused
    T, Cr = 5, 12
    C = Cr * K + 20
    rng = np.random.default_rng(R)
    ridx = rng.integers(-1, L, size=(R, Cr, K)).astype(np.int32)
    if K == L:   # half the tokens name every expert once: more copies than D
        ridx[:, ::2] = np.stack([rng.permutation(L) for _ in range(R * Cr // 2)]).reshape(
            R, -1, L)
    recv_src = rng.integers(-1, R * T, size=(R, Cr)).astype(np.int32)
    row_of = np.full((R, Cr, K), -1, np.int32)
    for r in range(R):
        free = list(rng.permutation(C))
        for c in range(Cr):
            for k in range(K):
                if ridx[r, c, k] < 0:
                    continue
                same = [q for q in range(k) if ridx[r, c, q] == ridx[r, c, k]]
                row_of[r, c, k] = row_of[r, c, same[0]] if same else free.pop()
    rows_src = rng.integers(-1, R * T, size=(R, C)).astype(np.int32)

    got_src, got_dups = jax.vmap(
        lambda s, o, rs: fused._dedup_plan(s, o, rs, T, "ep", max_dups), axis_name="ep")(
            rows_src, row_of, recv_src)
    got_src, got_dups = np.asarray(got_src), np.asarray(got_dups)
    D = 0 if R == 1 else min(K - 1, max_dups)
    assert got_dups.shape == (R, C, D)
    want_src, want_dups = rows_src.copy(), np.full((R, C, D), -1, np.int32)
    marked = 0
    for r in range(R if R > 1 else 0):
        for c in range(Cr):
            rows = sorted({int(row_of[r, c, k]) for k in range(K) if row_of[r, c, k] >= 0})
            if recv_src[r, c] < 0 or recv_src[r, c] // T == r or len(rows) < 2:
                continue
            listed = rows[1:][::-1][:D]
            want_dups[r, rows[0], :len(listed)] = listed
            want_src[r, listed] = -2
            marked += len(listed)
    np.testing.assert_array_equal(got_src, want_src)
    np.testing.assert_array_equal(got_dups, want_dups)
    assert marked > 0 or R == 1


def test_a_receive_that_gave_up_poisons_every_expert_major_result():
    """The expert-major results that XLA derives from a rank-major receive whose wait gave up
    (its kernels left NaN floats and sentinel ints, docs/API.md#timeouts) are poisoned too:
    every float NaN, every int the sentinel. A healthy receive gives the same results with
    and without that handling."""
    from jax_ep import expert_layout as el
    from jax_ep.high_throughput import DispatchHandle
    from test_errors import poison_values
    sentinel = poison_values()[1]
    C, K, L, H, cap = 6, 2, 3, 4, 9
    rng = np.random.default_rng(3)
    ridx = jnp.asarray(rng.integers(-1, L, (C, K)), jnp.int32)
    rw = jnp.asarray(rng.random((C, K)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((C, H)), jnp.float32)
    i32 = lambda v, shape=(): jnp.full(shape, v, jnp.int32)  # noqa: E731
    handle = DispatchHandle(jnp.arange(C, dtype=jnp.int32), i32(0, (C, 2)), i32(C), i32(0),
                            i32(0))
    for has_w in (True, False):
        plain = el.to_expert_major(x, ridx, rw, handle, L, cap, 2, has_w)
        kept = el.to_expert_major(x, ridx, rw, handle, L, cap, 2, has_w, sentinel)
        jax.tree.map(np.testing.assert_array_equal, to_np(plain), to_np(kept))
        gone = DispatchHandle(i32(sentinel, (C,)), i32(sentinel, (C, 2)), i32(sentinel),
                              i32(sentinel), i32(sentinel))
        res = el.to_expert_major(jnp.full((C, H), jnp.nan), i32(sentinel, (C, K)),
                                 jnp.full((C, K), jnp.nan), gone, L, cap, 2, has_w, sentinel)
        leaves = jax.tree_util.tree_leaves_with_path(res)
        assert len(leaves) == (15 if has_w else 14)
        for path, a in leaves:
            a = np.asarray(a)
            if jnp.issubdtype(a.dtype, jnp.floating):
                assert np.isnan(a).all(), jax.tree_util.keystr(path)
            else:
                assert (a == sentinel).all(), (jax.tree_util.keystr(path), a)


@pytest.mark.parametrize("kind", ["random", "masked", "dups"])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4"])
def test_fused_combine_backward_rule_equals_the_unfused_ops(meshes, mesh_name, kind,
                                                            monkeypatch):
    """The fused GEMM + combine's backward rule (the routing weights moved to the other side of
    the GEMM, docs/kernels.md#fused-backward-weights) against autodiff of the ops it fuses,
    combine(grouped_matmul(a, w, sizes), handle): the cotangents of a, w and the routing
    weights, in float32, its grouped GEMM on the reference."""
    from jax_ep import _checks, fused, grouped_gemm, high_throughput
    mesh = meshes[mesh_name]
    n, R = num_shards(mesh), ep_size(mesh)
    L = E // R
    rng = np.random.default_rng(8)
    T, K, H, I = 6, 3, 8, 4
    x = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, kind)))
    w = jnp.asarray(rng.random((n, T, K)), jnp.float32)
    C = capacity_of(mesh, T, K, 4, None)
    a = jnp.asarray(rng.standard_normal((n, C, I)), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((n, L, I, H)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)

    def reference_gmm(lhs, rhs, sizes, counts, acc=None):
        return grouped_gemm._gmm_diff(lhs, rhs, sizes, counts, acc,
                                      grouped_gemm._Config(jnp.dtype(lhs.dtype), False))
    monkeypatch.setattr(grouped_gemm, "padded_segments_matmul", reference_gmm)

    def both(x, idx, w, a, wd, g):
        res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", expert_alignment=4,
                              backend=BACKEND)
        h = res.handle
        a = a * (res.recv_weights != 0)[:, None]   # the padding rows are zeros, as the kernel's

        def ops(a, wd, weights):
            y = jax_ep.grouped_matmul(a, wd, res.expert_sizes, backend=BACKEND)
            return jax_ep.combine(y, h._replace(weights=weights), backend=BACKEND)
        _, vjp = jax.vjp(ops, a, wd, h.weights)
        cfg = high_throughput._Config(0, h.rank.recv_src.shape[0], "ep",
                                      _checks.resolve_backend(BACKEND, empty=False))
        rule = fused._matmul_combine_bwd(
            fused._GemmCombineConfig(cfg, K, 0),
            (a, wd, h.weights, res.expert_sizes, res.recv_tokens_per_expert, h.row_of, h.src,
             h.rank, None, None), g)[:3]
        return vjp(g), rule

    want, got = to_np(smap(mesh, both)(x, idx, w, a, wd, g))
    for name, e, r in zip(("d a", "d w_down", "d topk_weights"), want, got):
        assert np.abs(e).max() > 0, name   # a zero cotangent would check nothing
        np.testing.assert_allclose(r, e, rtol=1e-4, atol=1e-4, err_msg=name)


def _kernel_stand_ins(monkeypatch):
    """The fused kernels' contracts (docs/ffi.md) in plain JAX, so that the backward rules'
    CUDA branch runs on a CPU: jax_ep_ht_gather_gemm (rows from every rank's x, copies written
    by the row that lists them) and jax_ep_ht_gemm_combine (each received token's rows summed
    with its weights, then over the ranks), both with w read transposed on request."""
    import types
    from jax_ep import fused, grouped_gemm, runtime

    def product(a, w, sizes, k_major):
        w = jnp.swapaxes(w, 1, 2) if k_major else w
        return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)

    def gather_gemm(x, w, rows_src, rows_dups, sizes, fcfg, write_h=True):
        assert write_h, "the backward's kernel runs with h written"
        xs = jax.lax.all_gather(x, fcfg.cfg.axis_name, tiled=True)          # [R * T, H]
        xe = el_take(xs, jnp.where(rows_src >= 0, rows_src, -1))
        C, D = rows_dups.shape
        rows = jnp.broadcast_to(jnp.arange(C)[:, None], (C, D))
        xe = xe.at[jnp.where(rows_dups >= 0, rows_dups, C)].set(xe[rows], mode="drop")
        return xe, product(xe, w, sizes, fcfg.w_k_major).astype(x.dtype), None

    def gemm_combine(a, w, weights, sizes, row_of, rank, ccfg, w_k_major=False, addend=None):
        ye = product(a, w, sizes, w_k_major).astype(a.dtype)
        Cr, K = row_of.shape
        yr = jnp.sum(el_take(ye, row_of.reshape(-1)).reshape(Cr, K, -1).astype(jnp.float32)
                     * weights[:, :, None], axis=1).astype(a.dtype)
        yrs = jax.lax.all_gather(yr, ccfg.cfg.axis_name)                      # [R, Cr, N]
        R = yrs.shape[0]
        got = [el_take(yrs[q], rank.send_rows[:, q]).astype(jnp.float32) for q in range(R)]
        out = sum(got).astype(a.dtype)
        return ye, out if addend is None else fused.plus_addend(out, addend)

    def weight_grad(lhs, g, sizes, counts, acc=None):
        # per segment l: lhs^T @ g over its first counts[l] rows, plus acc
        ends = jnp.cumsum(sizes)
        j = jnp.arange(lhs.shape[0])
        seg = jnp.searchsorted(ends, j, side="right")
        held = j - (ends - sizes)[jnp.minimum(seg, sizes.shape[0] - 1)] < counts[
            jnp.minimum(seg, sizes.shape[0] - 1)]
        onehot = ((seg[:, None] == jnp.arange(sizes.shape[0])) & held[:, None]).astype(
            jnp.float32)
        d = jnp.einsum("jl,jk,jn->lkn", onehot, lhs, g.astype(jnp.float32))
        return (d if acc is None else d + acc.astype(jnp.float32)).astype(lhs.dtype)

    from jax_ep.expert_layout import take_rows as el_take
    monkeypatch.setattr(fused, "_gather_gemm_call", gather_gemm)
    monkeypatch.setattr(fused, "_gemm_combine_call", gemm_combine)
    monkeypatch.setattr(grouped_gemm, "padded_segments_weight_grad", weight_grad)
    monkeypatch.setattr(runtime, "extension", lambda: types.SimpleNamespace(fused_max_dups=32))


@pytest.mark.parametrize("kind", ["random", "masked", "dups"])
@pytest.mark.parametrize("mesh_name", ["ep2", "ep4"])
def test_fused_backward_kernel_rules_equal_the_unfused_ops(meshes, mesh_name, kind, monkeypatch):
    """The fused backward rules' kernel branch (the gather of the output's cotangent fused with
    the product by W_down^T; the product by W_gate_up^T fused with the combine), the kernels
    replaced by their contracts in plain JAX, against autodiff of the unfused ops of each half:
    the wiring of the kernels' operands (the gather plan, w read transposed, each pair's row
    once with weight 1) on a CPU. The rows' cotangent of the first half is symbolically zero
    there (nothing reads the rows in moe_ffn), as the branch requires."""
    from jax_ep import fused, high_throughput
    from jax_ep._common import first_occurrence
    _kernel_stand_ins(monkeypatch)
    mesh = meshes[mesh_name]
    n, R = num_shards(mesh), ep_size(mesh)
    L = E // R
    rng = np.random.default_rng(9)
    T, K, H, I = 6, 3, 8, 6     # (2I != H: a missing transpose cannot pass by its shape)
    x = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    idx = jnp.asarray(np.stack(routing(rng, n, T, K, E, kind)))
    w = jnp.asarray(rng.random((n, T, K)), jnp.float32)
    C = capacity_of(mesh, T, K, 4, None)
    a = jnp.asarray(rng.standard_normal((n, C, I)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((n, L, H, 2 * I)), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((n, L, I, H)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((n, T, H)), jnp.float32)
    g_h = jnp.asarray(rng.standard_normal((n, C, 2 * I)), jnp.float32)

    def both(x, idx, w, a, wgu, wd, g, g_h):
        def first(x, wgu):
            res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", expert_alignment=4,
                                  backend="reference")
            return jax_ep.grouped_matmul(res.recv_x, wgu, res.expert_sizes,
                                         backend="reference"), res
        _, vjp1, res = jax.vjp(first, x, wgu, has_aux=True)
        hd = res.handle
        want1 = vjp1(g_h)
        a = a * (res.recv_weights != 0)[:, None]   # the padding rows are zeros, as the kernel's

        def ops(a, wd, weights):
            y = jax_ep.grouped_matmul(a, wd, res.expert_sizes, backend="reference")
            return jax_ep.combine(y, hd._replace(weights=weights), backend="reference")
        _, vjp2 = jax.vjp(ops, a, wd, hd.weights)
        cfg = high_throughput._Config(0, hd.rank.recv_src.shape[0], "ep", "cuda")
        # the weight gradients come added to an accumulator (the extra passes' sum)
        acc2, acc1 = jnp.full(wd.shape, 0.5, wd.dtype), jnp.full(wgu.shape, 0.25, wgu.dtype)
        d_a, d_wd, d_weights = fused._matmul_combine_bwd(
            fused._GemmCombineConfig(cfg, K, 0),
            (a, wd, hd.weights, res.expert_sizes, res.recv_tokens_per_expert, hd.row_of, hd.src,
             hd.rank, acc2, None), g)[:3]
        row_first = jnp.where(first_occurrence(hd.row_of), hd.row_of, -1)
        zero = jax.custom_derivatives.SymbolicZero(jax.core.ShapedArray((C, H), x.dtype))
        d_x, d_wgu = fused._gather_matmul_bwd(
            fused._GatherMatmulConfig(cfg, K, 0),
            (res.recv_x, wgu, res.expert_sizes, res.recv_tokens_per_expert, hd.src, row_first,
             hd.rank, acc1), (zero, g_h))[:2]
        return vjp2(g), (d_a, d_wd - acc2, d_weights), want1, (d_x, d_wgu - acc1)

    want2, got2, want1, got1 = to_np(smap(mesh, both)(x, idx, w, a, wgu, wd, g, g_h))
    for name, e, r in zip(("d a", "d w_down", "d topk_weights", "d x", "d w_gate_up"),
                          (*want2, *want1), (*got2, *got1)):
        assert np.abs(e).max() > 0, name   # a zero cotangent would check nothing
        np.testing.assert_allclose(r, e, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", ["random", "masked", "skewed", "invalid", "dups"])
@pytest.mark.parametrize("T, short", [(0, False), (1, False), (5, False), (33, False),
                                      (33, True), (300, True)])
def test_the_one_rank_routing_equals_the_dispatch(kind, T, short):
    """The fused layer's routing over one rank, in XLA ops, against the routing dispatch (a
    dispatch of zero-width rows) of the reference backend, the CUDA kernel's specification:
    the same received ids, weights and handle, with drops where the capacity is short, and the
    same weight gradient. (Past 128 tokens the positions take inclusive_count's blocks.)"""
    from jax_ep import high_throughput as ht
    K, E = 4, 8
    rng = np.random.default_rng(T)
    idx = routing(rng, 1, T, K, E, kind)[0] if T else np.zeros((0, K), np.int32)
    w = rng.standard_normal((T, K)).astype(np.float32)
    c = rng.standard_normal((T // 2 if short else T + 3, K)).astype(np.float32)
    cfg = ht._Config(E, c.shape[0], "ep", "reference")

    def dispatch(w, idx):
        _, ridx, rw, _, handle = ht._dispatch_diff(jnp.zeros((T, 0), jnp.float32), w, idx,
                                                   cfg)
        return ridx, rw, handle

    def run(f):
        def weighted(w, idx, c):   # a scalar of the received weights, for their gradient
            return jnp.sum(f(w, idx)[1] * c)
        out = jax.vmap(f, axis_name="ep")(w[None], idx[None])
        grad = jax.vmap(jax.grad(weighted), axis_name="ep")(w[None], idx[None], c[None])
        return [np.asarray(a) for a in jax.tree.leaves(out)] + [np.asarray(grad)]

    got = run(lambda w, idx: ht.routing_one_rank(w, idx, cfg))
    C = cfg.capacity
    # (with no tokens the reference cannot gather into a capacity: its padding spelled out)
    want = run(dispatch) if T else [
        np.full((1, C, K), -1), np.zeros((1, C, K)), np.full((1, C), -1),
        np.zeros((1, 0, 1)), [0], [0], [0], np.zeros((1, 0, K))]
    for a, b, field in zip(got, want, ("recv_topk_idx", "recv_topk_weights", "recv_src",
                                       "send_rows", "recv_count", "num_dropped", "num_invalid",
                                       "d w")):
        np.testing.assert_array_equal(a, b, err_msg=field)
    sent = int(np.sum(np.any((idx >= 0) & (idx < E), axis=1)))
    assert int(want[5][0]) == max(0, sent - cfg.capacity), "the drops this routing makes"


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 16385])
def test_inclusive_count_is_cumsum(n):
    """The masked block sums against np.cumsum, within a block, past one and past a block of
    blocks (its recursion), on flags and on counts."""
    from jax_ep._common import inclusive_count
    rng = np.random.default_rng(n)
    flags = rng.random(n) < 0.6
    counts = rng.integers(-3, 9, n).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(inclusive_count(jnp.asarray(flags))),
                                  np.cumsum(flags))
    np.testing.assert_array_equal(np.asarray(inclusive_count(jnp.asarray(counts), 8)),
                                  np.cumsum(counts))
    with pytest.raises(ValueError, match="block=1"):
        inclusive_count(jnp.asarray(flags), 1)
