"""GPU suite of the fused kernels of `moe_ffn(fused=True)`: the dispatch + first grouped GEMM
and the second grouped GEMM + combine, against the unfused CUDA ops (the expert-major rows and
the combine's sums bit-exact, the GEMMs within float32 accumulation) and the reference backend,
over R ranks (R GPUs, or R virtual ranks on one GPU: jax_ep.testing), on random, masked,
skewed, empty-expert and invalid routing, and in a long scan.

Marked `gpu` (skipped without CUDA GPUs). Run: scripts/gpu_check.sh fused, or
`pytest -m gpu tests/test_gpu_fused.py`.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import fused, high_throughput as ht
from jax_ep.fused import dispatch_matmul, matmul_combine
from helpers import gpu_devices, gpu_ranks, moe_layer_and_grads, poison_gpu_memory, split_ranks

pytestmark = pytest.mark.gpu


def _rows(A):
    return jax_ep.runtime.extension().fused_block_rows if A is None else A


def _routing(kind, R, T, K, E, rng):
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    if kind == "masked":      # unused slots and a token naming one expert twice
        idx[rng.random(idx.shape) < 0.3] = -1
        idx[0, :2] = max(idx[0, 0], 0)
    elif kind == "skewed":    # most slots on expert 1, the rest on a few experts
        idx = np.where(rng.random(idx.shape) < 0.7, 1, idx % 3).astype(np.int32)
    elif kind == "empty":     # only even experts: every rank has empty segments
        idx = (idx // 2 * 2).astype(np.int32)
    elif kind == "invalid":   # ids out of range count as invalid and route nowhere
        idx[rng.random(idx.shape) < 0.2] = E + 3
    return jnp.asarray(idx)


def _setup(R, T, H, N, K, L, kind, seed):
    E = L * R
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = _routing(kind, R, T, K, E, rng)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, H, N)) / np.sqrt(H), jnp.bfloat16)
    return x, idx, w, wgu, E


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values (rows never written?)"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("kind", ["random", "masked", "skewed", "empty", "invalid"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_fused_dispatch_matmul_matches_unfused(R, kind):
    """Every output of the fused call against dispatch(layout="expert") + grouped_matmul on the
    same backend and alignment: rows bit-exact, h within float32 accumulation, up to the last
    segment's end (the rows past it are not written: the layer reads none)."""
    T, H, N, K, L = (37 if R > 1 else 300), 512, 384, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, N, K, L, kind, 100 * R + len(kind))
    A = _rows(None)

    def fused(x, idx, w, wgu):
        res, h = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        return res.recv_x, h, res.expert_sizes, res.recv_count

    def unfused(x, idx, w, wgu):
        res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", expert_alignment=A,
                              backend="cuda")
        h = jax_ep.grouped_matmul(res.recv_x, wgu, res.expert_sizes, backend="cuda")
        return res.recv_x, h, res.expert_sizes, res.recv_count

    poison_gpu_memory()
    xe, h, sizes, count = jax.device_get(gpu_ranks(fused, R)(x, idx, w, wgu))
    xr, hr, sizes_r, count_r = jax.device_get(gpu_ranks(unfused, R)(x, idx, w, wgu))
    np.testing.assert_array_equal(sizes, sizes_r)
    np.testing.assert_array_equal(count, count_r)
    assert np.all(np.asarray(sizes) % A == 0)
    C = xe.shape[0] // R
    for r in range(R):
        rows = slice(r * C, r * C + int(count[r]))
        np.testing.assert_array_equal(np.asarray(xe[rows]).view(np.uint16),
                                      np.asarray(xr[rows]).view(np.uint16))
        assert _rel(h[rows], hr[rows]) < 1e-2, (r, _rel(h[rows], hr[rows]))


@pytest.mark.parametrize("kind", ["random", "masked", "empty"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_fused_activation_epilogue_matches_swiglu_of_h(R, kind):
    """dispatch_matmul_swiglu's activation, computed in the GEMM's epilogue on paired columns,
    against swiglu of dispatch_matmul's h (the same products: within one bfloat16 rounding) up
    to the last segment's end; and its backward (the paired h unpaired) against the backward of
    swiglu after dispatch_matmul."""
    T, H, N, K, L = (37 if R > 1 else 300), 512, 768, 4, 4   # 3 column tiles, I = 384
    x, idx, w, wgu, E = _setup(R, T, H, N, K, L, kind, 200 * R + len(kind))

    def run(x, idx, w, wgu):
        res, h = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        _, act = fused.dispatch_matmul_swiglu(x, idx, w, wgu, num_experts=E, backend="cuda")

        def loss(x, wgu, epilogue):
            if epilogue:
                r, a = fused.dispatch_matmul_swiglu(x, idx, w, wgu, num_experts=E,
                                                    backend="cuda")
            else:
                r, hh = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
                a = jax_ep._common.swiglu(hh).astype(x.dtype)
            # every activation weighs in, each by a fixed random factor
            return jnp.sum(a.astype(jnp.float32)
                           * jax.random.normal(jax.random.key(7), a.shape, jnp.float32))
        grads = [jax.grad(lambda x, wgu, e=e: loss(x, wgu, e), argnums=(0, 1))(x, wgu)
                 for e in (True, False)]
        return h, act, res.recv_count, grads
    poison_gpu_memory()
    h, act, count, (got, want) = jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu))
    C = act.shape[0] // R
    for r in range(R):
        rows = slice(r * C, r * C + int(count[r]))
        ref = np.asarray(jax_ep._common.swiglu(jnp.asarray(h[rows])).astype(jnp.bfloat16),
                         np.float32)
        act_r = np.asarray(act[rows], np.float32)
        assert np.isfinite(act_r).all(), r
        np.testing.assert_allclose(act_r, ref, rtol=1e-2, atol=1e-5)
    for name, a, b in zip(("d x", "d w_gate_up"), got, want):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


@pytest.mark.parametrize("kind", ["random", "masked", "skewed"])
@pytest.mark.parametrize("R", [1, 2])
def test_fused_first_half_without_a_gradient_leaves_h_unwritten(R, kind):
    """Without a gradient the first half's kernel skips h's stores (only the backward reads h):
    its activations and rows equal, bit for bit, those of the same call under jax.vjp, which
    writes h, up to the last segment's end."""
    T, H, N, K, L = (37 if R > 1 else 300), 512, 768, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, N, K, L, kind, 300 * R + len(kind))

    def run(x, idx, w, wgu):
        def f(x):
            return fused.dispatch_matmul_swiglu(x, idx, w, wgu, num_experts=E, backend="cuda")
        res, act = f(x)
        (res_v, act_v), _ = jax.vjp(f, x)
        return res.recv_x, act, res_v.recv_x, act_v, res.recv_count
    poison_gpu_memory()
    xe, act, xe_v, act_v, count = jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu))
    C = act.shape[0] // R
    rows = np.concatenate([np.arange(r * C, r * C + int(count[r])) for r in range(R)])
    a, a_v = np.asarray(act)[rows], np.asarray(act_v)[rows]
    assert np.isfinite(a.astype(np.float32)).all() and np.any(a.astype(np.float32))
    np.testing.assert_array_equal(a.view(np.uint16), a_v.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(xe)[rows].view(np.uint16),
                                  np.asarray(xe_v)[rows].view(np.uint16))


def _gemm_combine_outputs(E, K, weighted, combine_blocks=0):
    """Per shard: the fused GEMM + combine's (ye, out); its GEMM rows alone (the same kernel
    with no slot to sum leaves ye as the products) and their combine; the unfused
    grouped_matmul and its combine; the public op; the handle's row_of and weights, the segment
    sizes and recv_count."""
    def run(x, idx, w, wgu, wd):
        res, a = dispatch_matmul(x, idx, w if weighted else None, wgu, num_experts=E,
                                 backend="cuda")
        handle = res.handle
        ccfg = fused._GemmCombineConfig(
            ht._Config(0, handle.rank.recv_src.shape[0], "ep", "cuda"), K, combine_blocks)
        call = functools.partial(fused._gemm_combine_call, a, wd, handle.weights,
                                 res.expert_sizes, rank=handle.rank, ccfg=ccfg)
        ye, out = call(handle.row_of)
        prod, _ = call(jnp.full_like(handle.row_of, -1))
        y = jax_ep.grouped_matmul(a, wd, res.expert_sizes, backend="cuda")
        public = matmul_combine(a, wd, res, backend="cuda", combine_blocks=combine_blocks)
        return (ye, out, prod, jax_ep.combine(prod, handle, backend="cuda"), y,
                jax_ep.combine(y, handle, backend="cuda"), public, handle.row_of,
                handle.weights, res.expert_sizes, res.recv_count)
    return run


def _bits(a):
    return np.asarray(a).view(np.uint16)


def _check_gemm_combine(got, R):
    ye, out, prod, out_from_prod, y, out_unfused, public, row_of, weights, sizes, count = got
    # the combine's arithmetic is the unfused combine's, rounding for rounding
    np.testing.assert_array_equal(_bits(out), _bits(out_from_prod))
    np.testing.assert_array_equal(_bits(public), _bits(out))
    assert _rel(out, out_unfused) < 1e-2, _rel(out, out_unfused)
    C, Cr, L = ye.shape[0] // R, row_of.shape[0] // R, sizes.shape[0] // R
    for r in range(R):
        rows = slice(r * C, r * C + int(count[r]))
        assert _rel(prod[rows], y[rows]) < 1e-2, (r, _rel(prod[rows], y[rows]))
        # ye up to the last segment's end (past it: scratch, not written): the products, but
        # over several ranks each received row's weighted sum (float32 in slot order, rounded
        # once) in the row of its first slot here
        end = min(int(np.sum(sizes[r * L:(r + 1) * L])), C)
        p = np.asarray(prod[r * C:r * C + end])
        want = p.copy()
        ro, wq = np.asarray(row_of[r * Cr:(r + 1) * Cr]), np.asarray(weights[r * Cr:(r + 1) * Cr])
        held = (ro >= 0) & (ro < end)
        has = held.any(axis=1)
        if R > 1 and has.any():
            acc = np.zeros((Cr, p.shape[1]), np.float32)
            for k in range(ro.shape[1]):
                term = wq[:, k:k + 1] * p[np.where(held[:, k], ro[:, k], 0)].astype(np.float32)
                acc = np.where(held[:, k:k + 1], acc + term, acc)
            first = ro[np.arange(Cr), np.argmax(held, axis=1)]
            want[first[has]] = acc[has].astype(p.dtype)
        np.testing.assert_array_equal(_bits(ye[r * C:r * C + end]), _bits(want), err_msg=f"{r}")


@pytest.mark.parametrize("kind", ["random", "masked", "skewed", "empty", "invalid"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_fused_matmul_combine_matches_unfused(R, kind):
    """The fused GEMM + combine against grouped_matmul + combine on one expert-major dispatch:
    its output bit-exact against combine of its own GEMM rows, those rows within float32
    accumulation of grouped_matmul's up to the last segment's end, and its rows where they
    take the received rows' sums (over several ranks) bit-exact against those sums."""
    T, H, I, K, L = (37 if R > 1 else 300), 384, 256, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, kind, 200 * R + len(kind))
    rng = np.random.default_rng(R)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    poison_gpu_memory()
    got = jax.device_get(gpu_ranks(_gemm_combine_outputs(E, K, True), R)(x, idx, w, wgu, wd))
    _check_gemm_combine(got, R)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fused_matmul_combine_adds_its_addend_only_when_on(R):
    """With an addend (the layer's sum of its extra passes) that is on, the output is its
    output without one, in float32, plus the addend, rounded again (`plus_addend`), bit for
    bit; with one that is off the output is the one without, and the addend (NaN here) is
    not read. R = 1 runs the direct path, R > 1 the two steps."""
    T, H, I, K, L = (45 if R > 1 else 200), 384, 256, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, "masked", 70 + R)
    rng = np.random.default_rng(71 + R)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    add = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)

    def run(x, idx, w, wgu, wd, add):
        res, a = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        plain = matmul_combine(a, wd, res, backend="cuda")
        on, off = jnp.ones((), jnp.bool_), jnp.zeros((), jnp.bool_)
        with_on = fused.matmul_combine_plus(a, wd, res, (add, on), backend="cuda")
        with_off = fused.matmul_combine_plus(a, wd, res, (jnp.full_like(add, jnp.nan), off),
                                             backend="cuda")
        return plain, with_on, with_off, fused.plus_addend(plain, (add, on))
    poison_gpu_memory()
    plain, with_on, with_off, want = jax.device_get(
        gpu_ranks(run, R)(x, idx, w, wgu, wd, add))
    assert np.isfinite(np.asarray(with_on, np.float32)).all()
    assert np.any(np.asarray(with_on) != np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(with_on).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(with_off).view(np.uint16),
                                  np.asarray(plain).view(np.uint16))


@pytest.mark.parametrize("R,combine_blocks", [(1, 0), (4, 0), (2, 24)])
def test_fused_matmul_combine_spans_column_chunks(R, combine_blocks):
    """Outputs wider than one column chunk of the GEMM + combine (its tile queue and its combine
    go chunk by chunk): two whole chunks and a narrower last one, bit-exact as above."""
    ext = jax_ep.runtime.extension()
    H = ext.fused_chunk_blocks * ext.fused_block_columns * 2 + ext.fused_block_columns
    T, I, K, L = (29 if R > 1 else 120), 128, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, "masked", 31 + R)
    rng = np.random.default_rng(32 + R)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    poison_gpu_memory()
    run = _gemm_combine_outputs(E, K, True, combine_blocks)
    _check_gemm_combine(jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu, wd)), R)


@pytest.mark.parametrize("combine_blocks,weighted", [(1, False), (3, True), (24, True)])
def test_fused_matmul_combine_blocks_and_no_weights(combine_blocks, weighted):
    """Many tokens per combine warp (few combine-only blocks) or many combine-only blocks;
    without routing weights each (token, expert) pair weighs 1."""
    R, T, H, I, K, L = 2, 700, 256, 128, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, "masked", 9)
    rng = np.random.default_rng(10)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    poison_gpu_memory()
    run = _gemm_combine_outputs(E, K, weighted, combine_blocks)
    _check_gemm_combine(jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu, wd)), R)


@pytest.mark.parametrize("R,K", [(1, 8), (2, 8), (1, 12), (2, 12)])
def test_fused_matmul_combine_top_k_fills_and_passes_a_slot_group(R, K):
    """Top-8: a row's slots fill one group of the combine's loads in flight; top-12: two
    groups, the second partly empty. Over a column chunk and a narrower one, bit-exact as
    above (R = 1 through the direct path). A task of at most 32 (row, slot) entries takes them
    from the lanes of its waits, a larger one loads them: top-12's tasks of 4 rows load theirs,
    the last task of fewer rows (T = 161 at R = 1, received rows at R = 2) keeps them."""
    ext = jax_ep.runtime.extension()
    H = ext.fused_chunk_blocks * ext.fused_block_columns + ext.fused_block_columns
    T, I, L = (45 if R > 1 else 161), 128, 12
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, "masked", 40 + R + K)
    rng = np.random.default_rng(41 + R + K)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    poison_gpu_memory()
    run = _gemm_combine_outputs(E, K, True)
    _check_gemm_combine(jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu, wd)), R)


@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_fused_matmul_combine_full_rows_of_top_8(kind):
    """At R = 1, top-8 with no masked slot (skewed: most slots on one expert, named many times
    in a token): every task's 32 entries name a row and stay in the lanes of its waits, over two
    whole column chunks and a narrower one, and the last task of one token. Bit-exact as above,
    and with an addend that is on, bit-exact against `plus_addend` (the addend's test runs
    masked top-4)."""
    ext = jax_ep.runtime.extension()
    H = 2 * ext.fused_chunk_blocks * ext.fused_block_columns + ext.fused_block_columns
    R, T, I, K, L = 1, 161, 128, 8, 12
    x, idx, w, wgu, E = _setup(R, T, H, I, K, L, kind, 60 + len(kind))
    rng = np.random.default_rng(61)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    add = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    poison_gpu_memory()
    run = _gemm_combine_outputs(E, K, True)
    _check_gemm_combine(jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu, wd)), R)

    def plus(x, idx, w, wgu, wd, add):
        res, a = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        plain = matmul_combine(a, wd, res, backend="cuda")
        on = jnp.ones((), jnp.bool_)
        return (fused.matmul_combine_plus(a, wd, res, (add, on), backend="cuda"),
                fused.plus_addend(plain, (add, on)))
    poison_gpu_memory()
    got, want = jax.device_get(gpu_ranks(plus, R)(x, idx, w, wgu, wd, add))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("R, I", [(1, 256), (2, 256), (4, 256), (8, 256), (1, 192), (4, 192)])
def test_moe_ffn_fused_matches_unfused_and_reference(R, I):
    """The layer's output and gradients, fused against unfused and the reference, on poisoned
    memory; I = 192 (2I not a multiple of the epilogue's paired columns) applies the activation
    in XLA over every row of h, those past the last segment (not written) included."""
    T, H, K, L = 48, 512, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, 2 * I, K, L, "masked", R)
    rng = np.random.default_rng(R + 50)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    w = w.astype(jnp.bfloat16)
    poison_gpu_memory()

    def run(backend, fused):
        layer = moe_layer_and_grads(backend, num_experts=E, fused=fused)
        return jax.device_get(gpu_ranks(layer, R)(x, idx, w, wgu, wd))
    got, unf, ref = run("cuda", True), run("cuda", False), run("reference", True)
    names = ("out", "d x", "d topk_weights", "d w_gate_up", "d w_down")
    for name, a, b, c in zip(names, got, unf, ref):
        assert a.dtype == c.dtype, name
        assert _rel(a, b) < 1e-2, (name, "unfused", _rel(a, b))
        assert _rel(a, c) < 2e-2, (name, "reference", _rel(a, c))


@pytest.mark.parametrize("kind", ["random", "masked", "skewed", "empty", "invalid"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_fused_backward_kernels_match_the_unfused_rules(R, kind):
    """Both fused halves' backward kernels (docs/kernels.md#fused-backward: the gather of the
    output's cotangent with its product by W_down^T, the product by W_gate_up^T with the combine
    of d x) against the gradients of the unfused ops on the same routing: d x, d topk_weights,
    d w_gate_up and d w_down within float32 accumulation."""
    T, H, I, K, L = (37 if R > 1 else 300), 384, 256, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, 2 * I, K, L, kind, 300 * R + len(kind))
    rng = np.random.default_rng(R + 70)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    A = _rows(None)

    def loss(x, w, wgu, wd, idx, fused_halves):
        if fused_halves:
            res, h = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        else:
            res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert",
                                  expert_alignment=A, backend="cuda")
            h = jax_ep.grouped_matmul(res.recv_x, wgu, res.expert_sizes, backend="cuda")
        a = jax_ep._common.swiglu(h).astype(x.dtype)
        if fused_halves:
            out = matmul_combine(a, wd, res, backend="cuda")
        else:
            y = jax_ep.grouped_matmul(a, wd, res.expert_sizes, backend="cuda")
            out = jax_ep.combine(y, res.handle, backend="cuda")
        proj = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return jnp.sum(out.astype(jnp.float32) * proj)

    def run(x, idx, w, wgu, wd):
        return [jax.grad(functools.partial(loss, idx=idx, fused_halves=f),
                         argnums=(0, 1, 2, 3))(x, w, wgu, wd) for f in (True, False)]
    poison_gpu_memory()
    got, want = jax.device_get(gpu_ranks(run, R)(x, idx, w, wgu, wd))
    for name, a, b in zip(("d x", "d topk_weights", "d w_gate_up", "d w_down"), got, want):
        assert np.abs(np.asarray(b, np.float32)).max() > 0, name
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


def test_fused_matmul_combine_rows_past_the_segments_read_as_zero():
    """A handle naming rows past the last segment (no tile computes or writes them: they
    hold the poison) reads them as the zero rows they are in the unfused layer, instead of
    loading them or waiting for tiles."""
    import types
    rows = _rows(None)
    T, K, L, I, N = 64, 4, 2, 128, 256
    C = 4 * rows                                  # segments [rows, rows]; 2 row blocks past them
    rng = np.random.default_rng(11)
    a = jnp.asarray(rng.standard_normal((C, I)), jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((L, I, N)) / 16, jnp.bfloat16)
    sizes = jnp.asarray([rows, rows], jnp.int32)
    row_of = rng.integers(0, 2 * rows, (T, K)).astype(np.int32)
    past = rng.random((T, K)) < 0.3
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    send_rows = jnp.arange(T, dtype=jnp.int32)[:, None]

    def run(row_of):
        def body(a, wd, sizes, row_of, weights, send_rows):
            ccfg = fused._GemmCombineConfig(ht._Config(0, T, "ep", "cuda"), K, 0)
            return fused._gemm_combine_call(a, wd, weights, sizes, row_of,
                                            types.SimpleNamespace(send_rows=send_rows), ccfg)
        return jax.device_get(gpu_ranks(body, 1)(a, wd, sizes, jnp.asarray(row_of), weights,
                                                 send_rows))
    poison_gpu_memory()
    _, out = run(np.where(past, 2 * rows + 1 + row_of % (2 * rows - 1), row_of))
    _, want = run(np.where(past, -1, row_of))
    np.testing.assert_array_equal(np.abs(np.asarray(out, np.float32)),
                                  np.abs(np.asarray(want, np.float32)))


def test_moe_ffn_fused_runs_both_fused_kernels():
    """moe_ffn(fused=True) on the CUDA backend lowers to the two fused kernels (not to a
    fallback that the comparisons above could not tell apart), and its backward to both again,
    with the weights read transposed (docs/kernels.md#fused-backward), in place of the unfused
    gather and combine."""
    import re
    if not gpu_devices():
        pytest.skip("needs a GPU")
    R, T, H, I, K, L = 2, 16, 256, 128, 2, 2
    x, idx, w, wgu, E = _setup(R, T, H, 2 * I, K, L, "random", 3)
    wd = jnp.zeros((E, I, H), jnp.bfloat16)
    # the worst-case capacity: one pass (the extra passes' loop would hold more kernels)
    cap = R * T * K + L * (_rows(None) - 1)

    def layer(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, fused=True, backend="cuda",
                              capacity=cap)

    # (the loss too: without it nothing reads the forward's output, and JAX drops its GEMM +
    # combine)
    def step(x, idx, w, wgu, wd):
        def loss(x, w, wgu, wd):
            return jnp.sum(layer(x, idx, w, wgu, wd).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
    args = [split_ranks(a, R) for a in (x, idx, w, wgu, wd)]
    hlo = jax_ep.testing.run_ranks(layer, R).lower(*args).as_text()
    for target in ("jax_ep_ht_gather_gemm", "jax_ep_ht_gemm_combine"):
        assert target in hlo, target
    hlo = jax_ep.testing.run_ranks(step, R).lower(*args).as_text()
    calls = re.findall(r'custom_call_target\s*=\s*"(jax_ep_[a-z_]+)"|'
                       r'stablehlo.custom_call @(jax_ep_[a-z_]+)', hlo)
    names = [(a or b).removesuffix("_vr") for a, b in calls]   # (virtual ranks: _vr)
    for target in ("jax_ep_ht_gather_gemm", "jax_ep_ht_gemm_combine"):
        assert names.count(target) == 2, (target, names)
    # no gather of the output's cotangent, and one combine: the routing weights' cotangent
    assert "jax_ep_ht_gather" not in names and names.count("jax_ep_ht_combine") == 1, names
    assert len(re.findall(r"w_k_major\s*=\s*1", hlo)) == 2, "the backward's transposed weights"


def test_fused_grids_take_each_virtual_rank_share_of_the_sms():
    """In the one-GPU multi-rank mode each rank's fused kernels take its share of the SMs, one
    block per SM: copy or combine-only blocks up to the share less one run, and a count of the
    share is refused with an error that names it (a share divided twice by R refuses the
    first and names half the share)."""
    if not gpu_devices():
        pytest.skip("needs a GPU")
    R, T, H, I, K, L = 2, 16, 256, 128, 2, 2
    share = jax_ep.runtime.extension().device_sm_count(jax_ep.runtime.current_cuda_device()) // R
    x, idx, w, wgu, E = _setup(R, T, H, 2 * I, K, L, "random", 5)
    wd = jnp.zeros((E, I, H), jnp.bfloat16)
    args = tuple(split_ranks(a, R) for a in (x, idx, w, wgu, wd))

    def layer(copy_blocks, combine_blocks):
        def f(x, idx, w, wgu, wd):
            return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, fused=True,
                                  fused_copy_blocks=copy_blocks,
                                  fused_combine_blocks=combine_blocks, backend="cuda")
        return jax.jit(jax_ep.testing.virtual_ranks(f, R))

    out = jax.block_until_ready(layer(share - 1, share - 1)(*args))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    for copy_blocks, combine_blocks in ((share, 1), (1, share)):
        with pytest.raises(Exception, match=f"must leave at least one of the {share} blocks"):
            jax.block_until_ready(layer(copy_blocks, combine_blocks)(*args))


def test_fused_in_a_long_scan():
    """200 fused layers in one scan with fresh routing each step (R = 4)."""
    R, T, H, I, K, L, steps = 4, 16, 256, 128, 2, 2, 200
    if not gpu_devices():
        pytest.skip("needs a GPU")
    x, _, w, wgu, E = _setup(R, T, H, 2 * I, K, L, "random", 5)
    rng = np.random.default_rng(6)
    wd = jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, steps, K)).astype(np.int32))

    def run(backend):
        def body(x, idx, w, wgu, wd):
            def step(h, i):
                out = jax_ep.moe_ffn(h, i, w, wgu, wd, num_experts=E, fused=True,
                                     backend=backend)
                return (h + out).astype(h.dtype) * 0.5, jnp.sum(out.astype(jnp.float32))
            return jax.lax.scan(step, x, jnp.swapaxes(idx, 0, 1))
        return gpu_ranks(body, R)

    poison_gpu_memory()
    hc, sc = jax.device_get(run("cuda")(x, idx, w, wgu, wd))
    hr, sr = jax.device_get(run("reference")(x, idx, w, wgu, wd))
    assert _rel(hc, hr) < 2e-2
    assert _rel(sc, sr) < 2e-2


@pytest.mark.parametrize("copy_blocks", [1, 3])
def test_fused_with_few_copy_blocks(copy_blocks):
    """Few copy blocks: each streams thousands of rows (several windows of staged sources, every
    ring slot reused many times), the tiles waiting on them."""
    R, T, H, N, K, L = 1, 1500, 256, 128, 4, 4
    x, idx, w, wgu, E = _setup(R, T, H, N, K, L, "masked", 7)

    def fused(x, idx, w, wgu):
        res, h = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda",
                                 copy_blocks=copy_blocks)
        return res.recv_x, h, res.recv_count

    def unfused(x, idx, w, wgu):
        res = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert",
                              expert_alignment=_rows(None), backend="cuda")
        return res.recv_x, jax_ep.grouped_matmul(res.recv_x, wgu, res.expert_sizes,
                                                 backend="cuda")

    poison_gpu_memory()
    xe, h, count = jax.device_get(gpu_ranks(fused, R)(x, idx, w, wgu))
    xr, hr = jax.device_get(gpu_ranks(unfused, R)(x, idx, w, wgu))
    rows = slice(0, int(count[0]))          # (past the last segment: not written)
    assert xe.shape[0] > 4096 + 128
    np.testing.assert_array_equal(np.asarray(xe[rows]).view(np.uint16),
                                  np.asarray(xr[rows]).view(np.uint16))
    assert _rel(h[rows], hr[rows]) < 1e-2, _rel(h[rows], hr[rows])
