"""What both backends share: the EP axis, byte views, id clean-up, the FP8 format, and the
low-latency combine's backward (pure JAX on both backends).

The CUDA path and the reference backend (`reference.py`, the spec) both stand on this module;
it depends on neither.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8_MAX = 448.0
FP8_GROUP = 128
AMAX_MIN = 1e-4


def axis_info(axis_name):
    """(R, r) of the EP axis; a ValueError naming the axis when it is not bound."""
    try:
        size = lax.axis_size(axis_name)
        rank = lax.axis_index(axis_name)
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the enclosing shard_map / mesh; jax_ep "
            "ops run per shard inside jax.shard_map over the EP axis") from e
    return int(size), rank


def sanitize(topk_idx, num_experts):
    """Ids outside [-1, E) act as -1; returns (clean int32 ids, count of such ids)."""
    idx = topk_idx.astype(jnp.int32)
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(bad, -1, idx), jnp.sum(bad).astype(jnp.int32)


def as_bytes(a):
    """View any array as uint8 with the element bytes in a trailing axis (exact transport)."""
    if a.dtype == jnp.uint8:
        return a[..., None]
    # The byte count spelled out: reshape(..., -1) cannot infer it for an empty array (T = 0).
    return lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape, jnp.dtype(a.dtype).itemsize)


def from_bytes(b, dtype):
    """The inverse of `as_bytes`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return b[..., 0]
    return lax.bitcast_convert_type(b, dtype) if dtype.itemsize > 1 else \
        lax.bitcast_convert_type(b[..., 0], dtype)


def a2a(x, axis_name):
    """[R, ...] -> [R, ...]: block q goes to rank q; block s of the result came from rank s."""
    # Under vmap over axis_name (the one-GPU multi-rank mode), all_to_all of a value that is
    # the same on every rank (unbatched, e.g. a cotangent of ones) returns a wrong shape
    # (JAX 0.10): make it per rank first. In shard_map, XLA folds the select away.
    x = jnp.where(lax.axis_index(axis_name) >= 0, x, x)
    return lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def order_by_key(key, bound):
    """The stable argsort (int32) of `key` >= 0 where the values from `bound` up are alike
    (their order among themselves is not kept): sorted on the narrowest unsigned type that
    holds bound, so that XLA's radix sort on the GPU makes one pass per byte of it instead of
    four."""
    dtype = jnp.uint8 if bound <= 0xFF else jnp.uint16 if bound <= 0xFFFF else jnp.uint32
    return jnp.argsort(jnp.minimum(key, bound).astype(dtype), stable=True).astype(jnp.int32)


def inclusive_count(v, block=128):
    """jnp.cumsum of an int32 or bool vector [n] as masked sums over blocks of `block` (int32):
    XLA makes row reductions of them, where its cumsum of a few thousand elements took tens of
    microseconds on a GPU. Work n * block, then the same over the blocks' totals: meant for
    vectors of a rank's tokens, not for millions of elements."""
    if block < 2:
        raise ValueError(f"block={block}: expected at least 2 (the blocks' totals recurse)")
    n = v.shape[0]
    v = v.astype(jnp.int32)
    if n <= block:
        lower = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]           # [i, j]: j <= i
        return jnp.sum(jnp.where(lower, v[None, :], 0), axis=1, dtype=jnp.int32)
    nb = -(-n // block)
    blocks = jnp.pad(v, (0, nb * block - n)).reshape(nb, block)
    lower = jnp.arange(block)[:, None] >= jnp.arange(block)[None, :]
    within = jnp.sum(jnp.where(lower[None], blocks[:, None, :], 0), axis=2, dtype=jnp.int32)
    before = inclusive_count(within[:, -1], block) - within[:, -1]          # [nb] exclusive
    return (within + before[:, None]).reshape(nb * block)[:n]


def first_occurrence(idx):
    """[T, K] bool: slot k is valid and no earlier slot of the token names the same expert."""
    K = idx.shape[1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)                     # [k, k'] k' < k
    dup = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier[None], axis=2)
    return (idx >= 0) & ~dup


# ----------------------------------------------------------------------------------------------
# FP8 (e4m3, per 128-column group)
# ----------------------------------------------------------------------------------------------

def round_up_pow2(scale):
    """Smallest power of two >= scale (positive, finite), exactly, on the float32 bits."""
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(exp << 23, jnp.float32)


def quantize_fp8(x: jax.Array, round_scale: bool = False) -> tuple[jax.Array, jax.Array]:
    """Quantise to FP8 e4m3 with one float32 scale per row and 128 columns (DeepEP's format).

    Args:
      x: `[..., H]` float32, bfloat16 or float16, H a multiple of 128.
      round_scale: round each scale up to a power of two.

    Returns:
      `(q, scales)`: `q` `[..., H]` float8_e4m3fn and `scales` `[..., H // 128]` float32 with
      `x ~ q * scale` per group of 128 columns; scale = amax / 448 of the group (amax at least
      1e-4). A group holding a NaN or an infinity gets scale NaN and NaN values.
      `dequantize_fp8(q, scales)` undoes it; the FP8 `dispatch` inputs take this pair.
    """
    *lead, H = x.shape
    g = x.astype(jnp.float32).reshape(*lead, H // FP8_GROUP, FP8_GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    # A NaN or an infinity in a group: scale NaN and every value NaN, so the group dequantises
    # to NaN (a non-finite value never turns into finite numbers).
    bad = ~jnp.isfinite(amax)
    amax = jnp.maximum(jnp.where(bad, 1.0, amax), AMAX_MIN)
    # base = amax * float32(1/448), written as the multiplication it is (docs/ffi.md): XLA
    # rewrites a division by a constant into this form anyway, and the kernel does the same.
    base = amax * jnp.float32(1.0 / FP8_MAX)
    if round_scale:
        scale = round_up_pow2(base)
        inv = 1.0 / scale
    else:
        scale = base
        inv = FP8_MAX / amax
    q = to_e4m3_rne(jnp.clip(g * inv[..., None], -FP8_MAX, FP8_MAX))
    q = jnp.where(bad[..., None], lax.bitcast_convert_type(jnp.uint8(0x7F), jnp.float8_e4m3fn), q)
    return q.reshape(*lead, H), jnp.where(bad, jnp.float32(jnp.nan), scale)


def to_e4m3_rne(v):
    """float32 in [-448, 448] -> float8_e4m3fn, round to nearest even, on the bits.

    Spelled out because XLA's own f32 -> e4m3 conversion is not the same everywhere (some
    lowerings round through float16 first: double rounding); this is what the kernels compute.
    """
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    sign = (bits >> 24) & 0x80
    a = jnp.abs(v.astype(jnp.float32))
    # subnormals (and 0): multiples of 2^-9; code = round_half_even(a * 2^9) (8 = 2^-6, normal)
    sub = jnp.round(a * 512.0).astype(jnp.uint32)
    # normals: keep 3 of the 23 mantissa bits, round half to even, re-bias the exponent 127 -> 7
    m = lax.bitcast_convert_type(a, jnp.uint32)
    rounded = (m + 0x7FFFF + ((m >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    code = jnp.where(a < 2.0 ** -6, sub, normal) | sign
    return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e4m3fn)


def dequantize_fp8(q: jax.Array, scales: jax.Array) -> jax.Array:
    """The float32 values of an FP8 pair from `quantize_fp8` (or an FP8 dispatch's `recv_x`).

    Args:
      q: `[..., H]` float8_e4m3fn, H a multiple of 128.
      scales: `[..., H // 128]` float32, one per row and group of 128 columns of `q`.

    Returns:
      `[..., H]` float32: `q * scales`, each scale applied to its 128 columns. Rows that an
      op left unspecified (e.g. past a low-latency dispatch's `recv_count`) stay unspecified.
    """
    *lead, H = q.shape
    g = q.astype(jnp.float32).reshape(*lead, H // FP8_GROUP, FP8_GROUP)
    return (g * scales[..., None]).reshape(*lead, H)


# ----------------------------------------------------------------------------------------------
# The low-latency combine's backward (both backends)
# ----------------------------------------------------------------------------------------------

def ll_src_to_row(recv_src, num_ranks):
    """[R, M, L]: the row of (source s, token t) in local expert l, or -1 (from recv_src)."""
    L, RM = recv_src.shape
    rows = jnp.broadcast_to(jnp.arange(RM, dtype=jnp.int32)[None], (L, RM))
    target = jnp.where(recv_src >= 0, recv_src, RM)                             # RM: dropped
    s2r = jnp.full((L, RM), -1, jnp.int32).at[jnp.arange(L)[:, None], target].set(
        rows, mode="drop")
    return s2r.T.reshape(num_ranks, RM // num_ranks, L)


def ll_combine_vjp(y, topk_weights, topk_idx, recv_src, g, *, num_experts, axis_name):
    """The VJP of ll_combine in y and topk_weights, given the cotangent g [T, H] of its output:
    (dy [L, R*M, H] in y's dtype, dw [T, K] in topk_weights' dtype). Both backends use it."""
    w, idx = topk_weights, topk_idx
    R, _ = axis_info(axis_name)
    src_to_row = ll_src_to_row(recv_src, R)
    _, M, L = src_to_row.shape
    T, K = idx.shape
    clean, _ = sanitize(idx, num_experts)
    valid = clean >= 0
    g = jnp.pad(g.astype(jnp.float32), ((0, M - T), (0, 0)))                   # [M, H]
    # per (rank q, token t, local expert l): summed weight of the slots naming that expert
    onehot = (clean[:, :, None] == jnp.arange(R * L)[None, None, :]) & valid[:, :, None]
    wsum = jnp.einsum("tk,tke->te", jnp.where(valid, w, 0.0).astype(jnp.float32),
                      onehot.astype(jnp.float32))
    wsum = jnp.pad(wsum, ((0, M - T), (0, 0))).reshape(M, R, L).transpose(1, 0, 2)  # [R, M, L]
    sent = src_to_row >= 0                                                      # [R(s), M, L]
    got_w = a2a(wsum, axis_name)                                               # [R(s), M, L]
    got_g = a2a(jnp.broadcast_to(g[None], (R,) + g.shape), axis_name)          # [R(s), M, H]
    # dy[l, row] = wsum * g_src[t]
    rows = jnp.where(sent, src_to_row, R * M)
    coef = got_w[..., None] * got_g[:, :, None, :]                              # [R, M, L, H]
    dy = jnp.zeros(y.shape, jnp.float32)
    lidx = jnp.broadcast_to(jnp.arange(L)[None, None, :], sent.shape)
    dy = dy.at[lidx, rows].add(jnp.where(sent[..., None], coef, 0.0), mode="drop")
    # dw[t, k] = <g[t], y_q[l][row(t, k)]>
    yrows = y[jnp.arange(L)[None, None, :], jnp.where(sent, src_to_row, 0)].astype(jnp.float32)
    dots = jnp.where(sent, jnp.einsum("smlh,smh->sml", yrows, got_g), 0.0)      # [R(s), M, L]
    back = a2a(dots, axis_name)                                                # [R(q), M, L]
    q = jnp.where(valid, clean // L, 0)
    l = jnp.where(valid, clean % L, 0)
    dw = jnp.where(valid, back[q, jnp.arange(T)[:, None], l], 0.0)
    return dy.astype(y.dtype), dw.astype(w.dtype)


def swiglu(h):
    """silu(gate) * up of h = [gate | up] along the last axis, in float32."""
    I = h.shape[-1] // 2
    h = h.astype(jnp.float32)
    return jax.nn.silu(h[..., :I]) * h[..., I:]
