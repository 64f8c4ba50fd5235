"""The send / receive split of the low-latency ops: `*_send` writes to the peers without
waiting for their receive, `*_recv` waits for the peers' rows and delivers the outputs, so XLA
can schedule other work in between. The same kernels as `low_latency_dispatch` /
`low_latency_combine`, in two halves; forward only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import _checks, _ffi, runtime
from jax_ep._common import axis_info
from jax_ep.low_latency import (LowLatencyHandle, LowLatencyResult, _check_invalid,
                                _combine_attrs, _combine_cfg, _combine_core, _dispatch_cfg,
                                _dispatch_core, _dispatch_cuda_args, _dispatch_result)


@jax.tree_util.register_pytree_node_class
class LowLatencyPending:
    """The in-flight half of a split low-latency op: pass it to the matching `*_recv`.

    A pytree (its arrays are leaves; the call site, shapes and settings are static), so it can
    cross `jit`, `scan` and `remat` boundaries between the send and the receive; across `scan`
    iterations when the sends name one `pair`.
    """

    def __init__(self, arrays, meta):
        self.arrays = tuple(arrays)
        self.meta = meta

    def tree_flatten(self):
        return self.arrays, self.meta

    @classmethod
    def tree_unflatten(cls, meta, arrays):
        return cls(arrays, meta)


def _no_grad(fn, what):
    """fn(*arrays) with a clear error under differentiation (the split ops are forward only)."""
    def jvp(primals, tangents):
        raise TypeError(f"jax_ep.{what} is forward only; use the non-split op "
                        "(use_fp8=False for the dispatch) to differentiate")
    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(jvp)
    return wrapped


def _split_site(kind, pair, layout):
    """The call-site id of a split send: its own, or the one every send naming `pair` with the
    same static layout (config and shapes) shares."""
    if pair is None:
        return runtime.new_site()
    if not isinstance(pair, str) or not pair:
        raise TypeError(f"pair must be a non-empty str naming the sends that share a call site, "
                        f"got {pair!r}")
    return runtime.site_for_pair(kind, (pair, layout))


def low_latency_dispatch_send(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                              max_tokens_per_rank: int, axis_name: str = "ep",
                              use_fp8: bool = True, round_scale: bool = False,
                              backend: str = "auto", check: bool | None = None,
                              pair: str | None = None) -> LowLatencyPending:
    """First half of `low_latency_dispatch`: quantise and write the rows to the peers.

    Returns at once (the kernel does not wait for any peer). `low_latency_dispatch_recv` of the
    result waits for the peers' rows and returns the same `LowLatencyResult` as
    `low_latency_dispatch`. Forward only. At most two pending sends per call site: receive
    the first before the same code sends a third time. The contract in full:
    docs/API.md#send--receive-split-jax_ep-addition.

    Args:
      x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, backend,
        check: as for `low_latency_dispatch`.
      pair: a name shared by the sends whose pendings must have one structure, e.g. the send
        before a `lax.scan` and the one in its body when the pending is carried across
        iterations (they then share one call site). Without it every send is a call site of
        its own.

    Returns:
      LowLatencyPending: the in-flight send, for `low_latency_dispatch_recv`.
    """
    _checks.flag("check", check, allow_none=True)
    cfg, idx = _dispatch_cfg(x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8,
                             round_scale, backend)
    # The halves share one call-site lease (slot and buffers). Its id is in the pending's
    # structure on both backends, so a pending crosses a scan iteration only with `pair`.
    site = _split_site("dispatch", pair, (cfg, tuple(x.shape), idx.shape[1]))
    if cfg.backend == "reference":  # the reference runs the whole op in the receive half
        meta = ("dispatch", cfg, tuple(x.shape), idx.shape[1], site, check)
        return LowLatencyPending(_no_grad(lambda a, b: (a, b), "low_latency_dispatch_send")(
            x, idx), meta)
    _, attrs = _dispatch_cuda_args(cfg, idx.shape[1], x.shape[1])

    def send(a, b):
        return _ffi.call("jax_ep_ll_dispatch_send", [a, b], [((2,), jnp.int32)],
                         axis_name=axis_name, site=site, **attrs)[0]

    stats = _no_grad(send, "low_latency_dispatch_send")(x, idx)
    return LowLatencyPending((stats, idx), ("dispatch", cfg, tuple(x.shape), idx.shape[1], site,
                                        check))


def low_latency_dispatch_recv(pending: LowLatencyPending) -> LowLatencyResult:
    """Second half of a split dispatch: wait for the peers' rows, deliver the outputs.

    Args:
      pending: what `low_latency_dispatch_send` returned.

    Returns:
      LowLatencyResult: the same as `low_latency_dispatch` with the send's arguments.
    """
    if not isinstance(pending, LowLatencyPending) or pending.meta[0] != "dispatch":
        raise TypeError("pending: expected the result of jax_ep.low_latency_dispatch_send, got "
                        f"{type(pending).__name__}")
    _, cfg, x_shape, K, site, check = pending.meta
    num_experts, M, use_fp8, round_scale, axis_name, backend = cfg
    if backend == "reference":
        rx, cnt, handle = _dispatch_core(*pending.arrays, cfg)
        idx = pending.arrays[1]
    else:
        stats, idx = pending.arrays
        recv_types, attrs = _dispatch_cuda_args(cfg, K, x_shape[1])
        outs = _ffi.call("jax_ep_ll_dispatch_recv", [stats], recv_types, axis_name=axis_name,
                         site=site, **attrs)
        rx, cnt, handle = _dispatch_result(outs, stats, use_fp8)
    handle = handle._replace(topk_idx=idx)
    return _check_invalid(LowLatencyResult(rx, cnt, handle), axis_name, check,
                          "low_latency_dispatch_recv")


def low_latency_combine_send(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                             handle: LowLatencyHandle, *, axis_name: str = "ep",
                             backend: str = "auto", pair: str | None = None,
                             ) -> LowLatencyPending:
    """First half of `low_latency_combine`: write the expert outputs back to their sources.

    Returns once every peer has started its own combine send (where each source writes its
    token weights to the expert ranks, which pre-reduce with them), without waiting for any
    receive; `low_latency_combine_recv` of the result returns the same [T, H] output as
    `low_latency_combine`. Forward only. The contract in full:
    docs/API.md#send--receive-split-jax_ep-addition.

    Args:
      y, topk_idx, topk_weights, handle, axis_name, backend: as for `low_latency_combine`.
      pair: as for `low_latency_dispatch_send`.

    Returns:
      LowLatencyPending: the in-flight send, for `low_latency_combine_recv`.
    """
    cfg, idx = _combine_cfg(y, topk_idx, topk_weights, handle, axis_name, backend)
    w = topk_weights.astype(jnp.float32)
    didx = handle.topk_idx
    site = _split_site("combine", pair, (cfg, tuple(y.shape), tuple(idx.shape)))  # as above
    if cfg.backend == "reference":
        arrays = _no_grad(lambda *a: a, "low_latency_combine_send")(
            y, idx, w, didx, handle.recv_src, handle.recv_slot, handle.recv_count,
            handle.src_rows)
        return LowLatencyPending(arrays, ("combine", cfg, tuple(y.shape), site))
    R, _ = axis_info(axis_name)
    K, H = idx.shape[1], y.shape[-1]
    attrs = _combine_attrs(cfg.num_experts, R, cfg.max_tokens, K, H)

    def send(yy, src, sl, cnt, rows, ii, ww, dd):
        return _ffi.call("jax_ep_ll_combine_send", [yy, src, sl, cnt, rows, ii, ww, dd],
                         [((1,), jnp.int32)], axis_name=axis_name, site=site, **attrs)[0]

    ticket = _no_grad(send, "low_latency_combine_send")(
        y, handle.recv_src, handle.recv_slot, handle.recv_count, handle.src_rows, idx, w, didx)
    return LowLatencyPending((ticket, idx, w, didx), ("combine", cfg, tuple(y.shape), site))


def low_latency_combine_recv(pending: LowLatencyPending) -> jax.Array:
    """Second half of a split combine: wait for the expert outputs, reduce them per token.

    Args:
      pending: what `low_latency_combine_send` returned.

    Returns:
      `[T, H]` bfloat16: the same as `low_latency_combine` with the send's arguments.
    """
    if not isinstance(pending, LowLatencyPending) or pending.meta[0] != "combine":
        raise TypeError("pending: expected the result of jax_ep.low_latency_combine_send, got "
                        f"{type(pending).__name__}")
    _, cfg, y_shape, site = pending.meta
    num_experts, M, axis_name, backend = cfg
    if backend == "reference":
        y, idx, w, didx, src, sl, cnt, rows = pending.arrays
        return _combine_core(y, idx, w, didx, (src, sl, cnt, rows), cfg)
    ticket, idx, w, didx = pending.arrays
    R, _ = axis_info(axis_name)
    T, K = idx.shape
    H = y_shape[-1]
    attrs = _combine_attrs(num_experts, R, M, K, H)
    (out,) = _ffi.call("jax_ep_ll_combine_recv", [ticket, idx, w, didx], [((T, H), jnp.bfloat16)],
                       axis_name=axis_name, site=site, **attrs)
    return out
