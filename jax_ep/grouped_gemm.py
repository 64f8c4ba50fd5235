"""Grouped GEMMs for the experts: `grouped_matmul` (a drop-in for `jax.lax.ragged_dot`) and FP8
weights; `grouped_matmul_masked` (the low-latency receive layout) is in `grouped_gemm_masked`.

The CUDA backend runs CUTLASS's SM90 grouped GEMMs (TMA, warp-specialised, persistent): group
sizes stay on the device, a small kernel turns them into per-group problem shapes and pointers,
and the tiles of every group are scheduled in one launch, so the time follows the rows used, not
the buffer's size. The reference backend is `lax.ragged_dot` (float32 accumulation).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, _ffi, runtime
from jax_ep._common import AMAX_MIN, FP8_MAX, dequantize_fp8, to_e4m3_rne

FP8_BLOCK = 128  # FP8 scale block: 1 x 128 for activations, 128 x 128 for weights
_GEMM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Rows per group at or below which the kernels use 64-row tiles (else 128 rows).
_SMALL_M_ROWS = 128


def _small_m(M, G):
    """The 64-row tiles for M rows over G groups (few rows per group)."""
    return M <= _SMALL_M_ROWS * G


class Fp8Weights(NamedTuple):
    """Expert weights in FP8 for `grouped_matmul` / `grouped_matmul_masked`.

    data:   [G, N, K] float8_e4m3fn: w[g] transposed, so both operands are K-major (the layout
            the FP8 tensor cores read).
    scales: [G, K // 128, N // 128] float32: one scale per 128 x 128 block of w[g] ([K, N]);
            w[g][k, n] ~ data[g, n, k] * scales[g, k // 128, n // 128].
    """
    data: jax.Array
    scales: jax.Array


def quantize_fp8_weights(w: jax.Array) -> Fp8Weights:
    """Expert weights in FP8 e4m3 with one float32 scale per 128 x 128 block.

    Each block's scale is its largest magnitude / 448 (the largest e4m3 value); values are
    rounded to nearest even.

    Args:
      w: `[G, K, N]` float32, bfloat16 or float16; K and N multiples of 128.

    Returns:
      Fp8Weights: `data` `[G, N, K]` float8_e4m3fn (each w[g] transposed) and `scales`
      `[G, K // 128, N // 128]` float32, the `rhs` of an FP8 `grouped_matmul` or
      `grouped_matmul_masked`.
    """
    _checks.expect_rank("w", w, 3, "[G, K, N]")
    _checks.expect_dtype("w", w, _GEMM_DTYPES)
    G, K, N = w.shape
    if K % FP8_BLOCK or N % FP8_BLOCK:
        raise ValueError(f"w: K={K} and N={N} must be multiples of {FP8_BLOCK} for FP8 weights")
    b = w.astype(jnp.float32).reshape(G, K // FP8_BLOCK, FP8_BLOCK, N // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=(2, 4)), AMAX_MIN)
    scales = amax * jnp.float32(1.0 / FP8_MAX)
    q = to_e4m3_rne(jnp.clip(b * (FP8_MAX / amax)[:, :, None, :, None], -FP8_MAX, FP8_MAX))
    data = jnp.swapaxes(q.reshape(G, K, N), 1, 2)
    return Fp8Weights(data, scales)


def dequantize_fp8_weights(w: Fp8Weights) -> jax.Array:
    """The float32 weights that `Fp8Weights` stand for (`quantize_fp8_weights` undone).

    Args:
      w: Fp8Weights (`data` `[G, N, K]` float8_e4m3fn, `scales` `[G, K // 128, N // 128]`).

    Returns:
      `[G, K, N]` float32: w[g][k, n] = data[g, n, k] * scales[g, k // 128, n // 128].
    """
    data, scales = w
    G, N, K = data.shape
    x = jnp.swapaxes(data.astype(jnp.float32), 1, 2).reshape(
        G, K // FP8_BLOCK, FP8_BLOCK, N // FP8_BLOCK, FP8_BLOCK)
    return (x * scales[:, :, None, :, None]).reshape(G, K, N)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------

def _lhs_parts(lhs, what, lead):
    """(data, scales or None); checks rank and dtype. lead: '[M, K]' or '[G, C, K]'."""
    ndim = lead.count(",") + 1
    if isinstance(lhs, (tuple, list)):
        if len(lhs) != 2:
            raise ValueError(f"{what}: an FP8 lhs is a tuple (lhs_fp8 {lead}, "
                             f"lhs_scales {lead[:-2]}K // 128])")
        q, s = lhs
        _checks.expect_rank(f"{what}[0] (lhs_fp8)", q, ndim, lead)
        _checks.expect_dtype(f"{what}[0] (lhs_fp8)", q, (jnp.float8_e4m3fn,))
        _checks.expect_rank(f"{what}[1] (lhs_scales)", s, ndim, lead[:-2] + "K // 128]")
        _checks.expect_dtype(f"{what}[1] (lhs_scales)", s, (jnp.float32,))
        K = q.shape[-1]
        if K % FP8_BLOCK:
            raise ValueError(f"{what}[0] (lhs_fp8): K={K} must be a multiple of {FP8_BLOCK}")
        if tuple(s.shape) != tuple(q.shape[:-1]) + (K // FP8_BLOCK,):
            raise ValueError(f"{what}[1] (lhs_scales): shape {tuple(s.shape)}, expected "
                             f"{tuple(q.shape[:-1]) + (K // FP8_BLOCK,)}")
        return q, s
    _checks.expect_rank(what, lhs, ndim, lead)
    _checks.expect_dtype(what, lhs, _GEMM_DTYPES)
    return lhs, None


def _rhs_parts(rhs, G_name="G"):
    """(data, scales or None, K, N)."""
    if isinstance(rhs, (tuple, list)):
        if len(rhs) != 2:
            raise ValueError("rhs: FP8 weights are Fp8Weights(data [G, N, K], scales "
                             "[G, K // 128, N // 128]) from jax_ep.quantize_fp8_weights")
        d, s = rhs
        _checks.expect_rank("rhs.data", d, 3, "[G, N, K]")
        _checks.expect_dtype("rhs.data", d, (jnp.float8_e4m3fn,))
        _checks.expect_rank("rhs.scales", s, 3, "[G, K // 128, N // 128]")
        _checks.expect_dtype("rhs.scales", s, (jnp.float32,))
        G, N, K = d.shape
        want = (G, K // FP8_BLOCK, N // FP8_BLOCK)
        if K % FP8_BLOCK or N % FP8_BLOCK or tuple(s.shape) != want:
            raise ValueError(f"rhs: FP8 weights need K, N multiples of {FP8_BLOCK} and scales "
                             f"{want}; got data {tuple(d.shape)}, scales {tuple(s.shape)}")
        return d, s, K, N
    _checks.expect_rank("rhs", rhs, 3, "[G, K, N]")
    _checks.expect_dtype("rhs", rhs, _GEMM_DTYPES)
    return rhs, None, rhs.shape[1], rhs.shape[2]


def _sizes(name, v, G, *, total=None, each=None):
    """Group sizes as int32. Concrete values (not traced) are checked here, where bad ones are
    visible: no negative entry, a sum of at most `total`, every entry at most `each`. Traced
    values are clipped by the kernels instead (documented)."""
    _checks.expect_rank(name, v, 1, "[G]")
    _checks.expect_dtype(name, v, (jnp.int32, jnp.int64))
    if v.shape[0] != G:
        raise ValueError(f"{name}: has {v.shape[0]} entries, expected G={G} (rhs.shape[0])")
    if isinstance(v, jax.core.Tracer):
        return v.astype(jnp.int32)
    host = np.asarray(v).astype(np.int64)
    if (host < 0).any():
        raise ValueError(f"{name}: negative entries {host[host < 0][:4].tolist()}")
    if total is not None and host.sum() > total:
        raise ValueError(f"{name}: the sizes sum to {int(host.sum())}, more than the {total} "
                         "rows of lhs")
    if each is not None and (host > each).any():
        raise ValueError(f"{name}: entries {host[host > each][:4].tolist()} exceed the "
                         f"capacity C={each} of lhs")
    return v.astype(jnp.int32)


def _out_dtype(preferred, default):
    if preferred is None:
        return jnp.dtype(default)
    d = jnp.dtype(preferred)
    if d not in [jnp.dtype(t) for t in _GEMM_DTYPES]:
        raise TypeError(f"preferred_element_type: {d.name} is not supported; expected one of "
                        "float32, bfloat16, float16")
    return d


def _cuda_ok(backend, dtype, out_dtype, shape_check, what):
    """True when the CUDA kernels serve the call; False sends it to the reference backend.
    backend='cuda' raises instead of falling back."""
    b = _checks.resolve_backend(backend)
    if b == "reference":
        return False
    ext = runtime.extension()
    why = None
    if not ext.gemm_built():
        why = "the extension was built without CUTLASS (grouped GEMM kernels)"
    elif jnp.dtype(dtype) == jnp.float32:
        why = "float32 operands run on XLA (the kernels take bfloat16, float16 and FP8)"
    elif jnp.dtype(out_dtype) != (jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype).itemsize == 1
                                  else jnp.dtype(dtype)):
        why = (f"preferred_element_type={jnp.dtype(out_dtype).name}: the kernels write the "
               "operand dtype (bfloat16 for FP8)")
    else:
        why = shape_check() or None
    if why is None:
        return True
    if backend == "cuda":
        raise ValueError(f"{what}(backend='cuda'): {why}")
    return False


def gemm_call(lhs, rhs, sizes, lhs_scales, rhs_scales, *, mode, rhs_kn, small_m, out_shape,
               out_dtype, zero_padding=True, row_counts=None, acc=None):
    """One jax_ep_grouped_gemm custom call (docs/ffi.md). row_counts (mode "transposed"): [G]
    rows of each group's segment to reduce over (the rest is padding), or None: all. acc (mode
    "transposed"): None, or [G, K, N] that the product is added to, in acc's buffer."""
    ext = runtime.extension()
    dtype_code = ext.gemm_dtypes[jnp.dtype(lhs.dtype).name]
    mode_code = ext.gemm_modes[mode]
    if mode == "masked":
        G, M, K = lhs.shape
    else:
        (M, K), G = lhs.shape, sizes.shape[0]
    N = out_shape[-1]
    ws = ext.grouped_gemm_workspace_bytes(mode_code, dtype_code, rhs_kn, small_m, G, M, K, N,
                                          runtime.current_cuda_device(),
                                          accumulate=acc is not None)
    empty = jnp.zeros((0,), jnp.float32)
    out, _ = _ffi.call(
        "jax_ep_grouped_gemm",
        [lhs, rhs, sizes, empty if lhs_scales is None else lhs_scales,
         empty if rhs_scales is None else rhs_scales,
         jnp.zeros((0,), jnp.int32) if row_counts is None else row_counts,
         jnp.zeros((0,), out_dtype) if acc is None else acc],
        [(out_shape, out_dtype), ((ws,), jnp.uint8)], pure=True,
        aliases=() if acc is None else ((6, 0),),
        mode=mode_code, rhs_kn=bool(rhs_kn), small_m=bool(small_m),
        zero_padding=bool(zero_padding), accumulate=acc is not None)
    return out


def _unsupported(mode, dtype, rhs_kn, G, M, K, N):
    ext = runtime.extension()
    return ext.gemm_unsupported(ext.gemm_modes[mode], ext.gemm_dtypes[jnp.dtype(dtype).name],
                                rhs_kn, G, M, K, N)


# ---------------------------------------------------------------------------------------------
# Reference backend (lax.ragged_dot, float32 accumulation)
# ---------------------------------------------------------------------------------------------

def _ref_gmm(lhs, rhs, sizes, out_dtype):
    out = jax.lax.ragged_dot(lhs, rhs, jnp.maximum(sizes, 0),
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# grouped_matmul
# ---------------------------------------------------------------------------------------------

class _Config(NamedTuple):
    """The static settings of one grouped GEMM. small_m (contiguous layout): 64-row tiles;
    zero_padding (masked layout): zero the rows past each count."""
    out_dtype: Any
    use_cuda: bool
    small_m: bool = False
    zero_padding: bool = True


def _gmm_core(lhs, rhs, sizes, counts, cfg):
    """Forward of the float path (every row of each segment: padding rows are zeros)."""
    del counts
    out_dtype, use_cuda, small_m = cfg.out_dtype, cfg.use_cuda, cfg.small_m
    if not use_cuda:
        return _ref_gmm(lhs, rhs, sizes, out_dtype)
    M, N = lhs.shape[0], rhs.shape[2]
    return gemm_call(lhs, rhs, sizes, None, None, mode="contiguous", rhs_kn=True,
                      small_m=small_m, out_shape=(M, N), out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm_diff(lhs, rhs, sizes, counts, acc, cfg):
    """The float path. counts: None, or [G] rows of each group that hold data (the rest of its
    `sizes` rows are zero padding, which the weight gradient skips; the CUDA backend's only).
    acc: None, or [G, K, N] in rhs's dtype that rhs's cotangent is added to (its own buffer on
    the CUDA backend); acc gets no cotangent."""
    return _gmm_core(lhs, rhs, sizes, counts, cfg)


def _gmm_fwd(lhs, rhs, sizes, counts, acc, cfg):
    return _gmm_core(lhs, rhs, sizes, counts, cfg), (lhs, rhs, sizes, counts, acc)


def _ref_vjp(product, lhs, rhs, g):
    """(d lhs, d rhs, None) of a reference product, in float32, cast to the operands' dtypes."""
    _, vjp = jax.vjp(product, lhs, rhs)
    dlhs, drhs = vjp(g.astype(jnp.float32))
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


def _gmm_bwd(cfg, res, g):
    lhs, rhs, sizes, counts, acc = res
    use_cuda = cfg.use_cuda
    if not use_cuda:
        dlhs, drhs, _ = _ref_vjp(lambda a, b: _ref_gmm(a, b, sizes, jnp.float32), lhs, rhs, g)
        if acc is not None:
            drhs = (acc.astype(jnp.float32) + drhs.astype(jnp.float32)).astype(rhs.dtype)
        return dlhs, drhs, None, None, None
    M, K = lhs.shape
    G, _, N = rhs.shape
    g = g.astype(lhs.dtype)
    # d lhs[rows of g] = dout[rows of g] @ rhs[g]^T: rhs [G, K, N] read as [G, N', K'] (N' = K).
    dlhs = gemm_call(g, rhs, sizes, None, None, mode="contiguous", rhs_kn=False,
                      small_m=False, out_shape=(M, K), out_dtype=lhs.dtype)
    drhs = _weight_grad(lhs, g, sizes, counts, acc, rhs.dtype)
    return dlhs, drhs, None, None, None


def _weight_grad(lhs, g, sizes, counts, acc, dtype):
    """d rhs[g] = lhs[rows of g]^T @ dout[rows of g] (zeros for groups without rows), over the
    first counts[g] rows of each segment (all: counts None), added to acc in its buffer when
    given: [G, K, N] in dtype, the CUDA backend's transposed grouped GEMM."""
    (_, K), N, G = lhs.shape, g.shape[1], sizes.shape[0]
    return gemm_call(lhs, g, sizes, None, None, mode="transposed", rhs_kn=True, small_m=False,
                     out_shape=(G, K, N), out_dtype=dtype, row_counts=counts, acc=acc)


_gmm_diff.defvjp(_gmm_fwd, _gmm_bwd)


def _dequantized(lq, ls, rq, rs):
    """FP8 operands as float32 (the reference computes FP8 products this way)."""
    return dequantize_fp8(lq, ls), dequantize_fp8_weights(Fp8Weights(rq, rs))


def _fp8_core(lq, ls, rq, rs, sizes, cfg):
    use_cuda, small_m = cfg.use_cuda, cfg.small_m
    if not use_cuda:
        return _ref_gmm(*_dequantized(lq, ls, rq, rs), sizes, jnp.bfloat16)
    M, N = lq.shape[0], rq.shape[1]
    return gemm_call(lq, rq, sizes, ls, rs, mode="contiguous", rhs_kn=False, small_m=small_m,
                      out_shape=(M, N), out_dtype=jnp.bfloat16)


def _no_fp8_grad(name):
    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def f(core, *args):
        return core(*args)

    @f.defjvp
    def _jvp(core, primals, tangents):
        raise TypeError(f"jax_ep.{name}: FP8 operands are forward-only (no gradient); use "
                        "bfloat16 / float16 / float32 operands to differentiate")
    return f


_fp8_fwd_only = _no_fp8_grad("grouped_matmul")


def grouped_matmul(lhs: jax.Array | tuple[jax.Array, jax.Array], rhs: jax.Array | Fp8Weights,
                   group_sizes: jax.Array, *,
                   preferred_element_type: jax.typing.DTypeLike | None = None,
                   backend: str = "auto") -> jax.Array:
    """Grouped matrix product, the semantics of `jax.lax.ragged_dot`.

    Args:
      lhs: `[M, K]` float32, bfloat16 or float16; or an FP8 tuple `(lhs_fp8 [M, K]
        float8_e4m3fn, lhs_scales [M, K // 128] float32)` as `jax_ep.dispatch` and
        `jax_ep.quantize_fp8` produce (value = fp8 * scale per row and 128 columns).
      rhs: `[G, K, N]` in lhs's dtype; with an FP8 lhs, `Fp8Weights` from
        `jax_ep.quantize_fp8_weights`.
      group_sizes: `[G]` int32. Rows `[s_g, s_g + group_sizes[g])` of lhs belong to group g,
        `s_g` the sum of the earlier sizes; rows past the sum give zeros. Under `jit` the sizes
        stay on the device (no host sync): sizes summing past M are clipped to M and negative
        sizes count as 0. Concrete sizes (not traced) that are negative or sum past M raise
        ValueError.
      preferred_element_type: output dtype; default lhs's dtype (bfloat16 for FP8).
        Accumulation is float32 in every case.
      backend: "auto" (CUDA kernels on GPUs, else the reference), "reference" or "cuda".

    Returns:
      `[M, N]`: row i of group g is `lhs[i] @ rhs[g]`.

    Differentiable in lhs and rhs (FP8 is forward-only: TypeError). The CUDA kernels serve
    16-bit and FP8 operands with K and N multiples of 8 (128 for FP8); other calls run on XLA's
    `ragged_dot` (`backend="cuda"` raises instead). Works under `jit`, `scan`, `remat`, CUDA
    graphs, and inside or outside `shard_map`. The contract in full:
    docs/API.md#grouped-gemms-the-experts.
    """
    _checks.backend_name(backend)
    rq, rs, K, N = _rhs_parts(rhs)
    G = rq.shape[0]
    if isinstance(lhs, (tuple, list)):
        lq, ls = _lhs_parts(lhs, "lhs", "[M, K]")
        if rs is None:
            raise TypeError("rhs: an FP8 lhs needs FP8 weights (jax_ep.quantize_fp8_weights)")
        if lq.shape[1] != K:
            raise ValueError(f"lhs: K={lq.shape[1]} does not match rhs's K={K}")
        sizes = _sizes("group_sizes", group_sizes, G, total=lq.shape[0])
        if preferred_element_type is not None and \
                jnp.dtype(preferred_element_type) != jnp.dtype(jnp.bfloat16):
            raise TypeError("preferred_element_type: FP8 products are bfloat16")
        M = lq.shape[0]
        small = _small_m(M, G)
        use_cuda = _cuda_ok(backend, lq.dtype, jnp.bfloat16, lambda: _unsupported(
            "contiguous", lq.dtype, False, G, M, K, N), "grouped_matmul")
        cfg = _Config(jnp.dtype(jnp.bfloat16), use_cuda, small_m=small)
        return _fp8_fwd_only(functools.partial(_fp8_core, cfg=cfg), lq, ls, rq, rs, sizes)
    if rs is not None:
        raise TypeError("rhs: FP8 weights need an FP8 lhs tuple (lhs_fp8, lhs_scales)")
    a, _ = _lhs_parts(lhs, "lhs", "[M, K]")
    if jnp.dtype(a.dtype) != jnp.dtype(rq.dtype):
        raise TypeError(f"rhs: dtype {_checks.dtype_name(rq.dtype)} differs from lhs's "
                        f"{_checks.dtype_name(a.dtype)}")
    if a.shape[1] != K:
        raise ValueError(f"lhs: K={a.shape[1]} does not match rhs [G, K, N] with K={K}")
    sizes = _sizes("group_sizes", group_sizes, G, total=a.shape[0])
    out_dtype = _out_dtype(preferred_element_type, a.dtype)
    a, rq, _ = _same_axes(a, rq)
    return _gmm_diff(a, rq, sizes, None, None, _float_config(a, rq, out_dtype, backend))


def _same_axes(lhs, rhs, acc=None):
    """(lhs, rhs, acc) varying along the same mesh axes inside shard_map (a no-op outside): a
    weight replicated along an axis its rows vary along (data parallelism over an EP group)
    then gets its cotangent summed along that axis by the cast's transpose, and the custom
    VJP's result types match its operands. acc (rhs's shape and dtype) holds this shard's
    partial sums, so it must already vary along those axes."""
    lhs, rhs = _ffi.varying([lhs, rhs])
    if acc is None:
        return lhs, rhs, acc
    if tuple(acc.shape) != tuple(rhs.shape) or jnp.dtype(acc.dtype) != jnp.dtype(rhs.dtype):
        raise ValueError(f"acc: {acc.dtype}{list(acc.shape)}, expected rhs's "
                         f"{rhs.dtype}{list(rhs.shape)}")
    if _ffi.varying_axes(acc) != _ffi.varying_axes(rhs):
        raise ValueError(f"acc: varies along {sorted(_ffi.varying_axes(acc), key=str)}, "
                         f"expected {sorted(_ffi.varying_axes(rhs), key=str)} (lhs's axes): "
                         "the partial sums of this shard's weight gradients")
    return lhs, rhs, acc


def _float_config(a, rq, out_dtype, backend):
    G, K, N = rq.shape
    M = a.shape[0]

    def shapes_ok():
        return (_unsupported("contiguous", a.dtype, True, G, M, K, N)
                or _unsupported("contiguous", a.dtype, False, G, M, N, K)
                or _unsupported("transposed", a.dtype, True, G, M, K, N))
    use_cuda = _cuda_ok(backend, a.dtype, out_dtype, shapes_ok, "grouped_matmul")
    return _Config(out_dtype, use_cuda, small_m=_small_m(M, G))


def matmul_accumulating_grad(lhs, rhs, sizes, acc, *, backend):
    """grouped_matmul(lhs, rhs, sizes) (lhs [M, K] and rhs [G, K, N] of one float dtype) whose
    rhs cotangent is `acc` + the product's own, made in acc's buffer on the CUDA backend (the
    weight gradient adds to its output, docs/ffi.md#jax_ep_grouped_gemm-local-no-communication):
    a loop that sums weight gradients over passes then holds one set of them. acc: [G, K, N]
    in rhs's dtype; it gets no cotangent."""
    sizes = _sizes("group_sizes", sizes, rhs.shape[0], total=lhs.shape[0])
    cfg = _float_config(lhs, rhs, jnp.dtype(lhs.dtype), backend)
    lhs, rhs, acc = _same_axes(lhs, rhs, acc)
    return _gmm_diff(lhs, rhs, sizes, None, acc, cfg)


def padded_segments_matmul(lhs, rhs, sizes, counts, acc=None):
    """grouped_matmul(lhs, rhs, sizes) on the CUDA backend (16-bit lhs [M, K], rhs [G, K, N])
    for segments whose rows past counts[g] are zero padding (an aligned expert-major layout):
    its weight gradient reduces over the first counts[g] rows of each segment only. acc: None,
    or [G, K, N] in rhs's dtype that the weight gradient is added to in place (as
    `matmul_accumulating_grad`)."""
    small = _small_m(lhs.shape[0], rhs.shape[0])
    lhs, rhs, acc = _same_axes(lhs, rhs, acc)
    return _gmm_diff(lhs, rhs, sizes, counts, acc,
                     _Config(jnp.dtype(lhs.dtype), True, small_m=small))


def padded_segments_weight_grad(lhs, g, sizes, counts, acc=None):
    """The weight gradient of `padded_segments_matmul(lhs, rhs, sizes, counts, acc)` alone, for
    the cotangent g [M, N] of its output (what a backward needs when another kernel computes
    the gradient in lhs): [G, K, N] in lhs's dtype, acc plus it in acc's buffer when given."""
    lhs, g = _ffi.varying([lhs, g.astype(lhs.dtype)])
    return _weight_grad(lhs, g, sizes, counts, acc, lhs.dtype)
