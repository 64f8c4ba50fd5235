"""GPU suite of the grouped GEMMs: the CUTLASS kernels against the reference backend (XLA's
ragged_dot with float32 accumulation) on the same GPU.

Marked `gpu` (skipped without CUDA GPUs). Run: scripts/gpu_check.sh, or
`pytest -m gpu tests/test_gpu_gemm.py`. Each check poisons the device memory pool first (so
output rows the kernels fail to write show up as NaN) and compares by relative error
||got - ref|| / ||ref||: both sides accumulate in float32 and round to the output dtype, so they
differ by the output rounding and the order of the sums.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from helpers import gpu_devices, poison_gpu_memory, run_with_command_buffers

pytestmark = pytest.mark.gpu


def _gpu():
    g = gpu_devices()
    if not g:
        pytest.skip("needs a GPU")
    if not jax_ep.runtime.extension().gemm_built():
        pytest.fail("the extension was built without the grouped-GEMM kernels")
    return g[0]


def _poison():
    poison_gpu_memory(256)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite output (unwritten rows?)"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _zipf(rng, M, G):
    """Zipf-skewed sizes summing to M (group k ~ 1/k), some groups empty, in random order."""
    w = 1.0 / np.arange(1, G + 1)
    w[rng.permutation(np.arange(1, G))[: max(1, G // 8)]] = 0
    s = np.floor(w / w.sum() * M).astype(np.int64)
    s[0] += M - s.sum()
    return rng.permutation(s)


def _sizes(kind, rng, M, G):
    if kind == "uniform":
        s = np.full(G, M // G)
        s[-1] += M - s.sum()
    elif kind == "random":
        cuts = np.sort(rng.integers(0, M + 1, G - 1))
        s = np.diff(np.concatenate([[0], cuts, [M]]))
    elif kind == "zipf":
        s = _zipf(rng, M, G)
    elif kind == "empty_groups":
        s = np.zeros(G, np.int64)
        s[1], s[G - 1] = M // 3, M - M // 3
    elif kind == "unused_tail":
        s = rng.integers(0, max(1, M // G), G)
    elif kind == "all_empty":
        s = np.zeros(G, np.int64)
    else:
        raise ValueError(kind)
    return s.astype(np.int32)


def _pair(fn, **kw):
    """jit'd CUDA and reference versions of fn(..., backend=...)."""
    return (jax.jit(functools.partial(fn, backend="cuda", **kw)),
            jax.jit(functools.partial(fn, backend="reference", **kw)))


def _operands(rng, M, K, N, G, dtype):
    a = jnp.asarray(rng.standard_normal((M, K)), dtype)
    b = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    return a, b


SHAPES = [  # M, K, N, G: large tiles (M / G > 128) and 64-row tiles, odd and tiny M
    (4096, 1024, 512, 8),
    (2048, 512, 768, 32),
    (37, 256, 128, 4),
    (1, 64, 64, 3),
    (1000, 2048, 1024, 16),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["uniform", "random", "zipf", "empty_groups", "unused_tail",
                                  "all_empty"])
def test_forward_matches_reference(dtype, shape, kind):
    _gpu()
    M, K, N, G = shape
    rng = np.random.default_rng(hash((M, K, N, G, kind)) % 2**31)
    a, b = _operands(rng, M, K, N, G, dtype)
    sizes = jnp.asarray(_sizes(kind, rng, M, G))
    cu, rf = _pair(jax_ep.grouped_matmul)
    _poison()
    got = cu(a, b, sizes)
    want = rf(a, b, sizes)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (M, N)
    assert _rel(got, want) < 1e-2
    used = int(np.asarray(sizes).sum())
    assert not np.any(np.asarray(got, np.float32)[used:]), "rows past the groups must be zero"


def test_traced_sizes_are_clipped():
    _gpu()
    rng = np.random.default_rng(7)
    M, K, N, G = 300, 256, 256, 5
    a, b = _operands(rng, M, K, N, G, jnp.bfloat16)
    cu, rf = _pair(jax_ep.grouped_matmul)
    for s in ([100, -7, 150, 200, 9], [0, 0, 0, 0, 2**30], [M, M, M, M, M]):
        sizes = jnp.asarray(s, jnp.int32)
        _poison()
        assert _rel(cu(a, b, sizes), rf(a, b, sizes)) < 1e-2, s


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind", ["random", "zipf", "empty_groups", "unused_tail"])
def test_gradients_match_reference(dtype, kind):
    _gpu()
    M, K, N, G = 2048, 512, 768, 16
    rng = np.random.default_rng(11)
    a, b = _operands(rng, M, K, N, G, dtype)
    sizes = jnp.asarray(_sizes(kind, rng, M, G))
    dout = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)

    def grads(backend):
        def loss(a, b):
            y = jax_ep.grouped_matmul(a, b, sizes, backend=backend)
            return jnp.sum(y.astype(jnp.float32) * dout)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    _poison()
    da, db = grads("cuda")
    ra, rb = grads("reference")
    assert da.dtype == jnp.dtype(dtype) and db.dtype == jnp.dtype(dtype)
    assert _rel(da, ra) < 1e-2
    assert _rel(db, rb) < 1e-2
    empty = np.asarray(sizes) == 0
    assert not np.any(np.asarray(db, np.float32)[empty]), "groups without rows: zero gradient"


@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_gradient_skips_segment_padding(accumulate):
    """padded_segments_matmul (the fused layer's GEMMs: segments aligned to a row block, zero
    padding past each count): the forward and the lhs gradient as grouped_matmul over the
    segments; the weight gradient over the first counts[g] rows of each segment only. The
    padding rows here hold noise, so a reduction over them shows; the last segment is padding
    only (a count of 0 in a segment of 128 rows: a zero weight gradient). With an accumulator
    (the fused layer's extra passes), the weight gradient is acc plus that, and the groups
    without data rows keep acc exactly."""
    _gpu()
    from jax_ep import grouped_gemm as gg
    K, N, A = 512, 384, 128
    counts = np.array([0, 1, 127, 128, 129, 300, 0, 256, 0], np.int32)
    sizes = (counts + A - 1) // A * A
    sizes[-1] = A
    G, M = len(counts), int(sizes.sum()) + 64          # and an unused tail
    rng = np.random.default_rng(41)
    a, b = _operands(rng, M, K, N, G, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    data = np.zeros(M, bool)
    for s0, c in zip(start, counts):
        data[s0:s0 + c] = True
    sizes, counts = jnp.asarray(sizes), jnp.asarray(counts)

    acc = (jnp.asarray(rng.standard_normal(b.shape), b.dtype) if accumulate else None)

    def loss(f, a, b):
        return jnp.sum(f(a, b).astype(jnp.float32) * dout)
    _poison()
    y = jax.jit(gg.padded_segments_matmul)(a, b, sizes, counts)
    da, db = jax.jit(jax.grad(functools.partial(
        loss, lambda a, b: gg.padded_segments_matmul(a, b, sizes, counts, acc)),
        argnums=(0, 1)))(a, b)

    def ref(a, b):
        return jax_ep.grouped_matmul(a, b, sizes, backend="reference")
    ry = jax.jit(ref)(a, b)
    ra = jax.jit(jax.grad(functools.partial(loss, ref), argnums=0))(a, b)
    # the weight gradient of the data rows alone: the padding rows zeroed
    a_data = jnp.where(jnp.asarray(data)[:, None], a, 0)
    rb = jax.jit(jax.grad(functools.partial(loss, ref), argnums=1))(a_data, b)
    if accumulate:
        rb = (rb.astype(jnp.float32) + acc.astype(jnp.float32)).astype(b.dtype)
    assert _rel(y, ry) < 1e-2
    assert _rel(da, ra) < 1e-2
    assert _rel(db, rb) < 1e-2
    no_data = np.asarray(counts) == 0
    want = np.asarray(acc)[no_data] if accumulate else 0
    got = np.asarray(db)[no_data]
    assert np.array_equal(got, np.broadcast_to(want, got.shape)), \
        "groups without data rows: acc kept exactly (zero without acc)"
    with pytest.raises(Exception, match="row_counts applies to mode 2"):
        jax.jit(lambda a, b: gg.gemm_call(a, b, sizes, None, None, mode="contiguous",
                                          rhs_kn=True, small_m=False, out_shape=(M, N),
                                          out_dtype=jnp.bfloat16, row_counts=counts))(
            a, b).block_until_ready()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind", ["zipf", "empty_groups"])
def test_weight_gradient_accumulates_into_acc(dtype, kind):
    """matmul_accumulating_grad: the rhs cotangent is acc + the product's weight gradient (CUDA
    against the reference), groups without rows keep acc exactly; in a loop over passes the
    sum lives in acc's buffer (XLA plans no second [G, K, N] set)."""
    _gpu()
    from jax_ep import grouped_gemm as gg
    M, K, N, G = 2048, 512, 768, 16
    rng = np.random.default_rng(17)
    a, b = _operands(rng, M, K, N, G, dtype)
    sizes = jnp.asarray(_sizes(kind, rng, M, G))
    acc = jnp.asarray(rng.standard_normal((G, K, N)), dtype)
    dout = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)

    def grad_b(backend, acc, b):
        def loss(b):
            y = gg.matmul_accumulating_grad(a, b, sizes, acc, backend=backend)
            return jnp.sum(y.astype(jnp.float32) * dout)
        return jax.grad(loss)(b)
    _poison()
    got = jax.jit(functools.partial(grad_b, "cuda"))(acc, b)
    want = jax.jit(functools.partial(grad_b, "reference"))(acc, b)
    assert got.dtype == jnp.dtype(dtype)
    assert _rel(got, want) < 1e-2
    empty = np.asarray(sizes) == 0
    assert np.array_equal(np.asarray(got)[empty], np.asarray(acc)[empty]), \
        "groups without rows: the gradient is acc unchanged"

    # three passes summed in a loop: with accumulation the loop holds one [G, K, N] set
    def plain_grad_b(b):
        return jax.grad(lambda b: jnp.sum(jax_ep.grouped_matmul(a, b, sizes, backend="cuda")
                                          .astype(jnp.float32) * dout))(b)

    def loop(accumulate, b):
        def body(_, s):
            return grad_b("cuda", s, b) if accumulate else s + plain_grad_b(b)
        return jax.lax.fori_loop(0, 3, body, jnp.zeros_like(b))
    one_set = G * K * N * jnp.dtype(dtype).itemsize
    temps = {}
    for accumulate in (True, False):
        c = jax.jit(functools.partial(loop, accumulate)).lower(b).compile()
        temps[accumulate] = c.memory_analysis().temp_size_in_bytes
        if accumulate:
            out = c(b)
    # the plain loop holds the fresh gradient beside the sum; the accumulating one only its
    # GEMM workspace
    assert temps[False] >= one_set > 4 * temps[True], (temps, one_set)
    total = want.astype(jnp.float32) - acc.astype(jnp.float32)   # one pass's gradient
    assert _rel(out, 3 * total) < 2e-2


# K = 1024, 512, 128, 384 and 640: 8, 4, 1, 3 and 5 K tiles (the FP8 mainloop alternates two
# accumulators over the K tiles: even and odd counts end differently)
@pytest.mark.parametrize("shape", [(4096, 1024, 512, 8), (600, 512, 256, 16), (1, 128, 128, 2),
                                   (300, 384, 256, 4), (700, 640, 384, 8)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["random", "zipf", "unused_tail"])
def test_fp8_matches_reference(shape, kind):
    _gpu()
    M, K, N, G = shape
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    lhs = jax_ep.quantize_fp8(x)
    w = jax_ep.quantize_fp8_weights(
        jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32))
    sizes = jnp.asarray(_sizes(kind, rng, M, G))
    cu, rf = _pair(jax_ep.grouped_matmul)
    _poison()
    got = cu(lhs, w, sizes)
    assert got.dtype == jnp.bfloat16
    assert _rel(got, rf(lhs, w, sizes)) < 1e-2
    assert not np.any(np.asarray(got, np.float32)[int(np.asarray(sizes).sum()):])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("counts_kind", ["random", "full", "empty", "mixed"])
def test_masked_matches_reference(fp8, counts_kind):
    _gpu()
    G, C, K, N = 8, 256, 1024, 512
    rng = np.random.default_rng(17)
    counts = {"random": rng.integers(0, C + 1, G), "full": np.full(G, C),
              "empty": np.zeros(G), "mixed": np.array([0, 1, 2, 63, 64, 65, C, 100])}[counts_kind]
    counts = jnp.asarray(counts, jnp.int32)
    x = jnp.asarray(rng.standard_normal((G, C, K)), jnp.bfloat16)
    wf = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32)
    if fp8:
        lhs = jax_ep.quantize_fp8(x)
        w = jax_ep.quantize_fp8_weights(wf)
    else:
        lhs, w = x, wf.astype(jnp.bfloat16)
    cu, rf = _pair(jax_ep.grouped_matmul_masked)
    _poison()
    got = cu(lhs, w, counts)
    want = rf(lhs, w, counts)
    assert got.shape == (G, C, N) and got.dtype == jnp.bfloat16
    if np.asarray(counts).sum():
        assert _rel(got, want) < 1e-2
    g = np.asarray(got, np.float32)
    for i, c in enumerate(np.asarray(counts)):
        assert not np.any(g[i, c:]), f"group {i}: rows past its count must be zero"


@pytest.mark.parametrize("fp8", [False, True])
def test_masked_without_zero_padding(fp8):
    """zero_padding=False: the valid rows are the same; the rest is not written."""
    _gpu()
    G, C, K, N = 4, 128, 512, 256
    rng = np.random.default_rng(29)
    counts = jnp.asarray([0, 5, 64, 128], jnp.int32)
    x = jnp.asarray(rng.standard_normal((G, C, K)), jnp.bfloat16)
    wf = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32)
    lhs, w = ((jax_ep.quantize_fp8(x), jax_ep.quantize_fp8_weights(wf)) if fp8
              else (x, wf.astype(jnp.bfloat16)))
    got = np.asarray(jax.jit(functools.partial(jax_ep.grouped_matmul_masked, zero_padding=False,
                                               backend="cuda"))(lhs, w, counts), np.float32)
    want = np.asarray(jax.jit(functools.partial(jax_ep.grouped_matmul_masked,
                                                backend="reference"))(lhs, w, counts), np.float32)
    for g, c in enumerate(np.asarray(counts)):
        if c:
            assert _rel(got[g, :c], want[g, :c]) < 1e-2


def test_long_scan_with_fresh_sizes():
    """200 calls in one scan, new group sizes (and a fresh input) every step."""
    _gpu()
    M, K, N, G, steps = 512, 256, 256, 8, 200
    rng = np.random.default_rng(19)
    a, b = _operands(rng, M, K, N, G, jnp.bfloat16)
    sizes = jnp.asarray(np.stack([_sizes("random" if s % 3 else "zipf", rng, M, G)
                                  for s in range(steps)]))

    def run(backend):
        def step(x, s):
            y = jax_ep.grouped_matmul(x, b, s, backend=backend)
            return x, jnp.sum(y.astype(jnp.float32), axis=1)
        return jax.jit(lambda a, sz: jax.lax.scan(step, a, sz)[1])(a, sizes)
    _poison()
    got, want = run("cuda"), run("reference")
    for s in range(steps):
        assert _rel(got[s], want[s]) < 2e-2, f"step {s}"


def test_inside_shard_map_and_remat():
    g = _gpu()
    mesh = Mesh(np.array([g]), ("ep",))
    M, K, N, G = 512, 256, 256, 4
    rng = np.random.default_rng(23)
    a, b = _operands(rng, M, K, N, G, jnp.bfloat16)
    sizes = jnp.asarray([100, 0, 300, 50], jnp.int32)

    def loss(a, b, backend):
        f = jax.checkpoint(lambda a, b: jax_ep.grouped_matmul(a, b, sizes, backend=backend))
        return jnp.sum(f(a, b).astype(jnp.float32) ** 2)

    def run(backend):
        sm = jax.shard_map(lambda a, b: jax.grad(loss, argnums=(0, 1))(a, b, backend),
                           mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                           check_vma=False)
        return jax.jit(sm)(a, b)
    got, want = run("cuda"), run("reference")
    assert _rel(got[0], want[0]) < 1e-2 and _rel(got[1], want[1]) < 1e-2


def test_unsupported_shapes():
    _gpu()
    a = jnp.ones((64, 100), jnp.bfloat16)  # K not a multiple of 8
    b = jnp.ones((2, 100, 64), jnp.bfloat16)
    s = jnp.asarray([30, 30], jnp.int32)
    with pytest.raises(ValueError, match="multiples of 8"):
        jax_ep.grouped_matmul(a, b, s, backend="cuda")
    out = jax_ep.grouped_matmul(a, b, s)  # auto: XLA's ragged_dot
    np.testing.assert_allclose(np.asarray(out, np.float32)[:60], 100.0)
    with pytest.raises(ValueError, match="float32 operands run on XLA"):
        jax_ep.grouped_matmul(a.astype(jnp.float32), b.astype(jnp.float32), s, backend="cuda")


def test_under_command_buffers():
    """XLA command buffers (CUDA graphs) on: the custom calls are captured and replayed."""
    _gpu()
    code = (
        "import jax, jax.numpy as jnp, numpy as np, jax_ep\n"
        "rng = np.random.default_rng(0)\n"
        "a = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)\n"
        "b = jnp.asarray(rng.standard_normal((8, 512, 256)) / 20, jnp.bfloat16)\n"
        "res = {}\n"
        "for be in ('cuda', 'reference'):\n"
        "    def loss(a, b, s):\n"
        "        return jnp.sum(jax_ep.grouped_matmul(a, b, s, backend=be).astype(jnp.float32)"
        " ** 2)\n"
        "    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))\n"
        "    outs = []\n"
        "    for i in range(20):\n"
        "        s = jnp.asarray(np.random.default_rng(i).multinomial(1000, np.ones(8) / 8),"
        " jnp.int32)\n"
        "        v, (da, db) = f(a, b, s)\n"
        "        outs.append(np.concatenate([np.ravel(np.asarray(v, np.float32)),"
        " np.ravel(np.asarray(da, np.float32)), np.ravel(np.asarray(db, np.float32))]))\n"
        "    res[be] = np.stack(outs)\n"
        "err = np.linalg.norm(res['cuda'] - res['reference']) / np.linalg.norm(res['reference'])\n"
        "assert err < 1e-2, err\n"
        "print('OK command buffers', err)\n")
    p = run_with_command_buffers(code)
    assert p.returncode == 0 and "OK command buffers" in p.stdout, p.stdout + p.stderr
