"""GPU suite: the CUDA kernels against the reference backend, on the same GPUs.

Marked `gpu` (skipped without CUDA GPUs). Run: scripts/gpu_check.sh, or
`pytest -m gpu tests/test_gpu.py`. Each check runs both backends in one program over R ranks,
poisons the device memory pool first (so unwritten output rows show up), and compares: layouts
and copies bit-exact, combines within float32-accumulation tolerance. The R ranks are R GPUs
when the machine has them, else R virtual ranks on one GPU (jax_ep.testing; force them with
JAX_EP_VIRTUAL_RANKS=1).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from helpers import gpu_devices as _gpus, gpu_ranks as _ranks, poison_gpu_memory as _poison
from helpers import run_with_command_buffers

pytestmark = pytest.mark.gpu


def _mesh(n, names=("ep",), order=None):
    g = _gpus()
    if len(g) < n:
        pytest.skip(f"needs {n} GPUs, have {len(g)}")
    devs = [g[i] for i in (order or range(n))]
    shape = (n,) if len(names) == 1 else (2, n // 2)
    return Mesh(np.array(devs).reshape(shape), names)


def _routing(kind, rng, R, T, K, E):
    if kind == "random":
        idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]) if K <= E else \
            rng.integers(0, E, (R * T, K))
    elif kind == "skewed":     # everything to expert 0 (plus -1)
        idx = np.full((R * T, K), -1)
        idx[:, 0] = 0
    elif kind == "masked":     # random with -1 slots, duplicates and invalid ids
        idx = rng.integers(-1, E, (R * T, K))
        idx[rng.random((R * T, K)) < 0.3] = -1
        idx[rng.random((R * T, K)) < 0.02] = E + 3
    else:
        raise ValueError(kind)
    return idx.astype(np.int32)


def _ht_body(E, capacity=None, axis="ep", backends=("cuda", "reference")):
    """shard_map body running dispatch + combine on both backends (cuda first)."""
    def body(x, idx, w):
        outs = []
        for be in backends:
            r = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity, axis_name=axis,
                                backend=be)
            rx = r.recv_x if not isinstance(r.recv_x, tuple) else r.recv_x[0]
            y = (rx.astype(jnp.float32) * 0.5).astype(jnp.bfloat16) if rx.dtype == \
                jnp.float8_e4m3fn else rx
            out = jax_ep.combine(y, r.handle, axis_name=axis, backend=be)
            scales = r.recv_x[1] if isinstance(r.recv_x, tuple) else jnp.zeros((1,), jnp.float32)
            outs.append((rx, scales, r.recv_topk_idx, r.recv_topk_weights, r.recv_count[None],
                         r.recv_tokens_per_expert, r.handle.recv_src, r.handle.send_rows,
                         r.handle.num_dropped[None], r.handle.num_invalid[None], out))
        return outs
    return body


def _ht_run(mesh, x, idx, w, E, capacity=None, axis="ep"):
    """mesh: a Mesh, or the number of ranks R (R GPUs or R virtual ranks, _ranks)."""
    if isinstance(mesh, int):
        f = _ranks(_ht_body(E, capacity, axis), mesh)
    else:
        spec = P(mesh.axis_names) if len(mesh.axis_names) > 1 else P("ep")
        f = jax.jit(jax.shard_map(_ht_body(E, capacity, axis), mesh=mesh, in_specs=spec,
                                  out_specs=spec, check_vma=False))
    _poison()
    return jax.device_get(f(x, idx, w))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _assert_ht_equal(cu, rf, atol):
    names = ["recv_x", "scales", "recv_topk_idx", "recv_topk_weights", "recv_count",
             "per_expert", "recv_src", "send_rows", "num_dropped", "num_invalid"]
    for n, a, b in zip(names, cu[:10], rf[:10]):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=n)
    a, b = np.asarray(cu[10], np.float32), np.asarray(rf[10], np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=atol, atol=atol, err_msg="combine")


def _assert_ll_equal(cu, rf, x, T, M, use_fp8, round_scale, R, L):
    """_ll_body's outputs from the CUDA backend (cu) against the reference (rf), for the R ranks
    this process holds (one process per GPU: R = 1), T tokens per rank. Rows compare
    order-independently; FP8 payloads and scales exactly against the NumPy oracle's quantisation
    of each source row of x (the global [ranks * T, H] input). Returns (rows_c, rows_r)."""
    from numpy_oracle import quantize_fp8 as np_quantize
    np.testing.assert_array_equal(cu[2], rf[2], err_msg="recv_count")
    np.testing.assert_array_equal(cu[5], rf[5], err_msg="num_invalid")
    rows_c = _ll_rows(cu[0], cu[1], cu[2], cu[3], R, L)
    rows_r = _ll_rows(rf[0], rf[1], rf[2], rf[3], R, L)
    assert rows_c.keys() == rows_r.keys()
    if not use_fp8:
        assert rows_c == rows_r
    else:
        q_all, s_all = np_quantize(np.asarray(x, np.float32), round_scale)
        q_all = np.asarray(q_all).view(np.uint8)
        for k, (payload, scales) in rows_c.items():
            src = (k[2] // M) * T + k[2] % M
            if payload != q_all[src].tobytes():
                got = np.frombuffer(payload, np.uint8)
                bad = np.nonzero(got != q_all[src])[0]
                # which source row does the payload match, if any?
                match = [int(j) for j in np.nonzero((q_all == got[None]).all(1))[0][:3]]
                nbad = sum(p2 != q_all[(k2[2] // M) * T + k2[2] % M].tobytes()
                           for k2, (p2, _) in rows_c.items())
                raise AssertionError(f"FP8 payload of row {k} (source row {src}) != oracle: "
                                     f"{bad.size} bytes differ (first {bad[:6].tolist()}), "
                                     f"{int((got == 0).sum())} zero bytes; payload equals "
                                     f"oracle rows {match}; {nbad} of {len(rows_c)} rows bad")
            assert scales == np.asarray(s_all[src], np.float32).tobytes(), f"scales of {k}"
    # recv_slot (the top-k slot combine returns each row to) matches per (rank, expert, source)
    assert _ll_slots(cu[2], cu[3], cu[4], R, L) == _ll_slots(rf[2], rf[3], rf[4], R, L)
    # src_rows (the combine's pre-reduction table): the same (rank, source, slot) -> expert map
    np.testing.assert_array_equal(_ll_src_rows(cu[2], cu[3], cu[7], R, L),
                                  _ll_src_rows(rf[2], rf[3], rf[7], R, L), err_msg="src_rows")
    a, b = np.asarray(cu[6], np.float32), np.asarray(rf[6], np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=5e-2)
    # The kernels' partial sums carry 16 significant bits: only an output near a bf16 rounding
    # boundary may round the other way (truncated partials would move ~half of them). Over a
    # few tokens the fraction is noise (one token of 2048 columns: 7.7% once, with cancelling
    # terms), so it is checked from 32 tokens on.
    differ = float(np.mean(a != b))
    print(f"combine: {differ:.4%} of {a.shape[0]} tokens' outputs differ from the reference")
    if a.shape[0] >= 32:
        assert differ < 0.05, differ
    return rows_c, rows_r


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["random", "skewed", "masked"])
@pytest.mark.parametrize("T,H,dtype", [(64, 2048, jnp.bfloat16), (33, 4096, jnp.float32),
                                       (1, 7168, jnp.bfloat16), (77, 7168, jnp.float16)])
def test_ht_matches_reference(R, kind, T, H, dtype):
    rng = np.random.default_rng(hash((R, kind, T, H)) % 2**32)
    E, K = 8 * R, 4
    mesh = R
    x = jnp.asarray(rng.standard_normal((R * T, H)), dtype)
    idx = jnp.asarray(_routing(kind, rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ht_run(mesh, x, idx, w, E)
    _assert_ht_equal(cu, rf, 2e-2 if dtype != jnp.float32 else 1e-5)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ht_fp8_and_capacity(R):
    rng = np.random.default_rng(R)
    T, H, K, E = 96, 2048, 8, 16 * R
    mesh = R
    xq, xs = jax_ep.quantize_fp8(jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32))
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ht_run(mesh, (xq, xs), idx, w, E)
    _assert_ht_equal(cu, rf, 2e-2)
    cu, rf = _ht_run(mesh, (xq, xs), idx, w, E, capacity=T // 2)   # overflow: drops
    assert int(np.asarray(cu[8]).sum()) > 0
    _assert_ht_equal(cu, rf, 2e-2)


@pytest.mark.parametrize("R", [4, 8])
def test_ht_capacity_drops_are_fair(R):
    """Sources sending very different numbers of tokens to a short rank 0: the kernel keeps the
    reference's fair shares (rows, send_rows, counts bit-exact), chunk boundaries included."""
    rng = np.random.default_rng(40 + R)
    T, H, K, E = 300, 512, 2, 2 * R
    idx = np.full((R, T, K), -1, np.int32)
    for s in range(R):  # source s: its first n_s tokens to expert 0 (rank 0), others elsewhere
        n = [T, 7, 180, 33, 0, 95, 260, 1][s]
        idx[s, :n, 0] = 0
        idx[s, :, 1] = rng.integers(2, E, T)
    idx = jnp.asarray(idx.reshape(R * T, K))
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ht_run(R, x, idx, w, E, capacity=2 * T // 3)
    assert int(np.asarray(cu[8]).reshape(R)[0]) > 0   # rank 0 drops
    _assert_ht_equal(cu, rf, 2e-2)


def test_ht_dp_ep_mesh_and_permuted_devices():
    g = _gpus()
    if len(g) < 4:
        pytest.skip("needs 4 GPUs")
    mesh = Mesh(np.array([g[3], g[1], g[2], g[0]]).reshape(2, 2), ("dp", "ep"))
    rng = np.random.default_rng(7)
    T, H, K, E = 40, 1024, 4, 8
    x = jnp.asarray(rng.standard_normal((4 * T, H)), jnp.bfloat16)
    idx = jnp.asarray(_routing("masked", rng, 4, T, K, E))
    w = jnp.asarray(rng.random((4 * T, K)), jnp.float32)
    cu, rf = _ht_run(mesh, x, idx, w, E)
    _assert_ht_equal(cu, rf, 2e-2)


@pytest.mark.parametrize("R", [2, 4])
def test_ht_gradients_match_reference(R):
    rng = np.random.default_rng(3)
    T, H, K, E = 48, 256, 4, 4 * R
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)

    def grads(be):
        def body(x, idx, w):  # each rank's gradient is that of the sum over the ranks
            def loss(x, w):
                r = jax_ep.dispatch(x, idx, w, num_experts=E, backend=be)
                y = jnp.sin(r.recv_x) * jnp.sum(r.recv_topk_weights, axis=1, keepdims=True)
                return jnp.sum(jax_ep.combine(y, r.handle, backend=be) ** 2)
            return jax.grad(loss, argnums=(0, 1))(x, w)
        return _ranks(body, R)(x, idx, w)

    gc = grads("cuda")
    gr = grads("reference")
    for a, b in zip(gc, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
@pytest.mark.parametrize("R", [2, 4])
def test_grad_of_grad_matches_reference(R, mode):
    """Second derivatives through dispatch and combine (the backward passes are the ops
    themselves), CUDA against the reference."""
    rng = np.random.default_rng(5 + R)
    T, H, K, E = 32, 256, 4, 4 * R
    ll = mode == "low_latency"
    x = jnp.asarray(rng.standard_normal((R * T, H)) * 0.5, jnp.bfloat16 if ll else jnp.float32)
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)

    def run(be):
        def body(x, idx, w):
            def layer(x, w):
                if ll:
                    r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                                    use_fp8=False, backend=be)
                    y = jnp.sin(r.recv_x.astype(jnp.float32)).astype(jnp.bfloat16)
                    return jax_ep.low_latency_combine(y, idx, w, r.handle, backend=be)
                r = jax_ep.dispatch(x, idx, w, num_experts=E, backend=be)
                y = jnp.sin(r.recv_x) * jnp.sum(r.recv_topk_weights, axis=1, keepdims=True)
                return jax_ep.combine(y, r.handle, backend=be)

            def loss(x, w):
                return jnp.sum(layer(x, w).astype(jnp.float32) ** 2)

            def gnorm(x, w):
                gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
                return jnp.sum(gx.astype(jnp.float32) ** 2) + jnp.sum(gw ** 2)
            return jax.grad(gnorm, argnums=(0, 1))(x, w)
        return jax.device_get(_ranks(body, R)(x, idx, w))

    _poison()
    for n, a, b in zip(("d x", "d topk_weights"), run("cuda"), run("reference")):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), n
        tol = 5e-2 if ll else 1e-4
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1, np.abs(b).max()), err_msg=n)


@pytest.mark.parametrize("R,capacity", [(1, None), (2, None), (4, None), (8, None), (4, 150)])
def test_ht_expert_layout_matches_reference(R, capacity):
    """layout="expert" (aligned segments, weights, drops past capacity) and the weighted
    combine of its rows, values and gradients, CUDA against the reference."""
    rng = np.random.default_rng(11 + R)
    T, H, K, E, A = 75, 512, 4, 4 * R, 8
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)

    def run(be):
        def body(x, idx, w):
            def loss(x, w):
                r = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert",
                                    expert_alignment=A, capacity=capacity, backend=be)
                y = jnp.sin(r.recv_x.astype(jnp.float32)).astype(jnp.bfloat16)
                out = jax_ep.combine(y, r.handle, backend=be)
                return jnp.sum(out.astype(jnp.float32) ** 2), (
                    r.recv_x, r.recv_weights, r.expert_sizes, r.expert_offsets,
                    r.recv_tokens_per_expert, r.recv_count[None], r.handle.num_dropped[None],
                    out)
            g, aux = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            return aux + g
        return jax.device_get(_ranks(body, R)(x, idx, w))

    _poison()
    cu, rf = run("cuda"), run("reference")
    names = ["recv_x", "recv_weights", "expert_sizes", "expert_offsets",
             "recv_tokens_per_expert", "recv_count", "num_dropped"]
    for n, a, b in zip(names, cu, rf):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=n)
    assert (int(np.asarray(cu[6]).sum()) > 0) == (capacity is not None)
    for n, a, b in zip(("combine", "d x", "d topk_weights"), cu[7:], rf[7:]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), n
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * max(1, np.abs(b).max()),
                                   err_msg=n)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ht_scan_back_to_back(R):
    """500 dispatch+combine pairs in one scan, fresh routing each step, vs the reference."""
    steps, T, H, K, E = 500, 32, 256, 4, 4 * R
    rng = np.random.default_rng(11)
    xs = jnp.asarray(rng.standard_normal((steps, R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([_routing("masked", rng, R, T, K, E) for _ in range(steps)]))

    def run(be):
        def body(xs, idx):
            def step(c, inp):
                x, i = inp
                r = jax_ep.dispatch(x, i, num_experts=E, backend=be)
                out = jax_ep.combine(r.recv_x, r.handle, backend=be)
                return c, (out, r.handle.recv_src)
            return jax.lax.scan(step, 0, (xs, idx))[1]
        return _ranks(body, R, ep_dim=1)(xs, idx)

    _poison()
    oc, sc = jax.device_get(run("cuda"))
    orf, srf = jax.device_get(run("reference"))
    np.testing.assert_array_equal(sc, srf)
    np.testing.assert_allclose(np.asarray(oc, np.float32), np.asarray(orf, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ht_calls_on_fresh_buffers(R):
    """One call site called 40 times from Python on inputs that all stay alive, so every call
    publishes new addresses (inside a scan they repeat): a rank that read a late peer's
    addresses of the previous call would copy that call's rows. Against the reference."""
    steps, T, H, K, E = 40, 24, 512, 4, 4 * R
    rng = np.random.default_rng(13)
    xs = [jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16) for _ in range(steps)]
    idx = [jnp.asarray(_routing("masked", rng, R, T, K, E)) for _ in range(steps)]

    def body(be):
        def f(x, i):
            r = jax_ep.dispatch(x, i, num_experts=E, backend=be)
            return r.recv_x, r.handle.recv_src, jax_ep.combine(r.recv_x, r.handle, backend=be)
        return _ranks(f, R)

    cuda, ref = body("cuda"), body("reference")
    _poison()
    got = [cuda(xs[s], idx[s]) for s in range(steps)]
    for s in range(steps):
        want = ref(xs[s], idx[s])
        for name, a, b in zip(("recv_x", "recv_src"), got[s][:2], want[:2]):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"step {s}: {name}")
        np.testing.assert_allclose(np.asarray(got[s][2], np.float32),
                                   np.asarray(want[2], np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=f"step {s}: combine")


def _ll_dispatch(x, idx, split, **kw):
    if not split:
        return jax_ep.low_latency_dispatch(x, idx, **kw)
    pending = jax_ep.low_latency_dispatch_send(x, idx, **kw)
    return jax_ep.low_latency_dispatch_recv(pending)


def _ll_combine(y, idx, w, handle, split, **kw):
    if not split:
        return jax_ep.low_latency_combine(y, idx, w, handle, **kw)
    return jax_ep.low_latency_combine_recv(
        jax_ep.low_latency_combine_send(y, idx, w, handle, **kw))


def _ll_body(E, M, use_fp8, round_scale, split=False, backends=("cuda", "reference")):
    """shard_map body running LL dispatch + combine on both backends (cuda first; the cuda one
    through the send / receive halves when split)."""
    def body(x, idx, w):
        outs = []
        for be in backends:
            r = _ll_dispatch(x, idx, split and be == "cuda", num_experts=E,
                             max_tokens_per_rank=M, use_fp8=use_fp8, round_scale=round_scale,
                             backend=be)
            rx, sc = r.recv_x if use_fp8 else (r.recv_x, jnp.zeros((1,), jnp.float32))
            # Expert outputs as a function of (source token, expert, column) only, exact in
            # bf16: both backends then combine identical values whatever their row order.
            src = r.handle.recv_src[:, :, None]
            col = jnp.arange(rx.shape[-1])[None, None, :]
            lid = jnp.arange(rx.shape[0])[:, None, None]
            y = (((src * 31 + lid * 7 + col) % 13 - 6) / 4).astype(jnp.bfloat16)
            # Make padding rows of y garbage (NaN) on purpose: combine must never read them.
            rows = jnp.arange(y.shape[1])[None, :, None]
            y = jnp.where(rows < r.recv_count[:, None, None], y, jnp.nan)
            out = _ll_combine(y, idx, w, r.handle, split and be == "cuda", backend=be)
            outs.append((rx, sc, r.recv_count, r.handle.recv_src, r.handle.recv_slot,
                         r.handle.num_invalid[None], out, r.handle.src_rows))
        return outs
    return body


def _ll_run(R, x, idx, w, E, M, use_fp8, round_scale, split=False):
    f = _ranks(_ll_body(E, M, use_fp8, round_scale, split), R)
    _poison()
    return jax.device_get(f(x, idx, w))


def _ll_rows(rx, sc, cnt, src, R, L):
    """{(rank, l, src): (payload bits, scales)} over the valid rows, order-independent."""
    rx, cnt, src = np.asarray(rx), np.asarray(cnt), np.asarray(src)
    RM = src.shape[-1]
    rx = rx.reshape(R, L, RM, -1)
    src = src.reshape(R, L, RM)
    cnt = cnt.reshape(R, L)
    sc = np.asarray(sc)
    sc = sc.reshape(R, L, RM, -1) if sc.ndim > 1 else None
    out = {}
    for q in range(R):
        for l in range(L):
            for j in range(cnt[q, l]):
                out[(q, l, int(src[q, l, j]))] = (_bits(rx[q, l, j]).tobytes(),
                                                  None if sc is None else sc[q, l, j].tobytes())
    return out


def _ll_src_rows(cnt, src, rows, R, L):
    """src_rows [R, R*M, K] with each flat row l * R*M + j replaced by its expert l, after
    checking that row j of expert l holds that (source, token): order-independent."""
    src = np.asarray(src)
    RM = src.shape[-1]
    src, cnt = src.reshape(R, L, RM), np.asarray(cnt).reshape(R, L)
    rows = np.asarray(rows).reshape(R, RM, -1)
    out = np.full(rows.shape, -1)
    for q in range(R):
        st, k = np.nonzero(rows[q] >= 0)
        l, j = np.divmod(rows[q][st, k], RM)
        assert (l < L).all() and (j < cnt[q, l]).all(), "src_rows names a row past the count"
        assert (src[q, l, j] == st).all(), "src_rows names the row of another token"
        out[q][st, k] = l
    assert (rows >= -1).all()
    return out


def _ll_slots(cnt, src, slot, R, L):
    """{(rank, l, src): recv_slot} over the valid rows, order-independent."""
    cnt, src, slot = (np.asarray(a) for a in (cnt, src, slot))
    RM = src.shape[-1]
    src, slot, cnt = src.reshape(R, L, RM), slot.reshape(R, L, RM), cnt.reshape(R, L)
    return {(q, l, int(src[q, l, j])): int(slot[q, l, j])
            for q in range(R) for l in range(L) for j in range(cnt[q, l])}


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["random", "skewed", "masked"])
@pytest.mark.parametrize("T,M,use_fp8,round_scale,split", [(128, 128, True, False, False),
                                                           (1, 16, True, True, False),
                                                           (57, 64, False, False, False),
                                                           (100, 128, True, False, True),
                                                           (33, 40, False, False, True)])
def test_ll_matches_reference(R, kind, T, M, use_fp8, round_scale, split):
    rng = np.random.default_rng(hash((R, kind, T, M, use_fp8)) % 2**32)
    H, K, E = 2048, 8, 8 * R
    L = E // R
    mesh = R
    x = jnp.asarray(rng.standard_normal((R * T, H)) * 3, jnp.bfloat16)
    idx = jnp.asarray(_routing(kind, rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ll_run(mesh, x, idx, w, E, M, use_fp8, round_scale, split)
    rows_c, rows_r = _assert_ll_equal(cu, rf, x, T, M, use_fp8, round_scale, R, L)
    if use_fp8:
        # The JAX reference run on the GPU is checked within one e4m3 code only: XLA's GPU f32
        # division (448 / amax) is not always correctly rounded, so its payload can differ by
        # one code (the exact check above is against the NumPy oracle).
        for k, (payload, _) in rows_c.items():
            ref_q = np.frombuffer(rows_r[k][0], np.uint8).view(ml_dtypes.float8_e4m3fn)
            cu_q = np.frombuffer(payload, np.uint8).view(ml_dtypes.float8_e4m3fn)
            step = np.abs(ref_q.astype(np.float32) - cu_q.astype(np.float32))
            assert np.all(step <= np.abs(cu_q.astype(np.float32)) * 0.126 + 2.0 ** -9), k
    for arr in (cu[3], cu[4]):  # -1 past the count
        arr = np.asarray(arr).reshape(R, L, R * M)
        for q in range(R):
            for l in range(L):
                assert (arr[q, l, np.asarray(cu[2]).reshape(R, L)[q, l]:] == -1).all()


@pytest.mark.parametrize("round_scale", [False, True])
def test_ll_fp8_nonfinite_groups(round_scale):
    """NaN and infinities in the low-latency FP8 dispatch: the kernel makes each such 128-column
    group NaN (scale and every byte), bit-exact with the oracle, never finite numbers."""
    from numpy_oracle import quantize_fp8 as np_quantize
    R, T, M, H, K = 2, 16, 16, 512, 4
    E = 4 * R
    L = E // R
    rng = np.random.default_rng(17)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    x[0, 5], x[1, 130], x[2, 300], x[T, 0], x[T + 1, 511] = np.nan, np.inf, -np.inf, np.nan, -np.inf
    x = jnp.asarray(x, jnp.bfloat16)
    idx = jnp.asarray(_routing("random", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, _ = _ll_run(R, x, idx, w, E, M, True, round_scale)
    q_all, s_all = np_quantize(np.asarray(x, np.float32), round_scale)
    q_all = np.asarray(q_all).view(np.uint8)
    seen = set()
    for k, (payload, scales) in _ll_rows(cu[0], cu[1], cu[2], cu[3], R, L).items():
        src = (k[2] // M) * T + k[2] % M
        assert payload == q_all[src].tobytes(), f"payload of row {k} (source {src})"
        assert scales == np.asarray(s_all[src], np.float32).tobytes(), f"scales of row {k}"
        seen.add(src)
    assert {0, 1, 2, T, T + 1} <= seen
    assert np.isnan(s_all[[0, 1, 2, T, T + 1]]).sum() == 5


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("R", [2, 4, 8])
def test_ll_scan_back_to_back(R, split):
    steps, T, M, H, K, E = 500, 16, 16, 256, 4, 4 * R
    rng = np.random.default_rng(5)
    xs = jnp.asarray(rng.standard_normal((steps, R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([_routing("masked", rng, R, T, K, E) for _ in range(steps)]))
    w = jnp.asarray(rng.random((steps, R * T, K)), jnp.float32)

    def run(be):
        def body(xs, idx, w):
            def step(c, inp):
                x, i, ww = inp
                sp = split and be == "cuda"
                r = _ll_dispatch(x, i, sp, num_experts=E, max_tokens_per_rank=M,
                                 use_fp8=False, backend=be)
                out = _ll_combine(r.recv_x, i, ww, r.handle, sp, backend=be)
                return c, (out, r.recv_count)
            return jax.lax.scan(step, 0, (xs, idx, w))[1]
        return _ranks(body, R, ep_dim=1)(xs, idx, w)

    _poison()
    oc, cc = jax.device_get(run("cuda"))
    orf, crf = jax.device_get(run("reference"))
    np.testing.assert_array_equal(cc, crf)
    np.testing.assert_allclose(np.asarray(oc, np.float32), np.asarray(orf, np.float32),
                               rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_ll_split_two_in_flight(R):
    """Separately jitted halves, called from Python so that step s sends before step s - 1 is
    received: two calls of one call site in flight (both halves of its double buffer), 60
    steps with fresh routing, against the reference."""
    steps, T, M, H, K, E = 60, 24, 32, 512, 4, 4 * R
    rng = np.random.default_rng(7)
    xs = [jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16) for _ in range(steps)]
    idx = [jnp.asarray(_routing("random", rng, R, T, K, E)) for _ in range(steps)]
    w = [jnp.asarray(rng.random((R * T, K)), jnp.float32) for _ in range(steps)]
    kw = dict(num_experts=E, max_tokens_per_rank=M, use_fp8=False)

    def smap(f):
        return _ranks(f, R)

    send = smap(lambda x, i: jax_ep.low_latency_dispatch_send(x, i, backend="cuda", **kw))

    def recv_combine(pend, i, ww):
        r = jax_ep.low_latency_dispatch_recv(pend)
        return jax_ep.low_latency_combine(r.recv_x, i, ww, r.handle, backend="cuda")

    finish = smap(recv_combine)

    def ref_fn(x, i, ww):
        r = jax_ep.low_latency_dispatch(x, i, backend="reference", **kw)
        return jax_ep.low_latency_combine(r.recv_x, i, ww, r.handle, backend="reference")

    ref = smap(ref_fn)
    _poison()
    got, pend = [], send(xs[0], idx[0])
    for s in range(1, steps):
        new = send(xs[s], idx[s])          # call s is sent before call s - 1 is received
        got.append(finish(pend, idx[s - 1], w[s - 1]))
        pend = new
    got.append(finish(pend, idx[-1], w[-1]))
    for s in range(steps):
        np.testing.assert_allclose(np.asarray(got[s], np.float32),
                                   np.asarray(ref(xs[s], idx[s], w[s]), np.float32),
                                   rtol=2e-2, atol=5e-2, err_msg=f"step {s}")


_LOWER_DURING_STEP = r"""
import jax, jax.numpy as jnp, numpy as np, jax_ep
from jax_ep import testing

@jax.jit
def long_step(a):      # seconds of GPU work, unrolled (a while loop may be driven by the host)
    for _ in range(200):
        a = jnp.tanh(a @ a) * 0.5
    return a

a = jnp.asarray(np.random.default_rng(0).standard_normal((16384, 16384)) * 0.01, jnp.bfloat16)
R, T, H, E = 3, 13, 384, 6                   # a new EP group and a new receive buffer
x = jax.block_until_ready(jnp.zeros((R, T, H), jnp.bfloat16))   # (made before: XLA may wait)
idx = jax.block_until_ready(jnp.zeros((R, T, 2), jnp.int32))
jax.block_until_ready(long_step(a))          # compiled and warm
out = long_step(a)                           # running now

def body(x, idx):
    r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                    use_fp8=False, backend="cuda")
    return r.recv_count

lowered = jax.jit(testing.virtual_ranks(body, R)).lower(x, idx)   # jax_ep's set-up runs here
print("step still running after set-up:", not out.is_ready())
f = lowered.compile()
print("counts", np.asarray(f(x, idx)).sum())
"""


def test_set_up_does_not_wait_for_the_device():
    """Lowering a new call site (a new group's workspaces, a new receive buffer) while a long
    step runs returns before the step ends: no device-wide wait at set-up, which could
    deadlock against a step waiting on a host callback."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    p = subprocess.run([sys.executable, "-c", _LOWER_DURING_STEP], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step still running after set-up: True" in p.stdout, p.stdout
    assert f"counts {3 * 13}" in p.stdout, p.stdout  # each token once, at expert 0


def test_ll_under_command_buffers():
    """XLA command buffers (CUDA graphs) on: the custom calls are captured and replayed."""
    g = _gpus()
    if len(g) < 2:
        pytest.skip("needs 2 GPUs")
    code = (
        "import jax, jax.numpy as jnp, numpy as np, jax_ep\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()[:2]), ('ep',))\n"
        "rng = np.random.default_rng(0)\n"
        "x = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)\n"
        "idx = jnp.asarray(rng.integers(-1, 8, (64, 4)), jnp.int32)\n"
        "w = jnp.asarray(rng.random((64, 4)), jnp.float32)\n"
        "kw = dict(num_experts=8, max_tokens_per_rank=32, use_fp8=False)\n"
        "def body(x, idx, w, be):\n"
        "    if be == 'split':\n"
        "        r = jax_ep.low_latency_dispatch_recv(\n"
        "            jax_ep.low_latency_dispatch_send(x, idx, backend='cuda', **kw))\n"
        "        return jax_ep.low_latency_combine_recv(jax_ep.low_latency_combine_send(\n"
        "            r.recv_x, idx, w, r.handle, backend='cuda'))\n"
        "    r = jax_ep.low_latency_dispatch(x, idx, backend=be, **kw)\n"
        "    return jax_ep.low_latency_combine(r.recv_x, idx, w, r.handle, backend=be)\n"
        "res = {}\n"
        "for be in ('cuda', 'split', 'reference'):\n"
        "    f = jax.jit(jax.shard_map(lambda a, b, c: body(a, b, c, be), mesh=mesh,"
        " in_specs=P('ep'), out_specs=P('ep')))\n"
        "    for _ in range(20): o = f(x, idx, w)\n"
        "    res[be] = np.asarray(o, np.float32)\n"
        "for be in ('cuda', 'split'):\n"
        "    np.testing.assert_allclose(res[be], res['reference'], rtol=2e-2, atol=5e-2)\n"
        "print('OK command buffers')\n")
    p = run_with_command_buffers(code)
    assert p.returncode == 0 and "OK command buffers" in p.stdout, p.stdout + p.stderr


def test_layout_kernel_matches_reference():
    g = _gpus()
    if not g:
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(1)
    for R, E, T, K in [(4, 32, 4096, 8), (8, 256, 1000, 8), (2, 8, 1, 2)]:
        idx = rng.integers(-1, E, (T, K)).astype(np.int32)
        idx[rng.random((T, K)) < 0.01] = E + 5
        f = jax.jit(functools.partial(jax_ep.get_dispatch_layout, num_experts=E, num_ranks=R,
                                      backend="cuda"))
        r = jax.jit(functools.partial(jax_ep.get_dispatch_layout, num_experts=E, num_ranks=R,
                                      backend="reference"))
        for a, b in zip(f(jnp.asarray(idx)), r(jnp.asarray(idx))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _receive_ids(kind, rng, C, K, L):
    """A receive's local expert ids [C, K]: -1 for a slot with no expert here."""
    if kind == "random":
        idx = rng.integers(0, L, (C, K))
    elif kind == "masked":       # -1 slots and a row naming one expert in several slots
        idx = rng.integers(-1, L, (C, K))
        idx[rng.random((C, K)) < 0.3] = -1
        idx[:, -1] = np.where(rng.random(C) < 0.2, idx[:, 0], idx[:, -1])
    elif kind == "skewed":       # every row's first slot on expert 0
        idx = rng.integers(-1, L, (C, K))
        idx[:, 0] = 0
    else:
        raise ValueError(kind)
    return idx.astype(np.int32)


@pytest.mark.parametrize("kind", ["random", "masked", "skewed"])
@pytest.mark.parametrize("C, K, L, A, capacity", [
    (4096, 8, 32, 128, 4096 * 8 + 31 * 127),    # one rank's layer: every pair fits
    (4096, 8, 32, 128, 20000),                  # pairs past the capacity
    (16384, 8, 32, 128, 45024),                 # four ranks' receive, the layer's capacity
    (1000, 8, 1024, 1, 9000),                   # the most experts the kernels serve
    (65536, 8, 32, 128, 4 * 65536 + 31 * 127),  # 256 blocks of pairs, some past the capacity
    (7, 3, 5, 4, 5),                            # tiny and odd
    (1, 1, 1, 1, 1)])
def test_expert_positions_kernel_matches_the_xla_plan(kind, C, K, L, A, capacity):
    """`plan` on the CUDA backend (two kernels place the pairs, over blocks of
    `position_slice_pairs`) gives every array of its XLA ops (a sort by expert), bit for bit, the
    kernels' results poisoned first."""
    from jax_ep import expert_layout as el
    if not _gpus():
        pytest.skip("needs a GPU")
    assert L <= jax_ep.runtime.extension().max_position_experts
    idx = jnp.asarray(_receive_ids(kind, np.random.default_rng(C + K + L + A), C, K, L))

    def run(backend):
        return jax.jit(functools.partial(el.plan, num_local_experts=L, capacity=capacity,
                                         alignment=A, backend=backend))(idx)
    want = run("reference")
    _poison()
    got = run("cuda")
    text = jax.jit(functools.partial(el.plan, num_local_experts=L, capacity=capacity,
                                     alignment=A, backend="cuda")).lower(idx).as_text()
    assert "jax_ep_expert_positions" in text
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_ll_large_topk_fallback_kernel():
    """K > 32 takes the general dispatch kernel."""
    R, T, M, H, K, E = 2, 32, 32, 512, 40, 64
    mesh = R
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ll_run(mesh, x, idx, w, E, M, False, False)
    np.testing.assert_array_equal(cu[2], rf[2])
    assert _ll_rows(cu[0], cu[1], cu[2], cu[3], R, E // R) == \
        _ll_rows(rf[0], rf[1], rf[2], rf[3], R, E // R)
    np.testing.assert_allclose(np.asarray(cu[6], np.float32), np.asarray(rf[6], np.float32),
                               rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("split", [False, True])
def test_ll_combine_without_prereduce(monkeypatch, split):
    """JAX_EP_LL_PREREDUCE=0: one bf16 row per (token, expert), several rows per warp item."""
    monkeypatch.setenv("JAX_EP_LL_PREREDUCE", "0")  # read when the calls are lowered
    R, T, M, H, K, E = 4, 64, 64, 1024, 8, 32
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(_routing("random", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ll_run(R, x, idx, w, E, M, False, False, split)
    _assert_ll_equal(cu, rf, x, T, M, False, False, R, E // R)


def test_ht_large_topk_direct_read_path():
    """K > 16: the layout kernel reads ids straight from the peer."""
    R, T, H, K, E = 2, 50, 256, 20, 32
    mesh = R
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    idx = jnp.asarray(_routing("masked", rng, R, T, K, E))
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    cu, rf = _ht_run(mesh, x, idx, w, E)
    _assert_ht_equal(cu, rf, 1e-5)


def test_edge_cases_on_one_gpu():
    """R = 1 on the CUDA backend: gradient in x with topk_weights=None, bfloat16 router
    weights, and an empty shard, each against the reference."""
    mesh = _mesh(1)
    rng = np.random.default_rng(31)
    T, H, K, E = 64, 256, 4, 8
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (T, K)), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.bfloat16)

    def run(backend, weights, x, idx, w):
        def body(x, idx, w):
            r = jax_ep.dispatch(x, idx, w if weights else None, num_experts=E, backend=backend)
            return jax_ep.combine(r.recv_x * 2, r.handle, backend=backend)

        def loss(x):
            out = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss))(x)
    for weights in (False, True):
        (vc, gc), (vr, gr) = run("cuda", weights, x, idx, w), run("reference", weights, x, idx, w)
        np.testing.assert_allclose(float(vc), float(vr), rtol=1e-3)
        np.testing.assert_array_equal(np.asarray(gc, np.float32), np.asarray(gr, np.float32))
    (v0, g0) = run("cuda", True, x[:0], idx[:0], w[:0])
    assert float(v0) == 0.0 and g0.shape == (0, H)


def test_virtual_ranks_that_cannot_be_resident():
    """R grids of a kernel that cannot be resident together on one GPU: a clear error before
    anything launches (no rank is left waiting), and the next call runs normally."""
    if not _gpus():
        pytest.skip("needs a GPU")
    R, T, H, K, E = 8, 16, 256, 2, 16
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
    idx = jnp.asarray(_routing("random", rng, R, T, K, E).reshape(R, T, K))

    def body(x, idx):
        r = jax_ep.dispatch(x, idx, num_experts=E, backend="cuda")
        return jax_ep.combine(r.recv_x, r.handle, backend="cuda")

    jax_ep.set_num_blocks(1000)
    try:
        with pytest.raises(Exception, match="cannot be resident"):
            jax.block_until_ready(jax.jit(jax_ep.testing.virtual_ranks(body, R))(x, idx))
    finally:
        jax_ep.set_num_blocks(None)
    out = jax.jit(jax_ep.testing.virtual_ranks(body, R))(x, idx)
    ref = jax.jit(jax_ep.testing.virtual_ranks(
        lambda x, i: jax_ep.combine(*(lambda r: (r.recv_x, r.handle))(
            jax_ep.dispatch(x, i, num_experts=E, backend="reference")), backend="reference"),
        R))(x, idx)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("split", [False, True])
def test_ll_combine_with_a_changed_topk_idx(R, split):
    """A combine given a topk_idx that differs from the dispatch's (an extra valid slot where the
    dispatch had -1, another expert, a dropped slot) reads the rows the dispatch sent and weighs
    the changed slots 0, like the reference, instead of waiting for rows never sent."""
    T, K, H, M, E = 40, 4, 512, 48, 4 * R
    rng = np.random.default_rng(31)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = np.asarray(_routing("masked", rng, R, T, K, E))
    changed = idx.copy()
    for t in range(R * T):
        k = t % K
        changed[t, k] = -1 if (idx[t, k] >= 0 and t % 3 == 0) else (idx[t, k] + 1 + t) % E
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)

    def body(x, i, i2, w):
        outs = []
        for be in ("cuda", "reference"):
            r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                            use_fp8=False, backend=be)
            outs.append(_ll_combine(r.recv_x, i2, w, r.handle, split and be == "cuda",
                                    backend=be))
        return outs

    _poison()
    cu, rf = jax.device_get(_ranks(body, R)(x, jnp.asarray(idx), jnp.asarray(changed), w))
    np.testing.assert_allclose(np.asarray(cu, np.float32), np.asarray(rf, np.float32),
                               rtol=2e-2, atol=2e-2)


_TAMPERED_HANDLE = """
import jax, jax.numpy as jnp, numpy as np, jax_ep
R, T, K, H, M, E = 2, 16, 4, 256, 16, 8
rng = np.random.default_rng(3)
x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
idx = jnp.asarray(np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)])
                            for _ in range(R)]).astype(np.int32))
w = jnp.ones((R, T, K), jnp.float32)

def body(x, i, w):
    r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M, use_fp8=False,
                                    backend="cuda")
    h = r.handle._replace(src_rows=jnp.full_like(r.handle.src_rows, 2**30))
    return jax_ep.low_latency_combine(r.recv_x, i, w, h, backend="cuda")

jax_ep.checked(jax_ep.testing.run_ranks(body, R))(x, idx, w)  # raises PeerTimeoutError
"""


def test_ll_combine_never_reads_past_a_tampered_handle():
    """A handle whose src_rows name rows far past y: the combine send skips them (its peers then
    wait for those rows until the timeout and give up: PeerTimeoutError, in a process of its
    own), and never reads outside y, which would end in an illegal memory access instead."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_EP_TIMEOUT_S="3", JAX_EP_VIRTUAL_RANKS="1")
    p = subprocess.run([sys.executable, "-c", _TAMPERED_HANDLE], env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    assert "illegal memory access" not in out, out[-3000:]
    assert "PeerTimeoutError" in out and "timed out" in out, out[-3000:]


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_ll_pending_carried_across_scan(R, kind):
    """A split send's pending carried across 50 lax.scan iterations (the send before the loop
    and the one in its body share one pair): each iteration receives the previous one's rows,
    against the fused reference."""
    steps, T, M, H, K, E = 50, 16, 16, 256, 4, 4 * R
    rng = np.random.default_rng(8)
    xs = jnp.asarray(rng.standard_normal((steps + 1, R * T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([_routing("masked", rng, R, T, K, E) for _ in range(steps + 1)]))
    w = jnp.asarray(rng.random((steps + 1, R * T, K)), jnp.float32)
    kw = dict(num_experts=E, max_tokens_per_rank=M, use_fp8=False)

    def result(r, i, ww, be):
        if kind == "dispatch":
            return r.recv_count, r.handle.recv_src
        return jax_ep.low_latency_combine(r.recv_x, i, ww, r.handle, backend=be)

    def cuda(xs, idx, w):
        def send(x, i, ww):
            if kind == "dispatch":
                return jax_ep.low_latency_dispatch_send(x, i, backend="cuda", pair="carried",
                                                        **kw)
            r = jax_ep.low_latency_dispatch(x, i, backend="cuda", **kw)
            return jax_ep.low_latency_combine_send(r.recv_x, i, ww, r.handle, backend="cuda",
                                                   pair="carried")

        def recv(p):
            if kind == "dispatch":
                r = jax_ep.low_latency_dispatch_recv(p)
                return r.recv_count, r.handle.recv_src
            return jax_ep.low_latency_combine_recv(p)

        def step(p, inp):
            out = recv(p)
            return send(*inp), out
        p, outs = jax.lax.scan(step, send(xs[0], idx[0], w[0]), (xs[1:], idx[1:], w[1:]))
        return outs, jax.tree.map(lambda a: a[None], recv(p))  # a steps axis of 1

    def ref(xs, idx, w):
        def step(c, inp):
            x, i, ww = inp
            return c, result(jax_ep.low_latency_dispatch(x, i, backend="reference", **kw), i, ww,
                             "reference")
        return jax.lax.scan(step, 0, (xs, idx, w))[1]

    _poison()
    got, last = jax.device_get(_ranks(cuda, R, ep_dim=1)(xs, idx, w))
    want = jax.device_get(_ranks(ref, R, ep_dim=1)(xs, idx, w))
    if kind == "dispatch":
        np.testing.assert_array_equal(got[0], want[0][:steps])
        np.testing.assert_array_equal(last[0][0], want[0][steps])
        # recv_src: the same rows in any order per expert
        np.testing.assert_array_equal(np.sort(got[1], axis=-1), np.sort(want[1][:steps], axis=-1))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(want[:steps], np.float32), rtol=2e-2, atol=5e-2)
        np.testing.assert_allclose(np.asarray(last[0], np.float32),
                                   np.asarray(want[steps], np.float32), rtol=2e-2, atol=5e-2)
