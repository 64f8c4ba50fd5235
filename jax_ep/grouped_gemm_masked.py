"""`grouped_matmul_masked`: grouped GEMMs on the low-latency receive layout `[G, C, K]`, each
group's first `counts[g]` rows used (the CUDA kernels and the reference, with custom VJPs).
The contiguous layout and FP8 weights are in `grouped_gemm`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep import _checks
from jax_ep.grouped_gemm import (Fp8Weights, _Config, _cuda_ok, _dequantized, _lhs_parts,
                                 _no_fp8_grad, _out_dtype, _ref_vjp, _rhs_parts, _sizes,
                                 _unsupported, gemm_call)

_fp8_masked_fwd_only = _no_fp8_grad("grouped_matmul_masked")


def _ref_masked(lhs, rhs, counts, out_dtype):
    C = lhs.shape[1]
    keep = (jnp.arange(C)[None, :] < counts[:, None])[..., None]
    # Rows past the counts are masked on the way in too: their content is unspecified (a
    # low-latency receive buffer), and a NaN there must not reach the products or d rhs.
    out = jnp.einsum("gck,gkn->gcn", jnp.where(keep, lhs, 0), rhs,
                     preferred_element_type=jnp.float32)
    return jnp.where(keep, out, 0).astype(out_dtype)


def _masked_core(lhs, rhs, counts, cfg):
    out_dtype, use_cuda, zero_padding = cfg.out_dtype, cfg.use_cuda, cfg.zero_padding
    if not use_cuda:
        return _ref_masked(lhs, rhs, jnp.maximum(counts, 0), out_dtype)
    G, C, _ = lhs.shape
    return gemm_call(lhs, rhs, counts, None, None, mode="masked", rhs_kn=True, small_m=True,
                      out_shape=(G, C, rhs.shape[2]), out_dtype=out_dtype,
                      zero_padding=zero_padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _masked_diff(lhs, rhs, counts, cfg):
    return _masked_core(lhs, rhs, counts, cfg)


def _masked_fwd(lhs, rhs, counts, cfg):
    return _masked_core(lhs, rhs, counts, cfg), (lhs, rhs, counts)


def _masked_bwd(cfg, res, g):
    """The reference's gradient on every backend (the masked layout serves decoding)."""
    lhs, rhs, counts = res
    return _ref_vjp(lambda a, b: _ref_masked(a, b, jnp.maximum(counts, 0), jnp.float32),
                    lhs, rhs, g)


_masked_diff.defvjp(_masked_fwd, _masked_bwd)


def _fp8_masked_core(lq, ls, rq, rs, counts, cfg):
    use_cuda, zero_padding = cfg.use_cuda, cfg.zero_padding
    if not use_cuda:
        return _ref_masked(*_dequantized(lq, ls, rq, rs), jnp.maximum(counts, 0), jnp.bfloat16)
    G, C, _ = lq.shape
    return gemm_call(lq, rq, counts, ls, rs, mode="masked", rhs_kn=False, small_m=True,
                      out_shape=(G, C, rq.shape[1]), out_dtype=jnp.bfloat16,
                      zero_padding=zero_padding)


def grouped_matmul_masked(lhs: jax.Array | tuple[jax.Array, jax.Array],
                          rhs: jax.Array | Fp8Weights, counts: jax.Array, *,
                          preferred_element_type: jax.typing.DTypeLike | None = None,
                          zero_padding: bool = True, backend: str = "auto") -> jax.Array:
    """Per-group products in the low-latency receive layout (DeepGEMM's "masked" layout).

    Args:
      lhs: `[G, C, K]` (G groups of capacity C, e.g. `low_latency_dispatch`'s `recv_x`), or its
        FP8 tuple `(lhs_fp8 [G, C, K], lhs_scales [G, C, K // 128])`.
      rhs: `[G, K, N]` in lhs's dtype, or `Fp8Weights` with an FP8 lhs.
      counts: `[G]` int32, the valid rows of each group (clipped to [0, C] under `jit`;
        concrete counts outside [0, C] raise ValueError).
      preferred_element_type, backend: as for `grouped_matmul`.
      zero_padding: write zeros to the rows past each count (default). False leaves those rows
        unspecified (on the CUDA backend they keep whatever the buffer held; the reference
        still writes zeros): for consumers that read only the valid rows, such as
        `low_latency_combine`. It saves writing `(C - counts[g]) * N` values per group, which
        at decode sizes is a tenth of the call's memory traffic.

    Returns:
      `[G, C, N]`: `out[g, i] = lhs[g, i] @ rhs[g]` for `i < counts[g]`, zeros past it. The
      products cost work in proportion to the counts; the zero rows are written, not computed.

    The contract in full: docs/API.md#grouped-gemms-the-experts.
    """
    zero_padding = _checks.flag("zero_padding", zero_padding)
    _checks.backend_name(backend)
    rq, rs, K, N = _rhs_parts(rhs)
    G = rq.shape[0]
    if isinstance(lhs, (tuple, list)):
        lq, ls = _lhs_parts(lhs, "lhs", "[G, C, K]")
        if rs is None:
            raise TypeError("rhs: an FP8 lhs needs FP8 weights (jax_ep.quantize_fp8_weights)")
        if lq.shape[0] != G or lq.shape[2] != K:
            raise ValueError(f"lhs: shape {tuple(lq.shape)} does not match G={G}, K={K} of rhs")
        counts = _sizes("counts", counts, G, each=lq.shape[1])
        if preferred_element_type is not None and \
                jnp.dtype(preferred_element_type) != jnp.dtype(jnp.bfloat16):
            raise TypeError("preferred_element_type: FP8 products are bfloat16")
        C = lq.shape[1]
        # The masked kernels read rhs as [G, N, K] for FP8 (Fp8Weights' layout).
        use_cuda = _cuda_ok(backend, lq.dtype, jnp.bfloat16, lambda: _unsupported(
            "masked", lq.dtype, False, G, C, K, N), "grouped_matmul_masked")
        cfg = _Config(jnp.dtype(jnp.bfloat16), use_cuda, zero_padding=zero_padding)
        return _fp8_masked_fwd_only(functools.partial(_fp8_masked_core, cfg=cfg),
                                    lq, ls, rq, rs, counts)
    if rs is not None:
        raise TypeError("rhs: FP8 weights need an FP8 lhs tuple (lhs_fp8, lhs_scales)")
    a, _ = _lhs_parts(lhs, "lhs", "[G, C, K]")
    if jnp.dtype(a.dtype) != jnp.dtype(rq.dtype):
        raise TypeError(f"rhs: dtype {_checks.dtype_name(rq.dtype)} differs from lhs's "
                        f"{_checks.dtype_name(a.dtype)}")
    if a.shape[0] != G or a.shape[2] != K:
        raise ValueError(f"lhs: shape {tuple(a.shape)} does not match G={G}, K={K} of rhs")
    counts = _sizes("counts", counts, G, each=a.shape[1])
    out_dtype = _out_dtype(preferred_element_type, a.dtype)
    C = a.shape[1]
    use_cuda = _cuda_ok(backend, a.dtype, out_dtype,
                        lambda: _unsupported("masked", a.dtype, True, G, C, K, N),
                        "grouped_matmul_masked")
    return _masked_diff(a, rq, counts, _Config(out_dtype, use_cuda,
                                               zero_padding=zero_padding))
