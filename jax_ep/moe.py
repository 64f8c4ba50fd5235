"""`moe_ffn`: a whole expert-parallel MoE feed-forward layer, per shard inside `shard_map`.

dispatch -> expert-major rows -> grouped GEMM (gate and up) -> silu(gate) * up -> grouped GEMM
(down) -> weighted sum per token -> combine. Each token crosses the links once per destination
rank; each (token, local expert) pair is computed once (no expert evaluates rows that are not
routed to it).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import _checks, _ffi, expert_layout as el, grouped_gemm, runtime
from jax_ep._common import axis_info, quantize_fp8, sanitize, swiglu
from jax_ep.fused import dispatch_matmul_swiglu, matmul_combine_plus, unwritten
from jax_ep.grouped_gemm_masked import grouped_matmul_masked
from jax_ep.high_throughput import combine, dispatch
from jax_ep.low_latency import low_latency_combine, low_latency_dispatch

MODES = ("high_throughput", "low_latency")


def _weights(name, w, L, shape_tail, fp8_ok):
    if isinstance(w, grouped_gemm.Fp8Weights):
        if not fp8_ok:
            raise TypeError(f"{name}: FP8 weights need use_fp8=True")
        return w
    _checks.expect_rank(name, w, 3, f"[L, {shape_tail}]")
    _checks.expect_dtype(name, w, _checks.FLOAT_DTYPES)
    if w.shape[0] != L:
        raise ValueError(f"{name}: has {w.shape[0]} experts, expected L = num_experts // R = {L}")
    return w


def moe_ffn(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array | None,
            w_gate_up: jax.Array | grouped_gemm.Fp8Weights, w_down: jax.Array, *,
            num_experts: int, axis_name: str = "ep", mode: str = "high_throughput",
            capacity: int | None = None, use_fp8: bool = False,
            max_tokens_per_rank: int | None = None, fused: bool | None = None,
            fused_copy_blocks: int = 0, fused_combine_blocks: int = 0,
            backend: str = "auto", check: bool | None = None) -> jax.Array:
    """One MoE feed-forward layer, per shard inside `jax.shard_map` over `axis_name`.

    `out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`, e the
    expert of slot k (slots of -1 contribute nothing), with this rank's experts applied here
    and the others on their ranks.

    Args:
      x: `[T, H]` float32 / bfloat16 / float16 (bfloat16 in low-latency mode).
      topk_idx: `[T, K]` int32 expert ids (-1: unused slot), e.g. from `jax_ep.routing`.
      topk_weights: `[T, K]` float32 / bfloat16 / float16 router weights; None in
        high-throughput mode: each (token, expert) pair weighs 1.
      w_gate_up: `[L, H, 2I]` this rank's experts' gate (first I columns) and up projections,
        L = num_experts // R; `Fp8Weights` of it with use_fp8.
      w_down: `[L, I, H]` the down projections (bfloat16 in FP8 mode).
      num_experts: E, a multiple of R.
      axis_name: the EP axis of the enclosing shard_map (R ranks on it).
      mode: "high_throughput" (training, prefill: `dispatch` / `combine`, `grouped_matmul`) or
        "low_latency" (decoding: `low_latency_dispatch` / `low_latency_combine`,
        `grouped_matmul_masked`; needs max_tokens_per_rank).
      capacity: high-throughput mode, the (token, expert) rows of one pass, at least R * T
        (static). Default `moe_capacity(T, ...)`: the expected load times 1.25. No pair is
        ever dropped: when a rank receives more pairs than a pass holds, the layer runs
        extra passes, each sending only the pairs it keeps, of a quarter of the expected
        load plus the fused alignment (capacity if smaller), in a while loop that costs
        nothing when the first pass held all; their backward runs their forward again.
        R * T * min(K, L) (plus the fused alignment) is the worst case: always one pass.
      use_fp8: dispatch FP8 activations into the FP8 GEMM of w_gate_up (an `Fp8Weights`);
        forward only.
      max_tokens_per_rank: low-latency mode, M of `low_latency_dispatch` (static, the same on
        every rank); default T, this shard's tokens (at least 1).
      fused: high-throughput mode, bfloat16: the dispatch and the first grouped GEMM in one
        launch, each expert tile starting as soon as its rows have arrived
        (docs/kernels.md#fused-gather-gemm; silu(gate) * up in its epilogue where 2I is a
        multiple of 256, docs/kernels.md#fused-activation), and the second grouped GEMM and
        the combine in another, each token summed as soon as its rows are computed
        (docs/kernels.md#fused-gemm-combine; per-process groups run this half unfused). Same
        results as fused=False up to float32 accumulation order and the activation's last
        bit (fast exponential and division); the backward runs the same kernels with the
        weights transposed (docs/kernels.md#fused-backward). Expert segments start at
        multiples of 128 rows (the default capacity adds L * 127 rows for it). None
        (default): fused wherever it applies (high-throughput mode, x bfloat16, no use_fp8),
        since its forward was the faster at R = 1, 2 and 4 and its forward + backward within
        1 % (docs/API.md#the-moe-layer). True in low-latency mode or with use_fp8 raises
        ValueError; on the CUDA backend, with x not bfloat16, TypeError (the reference
        backend runs its unfused ops for it in any float dtype).
      fused_copy_blocks: with fused=True, how many of the first launch's blocks (one per SM)
        pull rows before they join the others on the tiles; 0: automatic (an eighth of the
        SMs).
      fused_combine_blocks: with fused=True, how many of the second launch's blocks only
        combine (the others compute tiles, then combine); 0: automatic (an eighth of the SMs
        over several ranks; at R = 1 as many as keep pace with the GEMM, 8 of 132 at I = 2048).
      backend: "auto", "reference" or "cuda" for every op of the layer.
      check: True raises `jax_ep.CheckError` (through `jax_ep.checked`) when topk_idx holds
        ids outside [-1, E), which act as -1; default: the JAX_EP_CHECK setting. The layer
        itself never drops a token.

    Returns:
      `[T, H]` in x's dtype. Differentiable in x, topk_weights, w_gate_up and w_down (not with
      use_fp8). When a wait of the layer's communication gave up (a peer stopped for
      `JAX_EP_TIMEOUT_S`), the output is NaN on that rank, never plausible numbers: run the
      step as `jax_ep.checked(step)` to get `jax_ep.PeerTimeoutError` there instead
      (docs/API.md#timeouts).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    check = _checks.flag("check", check, allow_none=True)
    out = _moe_ffn(x, topk_idx, topk_weights, w_gate_up, w_down, num_experts=num_experts,
                   axis_name=axis_name, mode=mode, capacity=capacity, use_fp8=use_fp8,
                   max_tokens_per_rank=max_tokens_per_rank, fused=fused,
                   fused_copy_blocks=fused_copy_blocks, fused_combine_blocks=fused_combine_blocks,
                   backend=backend)
    if not runtime.check_enabled(check):
        return out
    E = num_experts
    invalid = jnp.sum((topk_idx < -1) | (topk_idx >= E)).astype(jnp.int32)

    def message(v, t):
        return (f"jax_ep.moe_ffn(check=True): {v[0]} expert ids of topk_idx outside [-1, "
                f"E={E}) on this rank ({t[0]} over all shards); they act as -1")
    return _checks.checked_result(out, "moe_ffn", {"num_invalid": invalid}, axis_name, message)


def _moe_ffn(x, topk_idx, topk_weights, w_gate_up, w_down, *, num_experts, axis_name, mode,
             capacity, use_fp8, max_tokens_per_rank, fused, fused_copy_blocks,
             fused_combine_blocks, backend):
    use_fp8 = _checks.flag("use_fp8", use_fp8)
    fused = _checks.flag("fused", fused, allow_none=True)
    fused_copy_blocks = _checks.static_int("fused_copy_blocks", fused_copy_blocks, 0)
    fused_combine_blocks = _checks.static_int("fused_combine_blocks", fused_combine_blocks, 0)
    if fused and (mode != "high_throughput" or use_fp8):
        raise ValueError("fused=True: the fused dispatch + grouped GEMM is high-throughput mode "
                         "in bfloat16 (use_fp8=False)")
    _checks.expect_rank("x", x, 2, "[T, H]")
    _checks.expect_dtype("x", x, _checks.FLOAT_DTYPES)
    if mode == "low_latency" and jnp.dtype(x.dtype) != jnp.bfloat16:
        raise TypeError(f"x: dtype {jnp.dtype(x.dtype).name}; mode='low_latency' takes bfloat16 "
                        "(x, w_gate_up and w_down)")
    T, H = x.shape
    R, _ = axis_info(axis_name)
    L = _checks.experts_per_rank(num_experts, R)
    w_gate_up = _weights("w_gate_up", w_gate_up, L, "H, 2I", use_fp8)
    _weights("w_down", w_down, L, "I, H", False)
    if isinstance(w_gate_up, grouped_gemm.Fp8Weights):
        gu_shape = (L, w_gate_up.data.shape[2], w_gate_up.data.shape[1])
    else:
        gu_shape = tuple(w_gate_up.shape)
    if use_fp8 and not isinstance(w_gate_up, grouped_gemm.Fp8Weights):
        raise TypeError("w_gate_up: use_fp8=True takes FP8 weights "
                        "(jax_ep.quantize_fp8_weights(w_gate_up))")
    if gu_shape[1] != H or gu_shape[2] % 2:
        raise ValueError(f"w_gate_up: shape {gu_shape}, expected [L, H={H}, 2I]")
    I = gu_shape[2] // 2
    if fused is None:  # the default: fused wherever it applies
        fused = (mode == "high_throughput" and not use_fp8 and I > 0
                 and jnp.dtype(x.dtype) == jnp.bfloat16)
    if fused and I == 0:
        raise ValueError(f"w_gate_up: shape {gu_shape}; fused=True needs 2I > 0")
    if tuple(w_down.shape[1:]) != (I, H):
        raise ValueError(f"w_down: shape {tuple(w_down.shape)}, expected [L, I={I}, H={H}]")
    want = jnp.dtype(jnp.bfloat16) if use_fp8 or mode == "low_latency" else jnp.dtype(x.dtype)
    for name, w in (("w_gate_up", None if use_fp8 else w_gate_up), ("w_down", w_down)):
        if w is not None and jnp.dtype(w.dtype) != want:
            raise TypeError(f"{name}: dtype {jnp.dtype(w.dtype).name}, expected {want.name} "
                            "(x's dtype; bfloat16 in low-latency and FP8 modes)")
    if mode == "low_latency":
        if topk_weights is None:
            raise ValueError("topk_weights: None (each pair weighing 1) is a high-throughput "
                             "setting; mode='low_latency' takes [T, K] weights")
        M = max(T, 1) if max_tokens_per_rank is None else max_tokens_per_rank
        return _moe_low_latency(x, topk_idx, topk_weights, w_gate_up, w_down, num_experts,
                                axis_name, use_fp8, M, backend)
    if max_tokens_per_rank is not None:
        raise ValueError("max_tokens_per_rank is a low-latency setting (mode='low_latency')")
    return _moe_high_throughput(x, topk_idx, topk_weights, w_gate_up, w_down,
                                num_experts=num_experts, axis_name=axis_name, capacity=capacity,
                                use_fp8=use_fp8, fused=fused, copy_blocks=fused_copy_blocks,
                                combine_blocks=fused_combine_blocks, backend=backend)


def _ht_pass(x, topk_idx, topk_weights, w_gate_up, w_down, grad_acc=None, *, num_experts,
             axis_name, capacity, use_fp8, fused, copy_blocks, combine_blocks, backend,
             addend=None):
    """One expert-major dispatch of `capacity` rows, the experts, and the combine: [T, H].
    grad_acc (the backward of an extra pass): None, or (acc_gate_up, acc_down) that the weights'
    cotangents are added to in place. addend (fused): None, or addend(a) = (add, on), added
    to the output where on by the GEMM + combine (`plus_addend`), a the first half's output."""
    acc_gu, acc_d = (None, None) if grad_acc is None else grad_acc
    if fused:
        res, a = dispatch_matmul_swiglu(x, topk_idx, topk_weights, w_gate_up,
                                        num_experts=num_experts, axis_name=axis_name,
                                        capacity=capacity, backend=backend,
                                        copy_blocks=copy_blocks, weight_grad_acc=acc_gu)
        return matmul_combine_plus(a, w_down, res, None if addend is None else addend(a),
                                   axis_name=axis_name, backend=backend,
                                   combine_blocks=combine_blocks, weight_grad_acc=acc_d)
    xin = quantize_fp8(x) if use_fp8 else x
    res = dispatch(xin, topk_idx, topk_weights, num_experts=num_experts, axis_name=axis_name,
                   capacity=capacity, layout="expert", backend=backend)
    if grad_acc is None:
        gm_gu = gm_d = functools.partial(grouped_gemm.grouped_matmul, backend=backend)
    else:
        gm_gu, gm_d = (functools.partial(grouped_gemm.matmul_accumulating_grad, acc=acc,
                                         backend=backend) for acc in grad_acc)
    h = gm_gu(res.recv_x, w_gate_up, res.expert_sizes)
    a = swiglu(h).astype(w_down.dtype)
    y = gm_d(a, w_down, res.expert_sizes)
    # combine weights each (token, expert) row and sums per token
    return combine(y.astype(x.dtype), res.handle, axis_name=axis_name, backend=backend)


def _moe_high_throughput(x, topk_idx, topk_weights, w_gate_up, w_down, *, num_experts,
                         axis_name, capacity, backend, **settings):
    """The layer in passes of expert-major rows (docs/design.md#layer-capacity): the first, of
    `capacity` rows, always runs; the others (`_extra_capacity` rows), in a while loop, only
    when a rank received more pairs than earlier passes held, so that nothing is dropped."""
    T = x.shape[0]
    _checks.topk("topk_idx", topk_idx, T)
    K = topk_idx.shape[1]
    R, _ = axis_info(axis_name)
    L = num_experts // R
    be = _checks.resolve_backend(backend, empty=T == 0)
    A = _alignment(settings["fused"], be)
    floor = R * T
    if capacity is None:
        capacity = moe_capacity(T, num_experts=num_experts, num_topk=K, num_ranks=R,
                                fused=settings["fused"], backend=be)
    capacity = _checks.static_int("capacity", capacity, 1)
    if capacity < floor:
        raise ValueError(f"capacity={capacity}: moe_ffn receives every token whole, so a pass "
                         f"needs at least R * T = {floor} rows")
    # the extra passes (run only when a rank received more pairs than the first held) each
    # send only the pairs they keep, so they need not hold every token: their buffers, which
    # XLA plans beside the weights' gradients whether the loop runs or not, follow the
    # expected load, not R * T (docs/design.md#layer-capacity)
    extra = _extra_capacity(T, K, num_experts, L, A, capacity)
    passes = el.passes_needed(T, num_ranks=R, num_local_experts=L, num_topk=K,
                              capacity=capacity, alignment=A, extra_capacity=extra)
    # The weights varying along every mesh axis x does (a no-op outside shard_map): replicated
    # over data parallelism, each shard's weight gradients are its partial sums (the extra
    # passes add to them in place), summed over the replicas once, by this cast's transpose.
    leaves, tree = jax.tree.flatten((w_gate_up, w_down))
    w_gate_up, w_down = jax.tree.unflatten(tree, _ffi.varying([x, *leaves])[1:])
    one, more = (functools.partial(_ht_pass, num_experts=num_experts, axis_name=axis_name,
                                   capacity=c, backend=backend, **settings)
                 for c in (capacity, extra))
    if passes == 1:
        return one(x, topk_idx, topk_weights, w_gate_up, w_down)
    idx, _ = sanitize(_checks.int32_ids(topk_idx, num_experts), num_experts)
    # the first pass sends every pair (its ids are idx); what it keeps follows from the pair
    # counts, and what each later pass keeps (no sort) is found inside the loop, only if it runs
    cnt = el.pair_counts(idx, num_experts=num_experts, axis_name=axis_name)
    kept = el.pass_keeps(cnt, jnp.zeros_like(cnt), capacity=capacity, alignment=A,
                         num_local_experts=L)
    plan = functools.partial(el.pass_keeps, capacity=extra, alignment=A, num_local_experts=L)
    ids_of = functools.partial(el.pass_slots, num_experts=num_experts, axis_name=axis_name)
    # fused: the passes after the first run before its GEMM + combine, which adds their sum
    # (docs/design.md#layer-passes-early); unfused, after the first pass
    early = settings["fused"]
    return _in_passes(one, more, _Passes(plan, ids_of, early, be == "cuda"), x, topk_weights,
                      w_gate_up, w_down, idx, cnt, kept)


class _Passes(NamedTuple):
    """How the passes after the first are found and where they run."""
    plan: Callable     # plan(cnt, done): what the passes so far and the next keep
    ids_of: Callable   # ids_of(idx, done, upto): the next pass's ids
    early: bool        # their sum goes into the first pass's last kernel (`_early_sum`)
    unwritten: bool    # the CUDA backend: that sum's first value is written by no kernel


def _extra_capacity(T, K, E, L, A, capacity):
    """The expert-major rows of each pass after the first: a quarter of a rank's expected pairs
    (T * min(K, E) / 4, rounded up to 8, at least 1) plus the alignment padding of the L
    segments, at most `capacity`. A pass sends only the pairs it keeps, so it needs no rows
    for every token; a routing that overflows by more takes more passes."""
    quarter = -(-T * min(K, E) // 4)
    rows = max(1, -(-quarter // 8) * 8)
    return min(capacity, rows + L * (A - 1))


def _more_passes(passes, idx, cnt, kept, body, init):
    """body(ids, carry) for each pass after the first while a pair is left (pair counts cnt
    [R, E], the first pass kept `kept`), in a while loop: nothing runs (one predicate) when the
    first pass kept every pair. passes: a `_Passes`."""
    def step(c):
        done, carry = c
        upto = passes.plan(cnt, done)
        return upto, body(passes.ids_of(idx, done, upto), carry)
    return lax.while_loop(lambda c: jnp.any(cnt > c[0]), step, (kept, init))[1]


def _sum_if_left(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first, start):
    """(value, on): on, whether a pair is left after the first pass; value, in x's dtype, is
    `first` when none is, else start(first) (float32) plus the passes after the first pass,
    summed in float32 and rounded once: a loop of at most one iteration, so that nothing runs
    over `first` when none is left (docs/design.md#layer-passes-sum)."""
    on = jnp.any(cnt > kept)

    def rest(c):
        acc = _more_passes(passes, idx, cnt, kept,
                           lambda ids, acc: acc + more(x, ids, w, w_gate_up,
                                                       w_down).astype(jnp.float32),
                           start(c[0]))
        return acc.astype(x.dtype), jnp.zeros_like(c[1])
    return lax.while_loop(lambda c: c[1], rest, (first, on))[0], on


def _early_sum(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, like):
    """(add, on): on, whether a pair is left after the first pass; add [T, H] in x's dtype, the
    sum of the passes after it (in float32, rounded once) when on, else undefined (no fill
    runs when none is left). The first pass's GEMM + combine adds it to its output where on,
    in add's buffer, reading it only then. XLA reads the loop's predicate on the host, which
    drains the stream; here that read comes before a long kernel, the first pass's second
    half, not at the end of the layer, where the host would then launch the next short kernels
    one by one to an idle GPU (docs/design.md#layer-passes-early). like: an output of the
    first pass's first half, which add's buffer follows, so that XLA does not hold it through
    that half."""
    first = unwritten(like, x.shape, x.dtype) if passes.unwritten else jnp.zeros_like(x)
    return _sum_if_left(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first,
                        lambda _: jnp.zeros_like(x, jnp.float32))


def _forward_rest(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first):
    """The first pass's output `first` plus the passes after it, in float32, in x's dtype:
    when no pair is left, `first` goes through in place, with no pass over it to float32 and
    back (`_sum_if_left`)."""
    return _sum_if_left(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first,
                        lambda f: f.astype(jnp.float32))[0]


def _forward(one, more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first_pass):
    """The layer's output in passes: first_pass(addend) runs one(x, idx, ..., addend=addend),
    and the passes after it are summed in float32 between its two halves
    (`_early_sum`, passes.early) or after it (`_forward_rest`)."""
    if passes.early:
        # between the first pass's halves, no gradient through it (the backward runs the
        # passes again): `_early_sum`
        sg = lax.stop_gradient
        return first_pass(lambda like: _early_sum(more, passes, sg(x), sg(w), sg(w_gate_up),
                                                  sg(w_down), idx, cnt, kept, sg(like)))
    return _forward_rest(more, passes, x, w, w_gate_up, w_down, idx, cnt, kept,
                         first_pass(None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _in_passes(one, more, passes, x, w, w_gate_up, w_down, idx, cnt, kept):
    """one(x, idx, ...) plus, over the passes after it (`_more_passes`), more(x, the pass's
    ids, ...): [T, H] in x's dtype, the passes after the first summed in float32."""
    return _forward(one, more, passes, x, w, w_gate_up, w_down, idx, cnt, kept,
                    lambda addend: one(x, idx, w, w_gate_up, w_down, addend=addend))


def _in_passes_fwd(one, more, passes, x, w, w_gate_up, w_down, idx, cnt, kept):
    # The first pass keeps its residuals (the layer's usual backward, remat policy included);
    # the others keep none: the backward runs each again (its communication too) and adds its
    # gradients, the weights' in place (else XLA plans the loop a second set of weight
    # gradients, even when it runs none). FP8 passes have no backward.
    vjps = []

    def first_pass(addend):
        out, vjp = jax.vjp(lambda *a: one(a[0], idx, *a[1:], addend=addend), x, w, w_gate_up,
                           w_down)
        vjps.append(vjp)
        return out
    out = _forward(one, more, passes, x, w, w_gate_up, w_down, idx, cnt, kept, first_pass)
    vjp = vjps[0]
    if passes.early:
        # The backward reads the residuals only once the output is made: a cotangent that does
        # not depend on it (sum(out)'s, a constant) would let XLA run the backward's first
        # kernels between the loop and the first pass's GEMM + combine, holding the loop's sum
        # through them (docs/design.md#layer-passes-early).
        leaves, tree = jax.tree.flatten(vjp)
        leaves, out = lax.optimization_barrier((leaves, out))
        vjp = jax.tree.unflatten(tree, leaves)
    return out, (vjp, x, w, w_gate_up, w_down, idx, cnt, kept)


def _in_passes_bwd(one, more, passes, res, g):
    vjp, x, w, w_gate_up, w_down, idx, cnt, kept = res

    def add(ids, grads):
        dx, dw, dgu, dd = grads
        # the pass's weight gradients come back as the running sum plus its own
        _, vjp_p = jax.vjp(lambda *a: more(a[0], ids, *a[1:], grad_acc=(dgu, dd)), x, w,
                           w_gate_up, w_down)
        px, pw, pgu, pd = vjp_p(g)
        return dx + px, dw + pw, pgu, pd
    return tuple(_more_passes(passes, idx, cnt, kept, add, vjp(g))) + (None, None, None)


_in_passes.defvjp(_in_passes_fwd, _in_passes_bwd)


def _alignment(fused, backend):
    """Rows every expert segment starts at a multiple of, for the layer's path."""
    return runtime.extension().fused_block_rows if fused and backend == "cuda" else 1


def moe_capacity(tokens_per_rank: int, *, num_experts: int, num_topk: int, num_ranks: int,
                 capacity_factor: float = 1.25, fused: bool | None = None,
                 backend: str = "auto") -> int:
    """The expert-major rows of one pass of `moe_ffn` (its `capacity`) from the expected load.

    A rank receives T * min(K, E) (token, local expert) pairs on average when the
    `num_ranks * tokens_per_rank` tokens pick their `num_topk` experts uniformly; this is that
    times `capacity_factor`, rounded up to a multiple of 8, at least R * T (every token reaches
    a rank whole), plus the alignment padding of the L segments (fused=True on the CUDA
    backend: `jax_ep._C.fused_block_rows` - 1 each), at most the worst case R * T * min(K, L)
    plus that padding, and at least 1. moe_ffn never drops a pair: a pass that cannot hold
    every pair of a rank is followed by another (more time), so the factor trades memory for
    how often skewed routing needs a second pass.

    Args:
      tokens_per_rank: T, the tokens of each shard.
      num_experts: E, a multiple of num_ranks.
      num_topk: K, the top-k slots of each token.
      num_ranks: R, the ranks of the EP axis.
      capacity_factor: the rows of a pass over the expected pairs (a finite number above 0).
      fused: the capacity of `moe_ffn(fused=True)` (its segments' alignment); None (default):
        of moe_ffn's default, which is fused in bfloat16 (for another dtype the alignment
        rows are then unused; pass fused=False there).
      backend: the layer's backend ("auto", "reference" or "cuda"): the alignment is the
        CUDA kernels'.

    Returns:
      The `capacity` argument of `moe_ffn` (a Python int).
    """
    T = _checks.static_int("tokens_per_rank", tokens_per_rank, 0)
    R = _checks.static_int("num_ranks", num_ranks, 1)
    E = _checks.static_int("num_experts", num_experts, 1)
    K = _checks.static_int("num_topk", num_topk, 1)
    f = _checks.capacity_factor(capacity_factor)
    L = _checks.experts_per_rank(E, R)
    fused = _checks.flag("fused", fused, allow_none=True)
    A = _alignment(fused is None or fused, _checks.resolve_backend(backend, empty=T == 0))
    rows = -(-math.ceil(T * min(K, E) * f) // 8) * 8
    return int(max(1, min(max(rows, R * T), R * T * min(K, L)) + L * (A - 1)))


def _moe_low_latency(x, topk_idx, topk_weights, w_gate_up, w_down, num_experts, axis_name,
                     use_fp8, max_tokens_per_rank, backend):
    res = low_latency_dispatch(x, topk_idx, num_experts=num_experts,
                               max_tokens_per_rank=max_tokens_per_rank, axis_name=axis_name,
                               use_fp8=use_fp8, backend=backend)
    h = grouped_matmul_masked(res.recv_x, w_gate_up, res.recv_count,
                                           zero_padding=False, backend=backend)
    a = swiglu(h).astype(w_down.dtype)
    # rows past the counts are never read by the combine: neither GEMM writes zeros there
    y = grouped_matmul_masked(a, w_down, res.recv_count, zero_padding=False,
                                           backend=backend)
    return low_latency_combine(y.astype(jnp.bfloat16), topk_idx, topk_weights, res.handle,
                               axis_name=axis_name, backend=backend)
