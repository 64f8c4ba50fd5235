"""grouped_matmul / grouped_matmul_masked / FP8 weights on the reference backend (runs
everywhere), against the NumPy oracle; argument errors. The CUDA kernels are compared with the
reference in tests/test_gpu_gemm.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
import numpy_oracle as npo

REF = "reference"
TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _rel(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _operands(rng, M, K, N, G, dtype):
    a = jnp.asarray(rng.standard_normal((M, K)), dtype)
    b = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    return a, b


SIZES = {
    "uniform": lambda M, G: np.full(G, M // G),
    "empty_groups": lambda M, G: np.array([0, M // 2, 0] + [0] * (G - 4) + [M - M // 2]),
    "unused_tail": lambda M, G: np.array([3] * (G - 1) + [1]),
    "one_group": lambda M, G: np.array([M] + [0] * (G - 1)),
    "all_empty": lambda M, G: np.zeros(G, np.int64),
}


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind", list(SIZES))
def test_forward_matches_oracle(dtype, kind):
    rng = np.random.default_rng(0)
    M, K, N, G = 64, 32, 24, 5
    a, b = _operands(rng, M, K, N, G, dtype)
    sizes = SIZES[kind](M, G).astype(np.int32)
    out = jax_ep.grouped_matmul(a, b, jnp.asarray(sizes), backend=REF)
    assert out.shape == (M, N) and out.dtype == jnp.dtype(dtype)
    want = npo.grouped_matmul(np.asarray(a, np.float32), np.asarray(b, np.float32), sizes)
    assert _rel(out, want) < TOL[dtype]
    used = min(int(sizes.sum()), M)
    assert not np.any(np.asarray(out, np.float32)[used:]), "rows past the groups must be zero"


def test_preferred_element_type_and_traced_clipping():
    rng = np.random.default_rng(1)
    M, K, N, G = 40, 16, 8, 4
    a, b = _operands(rng, M, K, N, G, jnp.bfloat16)
    out = jax_ep.grouped_matmul(a, b, jnp.asarray([10, 10, 10, 10], jnp.int32),
                                preferred_element_type=jnp.float32, backend=REF)
    assert out.dtype == jnp.float32
    # Under jit, sizes summing past M are clipped to M and negative sizes count as 0.
    f = jax.jit(functools.partial(jax_ep.grouped_matmul, backend=REF))
    sizes = np.array([15, -4, 30, 7], np.int32)
    got = f(a, b, jnp.asarray(sizes))
    want = npo.grouped_matmul(np.asarray(a, np.float32), np.asarray(b, np.float32), sizes)
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gradients_match_oracle(dtype):
    rng = np.random.default_rng(2)
    M, K, N, G = 48, 16, 24, 4
    a, b = _operands(rng, M, K, N, G, dtype)
    sizes = np.array([20, 0, 13, 9], np.int32)  # an empty group and an unused tail
    dout = rng.standard_normal((M, N)).astype(np.float32)

    def loss(a, b):
        out = jax_ep.grouped_matmul(a, b, jnp.asarray(sizes), backend=REF)
        return jnp.sum(out.astype(jnp.float32) * dout)
    da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    assert da.dtype == a.dtype and db.dtype == b.dtype
    wa, wb = npo.grouped_matmul_grads(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      sizes, dout)
    assert _rel(da, wa) < TOL[dtype] * 2
    assert _rel(db, wb) < TOL[dtype] * 2
    assert not np.any(np.asarray(db, np.float32)[1]), "a group without rows has zero gradient"


def test_under_scan_remat_and_shard_map(mesh4):
    rng = np.random.default_rng(3)
    M, K, N, G, R = 32, 16, 8, 4, 4
    a = jnp.asarray(rng.standard_normal((R, M, K)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((R, G, K, N)), jnp.float32)
    sizes = jnp.asarray(rng.integers(0, 9, (R, 10, G)), jnp.int32)

    def shard(a, b, sizes):
        @jax.checkpoint
        def step(c, s):
            y = jax_ep.grouped_matmul(a[0] + c, b[0], s, backend=REF)
            return c + 1e-3 * jnp.mean(y), jnp.sum(y)
        c0 = jax.lax.pcast(jnp.float32(0.0), ("ep",), to="varying")
        _, ys = jax.lax.scan(step, c0, sizes[0])
        return ys[None]
    f = jax.jit(jax.shard_map(shard, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))
    got = np.asarray(f(a, b, sizes))
    for r in range(R):
        c = 0.0
        for s in range(10):
            y = npo.grouped_matmul(np.asarray(a[r]) + c, np.asarray(b[r]), np.asarray(sizes[r, s]))
            np.testing.assert_allclose(got[r, s], y.sum(), rtol=1e-3, atol=1e-3)
            c = c + 1e-3 * y.mean()
    g = jax.jit(jax.shard_map(jax.grad(lambda a, b, s: shard(a, b, s).sum(), argnums=(0, 1)),
                              mesh=mesh4, in_specs=P("ep"), out_specs=P("ep")))(a, b, sizes)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_masked_matches_oracle(dtype):
    rng = np.random.default_rng(4)
    G, C, K, N = 4, 16, 32, 24
    a = jnp.asarray(rng.standard_normal((G, C, K)), dtype)
    b = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    counts = np.array([0, 16, 5, 1], np.int32)
    out = jax_ep.grouped_matmul_masked(a, b, jnp.asarray(counts), backend=REF)
    assert out.shape == (G, C, N) and out.dtype == jnp.dtype(dtype)
    want = npo.grouped_matmul_masked(np.asarray(a, np.float32), np.asarray(b, np.float32), counts)
    assert _rel(out, want) < TOL[dtype]
    for g in range(G):
        assert not np.any(np.asarray(out, np.float32)[g, counts[g]:])


def test_fp8_weights_round_trip():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 256, 384)).astype(np.float32)
    w[1, :128, 128:256] *= 1000.0  # one block with a large scale must not affect the others
    q = jax_ep.quantize_fp8_weights(jnp.asarray(w))
    assert q.data.shape == (3, 384, 256) and q.data.dtype == jnp.float8_e4m3fn
    assert q.scales.shape == (3, 2, 3) and q.scales.dtype == jnp.float32
    back = np.asarray(jax_ep.dequantize_fp8_weights(q))
    np.testing.assert_allclose(back, npo.dequantize_weights(q.data, q.scales), rtol=1e-6)
    assert _rel(back, w) < 0.05
    blk = np.abs(w[0, 128:256, :128]).max()
    np.testing.assert_allclose(float(q.scales[0, 1, 0]), blk / 448.0, rtol=1e-6)


def test_fp8_forward_matches_oracle():
    rng = np.random.default_rng(6)
    M, K, N, G = 50, 256, 128, 3
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    lhs = jax_ep.quantize_fp8(x)
    w = jax_ep.quantize_fp8_weights(jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32))
    sizes = np.array([20, 0, 25], np.int32)
    out = jax_ep.grouped_matmul(lhs, w, jnp.asarray(sizes), backend=REF)
    assert out.shape == (M, N) and out.dtype == jnp.bfloat16
    want = npo.grouped_matmul(npo.dequantize_rows(*lhs), npo.dequantize_weights(*w), sizes)
    assert _rel(out, want) < 1e-2
    masked = jax_ep.grouped_matmul_masked(
        (lhs[0][:48].reshape(G, 16, K), lhs[1][:48].reshape(G, 16, K // 128)), w,
        jnp.asarray([16, 3, 0], jnp.int32), backend=REF)
    want_m = npo.grouped_matmul_masked(npo.dequantize_rows(lhs[0][:48], lhs[1][:48]).reshape(
        G, 16, K), npo.dequantize_weights(*w), [16, 3, 0])
    assert _rel(masked, want_m) < 1e-2
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda s: jax_ep.grouped_matmul(
            (lhs[0], lhs[1] * s), w, jnp.asarray(sizes), backend=REF).astype(
                jnp.float32).sum())(1.0)


def test_bad_arguments():
    M, K, N, G = 16, 8, 8, 2
    a = jnp.zeros((M, K), jnp.float32)
    b = jnp.zeros((G, K, N), jnp.float32)
    s = jnp.asarray([8, 8], jnp.int32)
    gm = functools.partial(jax_ep.grouped_matmul, backend=REF)
    with pytest.raises(ValueError, match="group_sizes: the sizes sum to 20"):
        gm(a, b, jnp.asarray([12, 8], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes: negative"):
        gm(a, b, jnp.asarray([-1, 8], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes: has 3 entries, expected G=2"):
        gm(a, b, jnp.asarray([1, 1, 1], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes: dtype float32"):
        gm(a, b, jnp.asarray([8.0, 8.0]))
    with pytest.raises(ValueError, match=r"lhs: expected a rank-2 array \[M, K\]"):
        gm(a[None], b, s)
    with pytest.raises(ValueError, match=r"rhs: expected a rank-3 array \[G, K, N\]"):
        gm(a, b[0], s)
    with pytest.raises(ValueError, match="lhs: K=8 does not match rhs"):
        gm(a, jnp.zeros((G, 4, N)), s)
    with pytest.raises(TypeError, match="rhs: dtype bfloat16 differs"):
        gm(a, b.astype(jnp.bfloat16), s)
    with pytest.raises(TypeError, match="lhs: dtype int32"):
        gm(a.astype(jnp.int32), b, s)
    with pytest.raises(TypeError, match="preferred_element_type: int32"):
        gm(a, b, s, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="backend="):
        jax_ep.grouped_matmul(a, b, s, backend="gpu")
    with pytest.raises(ValueError, match="w: K=100 and N=128 must be multiples of 128"):
        jax_ep.quantize_fp8_weights(jnp.zeros((2, 100, 128)))
    xq = jnp.zeros((M, 100), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"lhs\[0\] \(lhs_fp8\): K=100 must be a multiple"):
        gm((xq, jnp.zeros((M, 1))), jax_ep.quantize_fp8_weights(jnp.zeros((G, 128, 128))), s)
    with pytest.raises(TypeError, match="an FP8 lhs needs FP8 weights"):
        gm((jnp.zeros((M, 128), jnp.float8_e4m3fn), jnp.zeros((M, 1))), jnp.zeros((G, 128, N)), s)
    with pytest.raises(TypeError, match="FP8 weights need an FP8 lhs"):
        gm(jnp.zeros((M, 128)), jax_ep.quantize_fp8_weights(jnp.zeros((G, 128, 128))), s)
    with pytest.raises(ValueError, match="counts: entries \\[9\\] exceed the capacity C=8"):
        jax_ep.grouped_matmul_masked(jnp.zeros((G, 8, K)), b, jnp.asarray([9, 1]), backend=REF)
    with pytest.raises(ValueError, match=r"lhs: expected a rank-3 array \[G, C, K\]"):
        jax_ep.grouped_matmul_masked(a, b, s, backend=REF)
    with pytest.raises(TypeError, match="zero_padding must be a bool"):
        jax_ep.grouped_matmul_masked(jnp.zeros((G, 8, K)), b, s, zero_padding="no", backend=REF)


def test_cuda_backend_without_gpu_says_why():
    if jax.default_backend() == "gpu":
        pytest.skip("runs where no GPU is present")
    a = jnp.zeros((16, 8), jnp.bfloat16)
    b = jnp.zeros((2, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend='cuda' needs"):
        jax_ep.grouped_matmul(a, b, jnp.asarray([8, 8], jnp.int32), backend="cuda")


def test_weight_gradient_accumulator_is_checked(mesh_dp_ep):
    """The accumulator of the in-place weight gradient (the layer's extra passes): rhs's shape
    and dtype, and, inside shard_map, varying along the rows' axes (each shard's partial sums),
    else a ValueError naming acc; a weight replicated over dp gets its gradient summed there."""
    from jax_ep import grouped_gemm as gg
    G, K, N, M = 2, 8, 4, 6
    a = jnp.ones((M, K), jnp.float32)
    b = jnp.ones((G, K, N), jnp.float32)
    sizes = jnp.array([2, 4], jnp.int32)
    for acc, what in ((jnp.zeros((G, K, N + 1), jnp.float32), r"\[2, 8, 5\]"),
                      (jnp.zeros((G, K, N), jnp.bfloat16), "bfloat16")):
        with pytest.raises(ValueError, match=f"acc: .*{what}.*, expected rhs's float32"):
            gg.matmul_accumulating_grad(a, b, sizes, acc, backend="reference")
        with pytest.raises(ValueError, match=f"acc: .*{what}.*, expected rhs's float32"):
            gg.padded_segments_matmul(a, b, sizes, sizes, acc)
    rows, ep = P(("dp", "ep")), P("ep")

    def grad_b(a, b, acc):
        f = functools.partial(gg.matmul_accumulating_grad, sizes=sizes, backend="reference")
        return jax.grad(lambda b: jnp.sum(f(a, b, acc=acc)))(b)
    S = 4
    args = (jnp.ones((S * M, K), jnp.float32), jnp.ones((2 * G, K, N), jnp.float32))
    with pytest.raises(ValueError, match=r"acc: varies along \['ep'\], expected "
                                         r"\['dp', 'ep'\]"):
        jax.shard_map(grad_b, mesh=mesh_dp_ep, in_specs=(rows, ep, ep), out_specs=ep)(
            *args, jnp.zeros((2 * G, K, N), jnp.float32))
    # without an accumulator: the replicas' gradients summed over dp (2 replicas of 6 rows)
    got = jax.shard_map(lambda a, b: jax.grad(lambda b: jnp.sum(jax_ep.grouped_matmul(
        a, b, sizes, backend="reference")))(b), mesh=mesh_dp_ep, in_specs=(rows, ep),
        out_specs=ep)(*args)
    np.testing.assert_allclose(np.asarray(got)[:G], 2 * np.array([2, 4])[:, None, None]
                               * np.ones((G, K, N)))
