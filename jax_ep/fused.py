"""The fused halves of `moe_ffn(fused=True)`: the dispatch and the first grouped GEMM in one
launch (`dispatch_matmul`), the second grouped GEMM and the combine in another
(`matmul_combine`). Each computes what the unfused ops compute (`dispatch(layout="expert")`
then `grouped_matmul`; `grouped_matmul` then `combine`). Their backward rules are the unfused
ops' rules, run by the same kernels with the weights read transposed: the second half's by
the gather + GEMM, the first half's (when nothing reads its expert-major rows) by the GEMM +
combine (docs/kernels.md#fused-backward).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import _checks, _ffi, config, expert_layout as el, grouped_gemm, remat, runtime
from jax_ep._common import axis_info, first_occurrence, swiglu
from jax_ep.high_throughput import (_Config, _combine_diff, _dispatch_diff, _gather_diff,
                                    _group_checks, _routing_checks, combine, dispatch,
                                    routing_one_rank)

# The fused backward: a cotangent JAX knows to be zero (an output nothing reads) comes as this.
_SymbolicZero = jax.custom_derivatives.SymbolicZero
_primal_values = jax.custom_derivatives.custom_vjp_primal_tree_values


def _fused_backward():
    """Whether the backward rules run on the fused kernels (JAX_EP_FUSED_BACKWARD, read when
    the backward is traced)."""
    return config.flag("JAX_EP_FUSED_BACKWARD")


def _unfused_matmul(a, w, sizes, acc, backend):
    """grouped_matmul(a, w, sizes), its weight gradient added to acc when acc is given."""
    if acc is None:
        return grouped_gemm.grouped_matmul(a, w, sizes, backend=backend)
    return grouped_gemm.matmul_accumulating_grad(a, w, sizes, acc, backend=backend)


# ---------------------------------------------------------------------------------------------
# Fused dispatch + first grouped GEMM (moe_ffn(fused=True), docs/kernels.md#fused-gather-gemm):
# the routing moves no rows (a rank-major dispatch of zero-width rows); one kernel then pulls
# each expert-major row from its token's rank and multiplies every expert segment by the
# expert's weights as its rows arrive.
# ---------------------------------------------------------------------------------------------


class _GatherMatmulConfig(NamedTuple):
    cfg: _Config      # the routing dispatch's (its combine returns the rows' cotangents)
    K: int
    copy_blocks: int  # blocks that pull rows (0: the kernel's automatic share)
    activation: bool = False  # also swiglu in the GEMM's epilogue (h's columns paired)
    w_k_major: bool = False   # w is [L, N, H]: the product by its transpose (the backward's)


def _dedup_plan(rows_src, row_of, recv_src, T, axis_name, max_dups):
    """Each token of another rank crosses the link once: (rows_src with -2 on the rows that are
    copies of an earlier row of the same token, rows_dups [C, D]: the copies of each token's
    first row (its lowest expert's), -1 padded, D = min(K - 1, max_dups), the kernel's limit
    `jax_ep._C.fused_max_dups`). D = 0 (nothing deduplicated) with one rank or one row per
    token."""
    C = rows_src.shape[0]
    R, rank = axis_info(axis_name)
    D = min(row_of.shape[1] - 1, max_dups)
    if R == 1 or D <= 0:
        return rows_src, jnp.zeros((C, 0), jnp.int32)
    valid = first_occurrence(row_of)     # the token's distinct rows (slots of one expert share)
    first = jnp.min(jnp.where(valid, row_of, C), axis=1)      # [Cr] its lowest row
    remote = (recv_src >= 0) & (recv_src // T != rank)
    copies = valid & (row_of != first[:, None]) & remote[:, None]
    dups = -jnp.sort(-jnp.where(copies, row_of, -1), axis=1)[:, :D]   # highest D copies first
    # only the copies listed are skipped where they lie (a token with more than D copies reads
    # the rest itself)
    listed = copies & (row_of >= dups[:, D - 1:D])
    rows_dups = jnp.full((C, D), -1, jnp.int32).at[
        jnp.where(jnp.any(copies, axis=1), first, C)].set(dups.astype(jnp.int32), mode="drop")
    rows_src = rows_src.at[jnp.where(listed, row_of, C).reshape(-1)].set(-2, mode="drop")
    return rows_src, rows_dups


def _gather_plan(src, row_of, rank, K, axis_name):
    """(rows_src, rows_dups) of the fused gather of the expert-major rows (src [C], row_of
    [Cr, K]) of the rank-major receive `rank`: each row's token as s * T + t (-1 on padding),
    each token of another rank read once (`_dedup_plan`)."""
    rows_src = jnp.where(src >= 0, rank.recv_src[jnp.maximum(src, 0) // K], -1)
    return _dedup_plan(rows_src, row_of, rank.recv_src, rank.send_rows.shape[0], axis_name,
                       runtime.extension().fused_max_dups)


def _gather_gemm_call(x, w, rows_src, rows_dups, sizes, fcfg, write_h=True):
    """(xe, h, act) of one launch: xe[j] = the token of rows_src[j] (zero where -1; where -2,
    that of the row whose rows_dups name j), h = grouped_matmul(xe, w, sizes) (w [L, H, N]; with
    fcfg.w_k_major w [L, N, H] and h = xe @ w[l]^T); with fcfg.activation act = swiglu(h) in x's
    dtype from the GEMM's epilogue and h's columns paired (`unpair_columns`), else act None.
    Rows past the last segment (j >= sum(sizes)) of all three are not written: undefined.
    write_h=False (with the activation only) leaves h unwritten: None."""
    C, H = rows_src.shape[0], x.shape[1]
    N = w.shape[1] if fcfg.w_k_major else w.shape[2]
    words = runtime.extension().fused_counter_words(C)
    xe, h, act, _ = _ffi.call(
        "jax_ep_ht_gather_gemm", [x, rows_src, rows_dups, sizes, w],
        [((C, H), x.dtype), ((C if write_h else 0, N), x.dtype),
         ((C if fcfg.activation else 0, N // 2), x.dtype), ((words,), jnp.int32)],
        axis_name=fcfg.cfg.axis_name, num_blocks=runtime.num_blocks(),
        copy_blocks=fcfg.copy_blocks, activation=int(fcfg.activation),
        w_k_major=int(fcfg.w_k_major), write_h=int(write_h))
    return xe, h if write_h else None, act if fcfg.activation else None


def unpair_columns(h):
    """h [C, N] in the column order of the activation epilogue (per kernel tile of
    `jax_ep._C.fused_block_columns` columns: half of them the gate's, then the up projection's
    same columns) back in w's order [gate | up]."""
    C, N = h.shape
    B = runtime.extension().fused_block_columns
    return h.reshape(C, N // B, 2, B // 2).transpose(0, 2, 1, 3).reshape(C, N)


def _activation_applies(N, backend):
    """Whether the fused dispatch + GEMM computes swiglu in its epilogue: the CUDA backend, N
    a multiple of the kernel's tile columns."""
    return backend == "cuda" and N % runtime.extension().fused_block_columns == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _gather_matmul(x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, acc, fcfg):
    """(xe, h) of `_gather_gemm_call` in one launch. counts: the rows of each segment that hold
    data (the rest is padding up to the row block). acc: None, or what the backward adds w's
    cotangent to in place (`padded_segments_matmul`)."""
    del counts, src, row_first, handle, acc
    return _gather_gemm_call(x, w, rows_src, rows_dups, sizes, fcfg)[:2]


def _gather_matmul_fwd(*args):
    # (symbolic zeros: the primals come wrapped)
    x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, acc = _primal_values(
        args[:-1])
    fcfg = args[-1]
    # Named like dispatch's outputs: under jax.checkpoint(policy=jax_ep.remat_policy) the
    # backward reuses them instead of running the kernel again.
    xe, h = remat.named(_gather_gemm_call(x, w, rows_src, rows_dups, sizes, fcfg)[:2],
                        remat.DISPATCH)
    return (xe, h), (xe, w, sizes, counts, src, row_first, handle, acc)


def _gather_matmul_bwd(fcfg, res, g):
    xe, w, sizes, counts, src, row_first, handle, acc = res
    g_xe, g_h = g
    if isinstance(g_h, _SymbolicZero):
        g_h = jnp.zeros(g_h.shape, g_h.dtype)
    g_h = g_h.astype(xe.dtype)
    if isinstance(g_xe, _SymbolicZero) and not runtime.per_process() and _fused_backward():
        # Nothing reads xe (moe_ffn): d x is the combine of g_h @ w^T, each token's rows summed
        # here and then over the ranks, in one launch that sums each row block's rows as soon
        # as its tiles are stored (docs/kernels.md#fused-backward).
        dx = _gemm_combine_call(g_h, w, jnp.ones(row_first.shape, jnp.float32), sizes,
                                row_first, handle, _GemmCombineConfig(fcfg.cfg, fcfg.K, 0),
                                w_k_major=True)[1]
        d_w = grouped_gemm.padded_segments_weight_grad(xe, g_h, sizes, counts, acc)
        return dx, d_w, None, None, None, None, None, None, None, None
    # the weight gradient skips each segment's padding rows (zeros in xe)
    gmm = functools.partial(grouped_gemm.padded_segments_matmul, sizes=sizes, counts=counts,
                            acc=acc)
    _, vjp = jax.vjp(gmm, xe, w)
    d_xe, d_w = vjp(g_h)
    if not isinstance(g_xe, _SymbolicZero):
        d_xe = (d_xe.astype(jnp.float32) + g_xe.astype(jnp.float32)).astype(xe.dtype)
    d_rows = el.expand_rows_transpose(d_xe, src, row_first, fcfg.K)
    dx = _combine_diff(d_rows, handle, fcfg.cfg)
    return dx, d_w, None, None, None, None, None, None, None, None


_gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _gather_matmul_swiglu(x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, acc,
                          fcfg):
    """(xe, swiglu(h) in x's dtype) of `_gather_gemm_call` with the activation in the GEMM's
    epilogue (fcfg.activation), in one launch; arguments as `_gather_matmul`'s. Without a
    gradient h, which only the backward reads, is not written (nor planned)."""
    del counts, src, row_first, handle, acc
    xe, _, act = _gather_gemm_call(x, w, rows_src, rows_dups, sizes, fcfg, write_h=False)
    return xe, act


def _gather_matmul_swiglu_fwd(*args):
    x, w, rows_src, rows_dups, sizes, counts, src, row_first, handle, acc = _primal_values(
        args[:-1])
    fcfg = args[-1]
    xe, h, act = remat.named(_gather_gemm_call(x, w, rows_src, rows_dups, sizes, fcfg),
                             remat.DISPATCH)
    return (xe, act), (h, (xe, w, sizes, counts, src, row_first, handle, acc))


def _gather_matmul_swiglu_bwd(fcfg, res, g):
    h, rest = res
    g_xe, g_act = g
    if isinstance(g_act, _SymbolicZero):
        g_act = jnp.zeros(g_act.shape, g_act.dtype)
    # the activation's rule on h in w's column order (XLA fuses the reorder into it)
    _, vjp = jax.vjp(lambda h: swiglu(h).astype(g_act.dtype), unpair_columns(h))
    (g_h,) = vjp(g_act)
    return _gather_matmul_bwd(fcfg, rest, (g_xe, g_h))


_gather_matmul_swiglu.defvjp(_gather_matmul_swiglu_fwd, _gather_matmul_swiglu_bwd,
                             symbolic_zeros=True)


def dispatch_matmul(x, topk_idx, topk_weights, w, *, num_experts, axis_name="ep", capacity=None,
                    backend="auto", copy_blocks=0, weight_grad_acc=None):
    """`dispatch(layout="expert")` fused with `grouped_matmul(recv_x, w, expert_sizes)`.

    Returns (ExpertDispatchResult, h [capacity, N]). On the CUDA backend x and w are bfloat16
    and the segments start at multiples of the kernel's row block (`expert_alignment` of
    `jax_ep._C.fused_block_rows`), and the rows of recv_x and h past the last segment (from
    recv_count on) are undefined, not zero as `dispatch`'s; the reference backend runs the two
    ops unfused (segments unaligned). Differentiable in x, topk_weights and w. copy_blocks:
    blocks of the launch that pull rows (0: automatic, docs/kernels.md#fused-gather-gemm).
    weight_grad_acc: None, or [L, H, N] in w's dtype that w's cotangent is added to, in place on
    the CUDA backend (`grouped_gemm.padded_segments_matmul`).
    """
    return _dispatch_matmul(x, topk_idx, topk_weights, w, num_experts=num_experts,
                            axis_name=axis_name, capacity=capacity, backend=backend,
                            copy_blocks=copy_blocks, weight_grad_acc=weight_grad_acc,
                            activation=False)


def dispatch_matmul_swiglu(x, topk_idx, topk_weights, w, *, num_experts, axis_name="ep",
                           capacity=None, backend="auto", copy_blocks=0, weight_grad_acc=None):
    """`dispatch_matmul` then swiglu (silu(gate) * up of w's [gate | up] columns) in x's dtype:
    (ExpertDispatchResult, act [capacity, N / 2]), the layer's first half. On the CUDA backend
    with N a multiple of `jax_ep._C.fused_block_columns` the activation runs in the GEMM's
    epilogue (docs/kernels.md#fused-activation): no pass of its own over the rows; elsewhere
    after it."""
    return _dispatch_matmul(x, topk_idx, topk_weights, w, num_experts=num_experts,
                            axis_name=axis_name, capacity=capacity, backend=backend,
                            copy_blocks=copy_blocks, weight_grad_acc=weight_grad_acc,
                            activation=True)


def _dispatch_matmul(x, topk_idx, topk_weights, w, *, num_experts, axis_name, capacity, backend,
                     copy_blocks, weight_grad_acc, activation):
    """dispatch_matmul (activation False: h) or dispatch_matmul_swiglu (True: swiglu(h))."""
    _checks.expect_rank("x", x, 2, "[T, H]")
    T, H = x.shape
    be = _checks.resolve_backend(backend, empty=T == 0)
    if be == "reference":
        res = dispatch(x, topk_idx, topk_weights, num_experts=num_experts, axis_name=axis_name,
                       capacity=capacity, layout="expert", backend=be)
        h = _unfused_matmul(res.recv_x, w, res.expert_sizes, weight_grad_acc, be)
        return res, swiglu(h).astype(x.dtype) if activation else h
    for name, a in (("x", x), ("w_gate_up", w)):
        if jnp.dtype(a.dtype) != jnp.bfloat16:
            raise TypeError(f"{name}: the fused dispatch + grouped GEMM takes bfloat16, got "
                            f"{jnp.dtype(a.dtype).name} (fused=False takes every dtype)")
    _routing_checks(T, H, topk_idx, topk_weights)
    R, L = _group_checks(num_experts, axis_name, T)
    K = topk_idx.shape[1]
    A = runtime.extension().fused_block_rows
    worst = R * T * min(K, L) + L * (A - 1)
    capacity = worst if capacity is None else _checks.static_int("capacity", capacity, 1)
    if max(R * T * K, capacity) > _checks.INT32_LIMIT:
        raise ValueError(f"capacity={capacity}, R * T * K = {R * T * K}: rows are indexed in "
                         "int32, so each must be < 2^31")
    copy_blocks = _checks.static_int("copy_blocks", copy_blocks, 0)
    cfg = _Config(int(num_experts), min(R * T, capacity), axis_name, be)
    idx = _checks.int32_ids(topk_idx, num_experts)
    wts = (jnp.zeros(topk_idx.shape, jnp.float32) if topk_weights is None
           else topk_weights.astype(jnp.float32))
    # (the zero-width rows too: the routing dispatch's backward gives them a varying cotangent)
    x, wts, rows = _ffi.varying([x, wts, jnp.zeros((T, 0), x.dtype), idx], axis_name)[:3]
    # w varying like x (replicated over data parallelism, its gradient is summed over the
    # replicas by this cast's transpose, outside the rule); acc checked against it
    x, w, weight_grad_acc = grouped_gemm._same_axes(x, w, weight_grad_acc)
    # the routing alone: a dispatch of zero-width rows (differentiable in the weights); with
    # one rank the same arrays from a few XLA ops, without the kernel's launch and its scratch
    if R == 1:
        ridx, rw, handle = routing_one_rank(wts, idx, cfg)
    else:
        _, ridx, rw, _, handle = _dispatch_diff(rows, wts, idx, cfg)
    lay, we, ehandle = el.plan_receive(ridx, rw, handle, L, capacity, A, topk_weights is not None,
                                       runtime.poison_int(), be)
    src = lay["src"]
    row_first = jnp.where(first_occurrence(ridx), lay["row_of"], -1)
    rows_src, rows_dups = _gather_plan(src, lay["row_of"], handle, K, axis_name)
    operands = (x, w, rows_src, rows_dups, lay["expert_sizes"], lay["counts"], src, row_first,
                handle, weight_grad_acc)
    if activation and _activation_applies(w.shape[2], be):
        xe, out = _gather_matmul_swiglu(*operands, _GatherMatmulConfig(cfg, K, copy_blocks, True))
    else:
        xe, out = _gather_matmul(*operands, _GatherMatmulConfig(cfg, K, copy_blocks))
        if activation:
            out = swiglu(out).astype(x.dtype)
    return el.ExpertDispatchResult(xe, we, lay["expert_sizes"], lay["expert_offsets"],
                                lay["counts"], lay["recv_count"], ehandle), out


# ---------------------------------------------------------------------------------------------
# Fused second grouped GEMM + combine (moe_ffn(fused=True), docs/kernels.md#fused-gemm-combine):
# one kernel multiplies each expert segment by the expert's weights, sums each received token's
# rows on the rank that computed them once their row blocks are done, and each token's sums
# over the ranks on its own rank. The same arithmetic as grouped_matmul followed by
# combine(handle).
# ---------------------------------------------------------------------------------------------

class _GemmCombineConfig(NamedTuple):
    cfg: _Config         # the combine's (axis, backend)
    K: int
    combine_blocks: int  # blocks that only combine (0: the kernel's automatic share)


def _gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg, w_k_major=False,
                       addend=None):
    """(ye, out): ye = grouped_matmul(a, w, sizes) (w_k_major: w [L, N, I], ye = a @ w[l]^T),
    out = its combine, in one launch. Over several ranks ye is scratch: each received row's
    weighted sum of its rows on the rank takes the row of its first slot there (at R = 1 ye
    keeps every product, rows past the last segment unwritten). addend: None, or (add [T, N]
    in a's dtype, on bool []): where on, out = `plus_addend(combine, addend)`, and add is read
    only then; out takes add's buffer (XLA copies add first when something else still reads
    it)."""
    C, Cr = a.shape[0], row_of.shape[0]
    N = w.shape[1] if w_k_major else w.shape[2]
    T = rank.send_rows.shape[0]
    words = runtime.extension().fused_combine_counter_words(C, Cr, N)
    add, on = (jnp.zeros((0,), a.dtype), jnp.zeros((), jnp.bool_)) if addend is None \
        else addend
    ye, out, _ = _ffi.call("jax_ep_ht_gemm_combine",
                           [a, sizes, w, row_of, weights, rank.send_rows, add, on],
                           [((C, N), a.dtype), ((T, N), a.dtype), ((words,), jnp.int32)],
                           aliases=() if addend is None else ((6, 1),),
                           axis_name=ccfg.cfg.axis_name, num_blocks=runtime.num_blocks(),
                           combine_blocks=ccfg.combine_blocks, w_k_major=int(w_k_major))
    return ye, out


def unwritten(like, shape, dtype):
    """An array of `shape` and `dtype` that no kernel writes (its contents undefined; varying
    as `like`, whose buffer is not read): the first value of a loop's carry that nothing reads
    unless the loop ran and wrote it, with no fill of its own. CUDA backend."""
    return _ffi.call("jax_ep_unwritten", [like], [(shape, dtype)], pure=True)[0]


def plus_addend(out, addend):
    """out (the first pass's [T, N]) with addend = (add [T, N] in out's dtype, on bool [])
    added: where on, out plus add in float32, rounded to out's dtype, else out (add not read):
    what the fused GEMM + combine computes with an addend."""
    add, on = addend
    return jnp.where(on, (out.astype(jnp.float32) + add.astype(jnp.float32)).astype(out.dtype),
                     out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _matmul_combine(a, w, weights, sizes, counts, row_of, src, rank, acc, addend, ccfg):
    """combine(grouped_matmul(a, w, sizes), handle) in one launch: [T, N] in a's dtype.
    counts: the rows of each segment that hold data (the backward's weight gradient). acc:
    None, or what the backward adds w's cotangent to in place. addend: None, or (add, on), added
    to the output where on (`plus_addend`)."""
    del counts, src, acc
    return _gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg, addend=addend)[1]


def _matmul_combine_fwd(a, w, weights, sizes, counts, row_of, src, rank, acc, addend, ccfg):
    # Named like combine's outputs (see _gather_matmul_fwd). The GEMM's rows ye are not kept:
    # the backward needs no [C, N] residual (below).
    _, out = remat.named(_gemm_combine_call(a, w, weights, sizes, row_of, rank, ccfg,
                                            addend=addend), remat.COMBINE)
    on = None if addend is None else addend[1]
    return out, (a, w, weights, sizes, counts, row_of, src, rank, acc, on)


def _matmul_combine_bwd(ccfg, res, g):
    # combine's rule (a gather of each token's cotangent to the rows' ranks), then the GEMM's
    # with the routing weights moved to the other side: for row j of token t with weight w_j,
    # out[t] += w_j * a_j @ W, so with u_j = g[t] @ W^T
    #   d a_j = w_j * u_j,   d W = sum_j (w_j * a_j)^T g[t],   d w_j = <a_j @ W, g[t]> = <a_j, u_j>
    # (docs/kernels.md#fused-backward-weights): one GEMM transpose on the unweighted rows gives
    # the first two, and the weights' gradient reads [C, I] rows, not the GEMM's [C, N] output
    # (which the forward would otherwise keep until the backward).
    a, w, weights, sizes, counts, row_of, src, rank, acc, on = res
    K = ccfg.K
    wj = el.row_weights(weights, src, row_of)                              # [C] float32
    aw = (a.astype(jnp.float32) * wj[:, None]).astype(a.dtype)
    if ccfg.cfg.backend == "cuda" and _fused_backward():
        # the gather of g to the rows and u = g_exp @ W^T in one launch, each row block's tiles
        # starting as soon as its rows arrived (the forward dispatch's plan,
        # docs/kernels.md#fused-backward)
        rows_src, rows_dups = _gather_plan(src, row_of, rank, K, ccfg.cfg.axis_name)
        g_exp, u, _ = _gather_gemm_call(g.astype(a.dtype), w, rows_src, rows_dups, sizes,
                                        _GatherMatmulConfig(ccfg.cfg, K, 0, w_k_major=True))
        d_w = grouped_gemm.padded_segments_weight_grad(aw, g_exp, sizes, counts, acc)
    else:   # the rule's specification: the ops it fuses
        g_rows = _gather_diff(g, rank, ccfg.cfg).astype(a.dtype)
        g_exp = el.take_rows(g_rows, el.received_row(src, K))              # [C, N], unweighted
        gmm = functools.partial(grouped_gemm.padded_segments_matmul, sizes=sizes, counts=counts,
                                acc=acc)
        _, vjp = jax.vjp(gmm, aw, w)
        u, d_w = vjp(g_exp)
    u = u.astype(jnp.float32)
    d_a = (u * wj[:, None]).astype(a.dtype)
    d_row = jnp.sum(a.astype(jnp.float32) * u, axis=-1)                    # [C]
    if rank.send_rows.shape[1] == 1:
        # one rank: both from u at once, before the first half's rule reads d_a, else XLA sums
        # d_row last and keeps a ([C, I]) through that rule's buffers. Over several ranks the
        # same barrier made XLA plan more (docs/design.md#layer-routing-one-rank).
        d_a, d_row = jax.lax.optimization_barrier((d_a, d_row))
    Cr = weights.shape[0]
    d_weights = el.take_rows(d_row, row_of.reshape(Cr * K)).reshape(Cr, K)
    # the addend's cotangent: g where it was added (nothing in the layer asks for it)
    d_add = None if on is None else (jnp.where(on, g, jnp.zeros_like(g)), None)
    return d_a, d_w, d_weights.astype(weights.dtype), None, None, None, None, None, None, d_add


_matmul_combine.defvjp(_matmul_combine_fwd, _matmul_combine_bwd)


def matmul_combine(a, w, res, *, axis_name="ep", backend="auto", combine_blocks=0,
                   weight_grad_acc=None):
    """`combine(grouped_matmul(a, w, res.expert_sizes), res.handle)` fused in one launch.

    a: `[capacity, I]` expert-major rows of the `ExpertDispatchResult` res of `dispatch_matmul`
    (on the CUDA backend bfloat16, one process over the group's GPUs; its segments start at
    multiples of `jax_ep._C.fused_block_rows` rows, which the kernel relies on: a result of
    `dispatch(layout="expert")` needs that `expert_alignment`); w: `[L, I, N]`. Returns
    `[T, N]` in a's dtype. Elsewhere (the reference backend, per-process groups) it runs the
    two ops.
    Differentiable in a, w and the routing weights. combine_blocks: blocks of the launch that
    only combine (0: automatic, docs/kernels.md#fused-gemm-combine). weight_grad_acc: None, or
    [L, I, N] in w's dtype that w's cotangent is added to, in place on the CUDA backend.
    """
    return matmul_combine_plus(a, w, res, None, axis_name=axis_name, backend=backend,
                               combine_blocks=combine_blocks, weight_grad_acc=weight_grad_acc)


def matmul_combine_plus(a, w, res, addend, *, axis_name="ep", backend="auto", combine_blocks=0,
                        weight_grad_acc=None):
    """`matmul_combine` with addend = None or (add [T, N] in a's dtype, on bool []) added to
    its output where on (`plus_addend`; the kernel reads add only then): the layer's first pass
    with the passes after it (docs/design.md#layer-passes-early)."""
    if not isinstance(res, el.ExpertDispatchResult):
        raise TypeError(f"res: expected the ExpertDispatchResult of dispatch_matmul, got "
                        f"{type(res).__name__}")
    handle = res.handle
    rank = handle.rank
    combine_blocks = _checks.static_int("combine_blocks", combine_blocks, 0)
    _checks.expect_rank("a", a, 2, "[capacity, I]")
    if a.shape[0] != handle.src.shape[0]:
        raise ValueError(f"a: has {a.shape[0]} rows, expected capacity={handle.src.shape[0]} "
                         "(one per expert-major row of the dispatch)")
    be = _checks.resolve_backend(backend, empty=rank.send_rows.shape[0] == 0)
    if be == "reference" or runtime.per_process():
        y = _unfused_matmul(a, w, res.expert_sizes, weight_grad_acc, be)
        out = combine(y, handle, axis_name=axis_name, backend=be)
        return out if addend is None else plus_addend(out, addend)
    for name, v in (("a", a), ("w_down", w)):
        if jnp.dtype(v.dtype) != jnp.bfloat16:
            raise TypeError(f"{name}: the fused grouped GEMM + combine takes bfloat16, got "
                            f"{jnp.dtype(v.dtype).name}")
    K = handle.row_of.shape[1]
    cfg = _Config(0, rank.recv_src.shape[0], axis_name, be)
    a, weights = _ffi.varying([a, handle.weights, rank.recv_src], axis_name)[:2]
    a, w, weight_grad_acc = grouped_gemm._same_axes(a, w, weight_grad_acc)   # as dispatch_matmul
    return _matmul_combine(a, w, weights, res.expert_sizes, res.recv_tokens_per_expert,
                           handle.row_of, handle.src, rank, weight_grad_acc, addend,
                           _GemmCombineConfig(cfg, K, combine_blocks))
