"""Trace-time argument checks shared by the ops: clear errors naming argument, got, expected."""
from __future__ import annotations

import atexit
import collections
import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BACKENDS = ("auto", "reference", "cuda")


def dtype_name(d):
    return jnp.dtype(d).name


def expect_rank(name, a, ndim, what):
    if not hasattr(a, "shape") or len(a.shape) != ndim:
        got = getattr(a, "shape", type(a).__name__)
        raise ValueError(f"{name}: expected a rank-{ndim} array {what}, got shape {got}")


def expect_dtype(name, a, allowed):
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in allowed]:
        raise TypeError(f"{name}: dtype {dtype_name(a.dtype)} is not supported; expected one of "
                        f"{', '.join(dtype_name(d) for d in allowed)}")


def capacity_factor(f):
    """A capacity factor: a finite number above 0."""
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
        raise ValueError(f"capacity_factor must be a finite number above 0, got {f!r}")
    return f


def static_int(name, v, minimum=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(v).__name__} ({v!r})")
    v = int(v)
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def experts_per_rank(num_experts, num_ranks):
    num_experts = static_int("num_experts", num_experts, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size "
                         f"{num_ranks}: every rank must hold num_experts // R experts")
    return num_experts // num_ranks


def _limit(name):
    from jax_ep import runtime
    return runtime.limits().get(name)


def group_size(num_ranks, axis_name):
    """The EP group size against the kernels' limit (every backend: see runtime.limits)."""
    m = _limit("max_ranks")
    if m is not None and num_ranks > m:
        raise ValueError(f"axis_name={axis_name!r}: the EP group has {num_ranks} ranks; jax_ep's "
                         f"kernels serve groups of at most {m} (checked on every backend, so "
                         "that a program that runs on the reference also runs on GPUs)")


def low_latency_experts(num_experts, num_ranks):
    m = _limit("max_local_experts")
    if m is not None and num_experts // num_ranks > m:
        raise ValueError(f"num_experts={num_experts}: {num_experts // num_ranks} experts per rank "
                         f"(E // R); the low-latency ops serve at most {m} per rank")


def layout_ranks(num_ranks):
    m = _limit("max_layout_ranks")
    if m is not None and num_ranks > m:
        raise ValueError(f"num_ranks={num_ranks}: get_dispatch_layout counts at most {m} ranks")


# Row indices and ids travel as int32 (the handles' dtype): sizes they index stay below 2^31.
INT32_LIMIT = 2**31 - 1


def topk(name, topk_idx, T=None):
    """[T, K] int ids with K >= 1 (and T rows when given)."""
    expect_rank(name, topk_idx, 2, "[T, K]")
    expect_dtype(name, topk_idx, (jnp.int32, jnp.int64))
    if T is not None and topk_idx.shape[0] != T:
        raise ValueError(f"{name}: has {topk_idx.shape[0]} rows, expected T={T} (one per token "
                         "of x)")
    if topk_idx.shape[1] < 1:
        raise ValueError(f"{name}: K = 0 top-k slots; every token needs at least one (K >= 1)")


def hidden(name, H):
    if H < 1:
        raise ValueError(f"{name}: hidden size H = {H}; expected H >= 1")


def weights(name, w, shape):
    """Router weights in float32, bfloat16 or float16 (the ops compute in float32)."""
    expect_rank(name, w, 2, "[T, K]")
    expect_dtype(name, w, FLOAT_DTYPES)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {tuple(shape)} (as topk_idx)")


def flag(name, v, allow_none=False):
    """A static Python bool (numpy bools too); a string such as "no" is an error, not True."""
    if (allow_none and v is None) or isinstance(v, (bool, np.bool_)):
        return None if v is None else bool(v)
    raise TypeError(f"{name} must be a bool{' or None' if allow_none else ''}, got "
                    f"{type(v).__name__} ({v!r})")


def backend_name(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    return backend


def resolve_backend(backend, *, empty=False):
    """'reference' or 'cuda' for this trace.

    empty: the shard has no tokens (T = 0, a static shape, so the same on every shard of the
    call): nothing moves and the reference computes the empty results on every backend."""
    from jax_ep import runtime

    backend = backend_name(backend)
    if backend == "reference" or empty:
        return "reference"
    ok = runtime.cuda_backend_available()
    if backend == "cuda" and not ok:
        raise ValueError("backend='cuda' needs the built CUDA extension and CUDA GPUs "
                         f"(extension built: {runtime.extension() is not None}, "
                         f"jax backend: {jax.default_backend()})")
    return "cuda" if ok else "reference"


def sum_over_shards(v, axis_name):
    """psum of v over every manual mesh axis of the enclosing shard_map (at least axis_name).

    check=True raises from a host callback; if only some shards raised, the others would wait
    forever in the next collective (a hang, or XLA aborting the process). Deciding on a total
    that every shard sees makes every shard raise at the same program point.
    """
    axes = (axis_name,)
    try:
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    except Exception:  # noqa: BLE001 - no context mesh: the EP axis alone
        manual = ()
    if axis_name in manual:
        axes = manual
    return jax.lax.psum(v, axes)


def int32_ids(topk_idx, num_experts):
    """topk_idx as int32 without wrapping: an int64 id outside [-1, E) becomes -2 (still out of
    range, so still treated as -1 and counted in num_invalid) instead of wrapping modulo 2^32
    into what may be a valid expert id."""
    if jnp.dtype(topk_idx.dtype) == jnp.int32:
        return topk_idx
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(bad, -2, topk_idx).astype(jnp.int32)


class CheckError(RuntimeError):
    """What `check=True` (or JAX_EP_CHECK=1) raises when an op saw invalid expert ids, dropped
    rows or a mismatched topk_idx: `op` names the op, `counts` this rank's counts and `totals`
    the counts over all shards (dicts by name, e.g. num_invalid, num_dropped).

    Raised inside a compiled program, it reaches the caller as the `jax.errors.JaxRuntimeError`
    that JAX makes of any exception there (its message holds this one's); wrap the step in
    `jax_ep.checked` to get the CheckError itself."""

    def __init__(self, op, counts, totals, message):
        super().__init__(message)
        self.op, self.counts, self.totals = op, dict(counts), dict(totals)


_log = logging.getLogger("jax_ep")
_raised = collections.deque(maxlen=64)  # recent CheckErrors, for jax_ep.checked
_raised_lock = threading.Lock()


class _NotOurs(logging.Filter):
    """JAX logs every failed callback with its traceback, once per shard; a CheckError is
    reported once, by the exception the caller gets."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, CheckError)


for _name in ("jax._src.callback", "jax._src.debugging"):
    logging.getLogger(_name).addFilter(_NotOurs())


def checked_result(out, op, counts, axis_name, message):
    """`out` (a pytree) made to depend on a host check of `counts` ({name: [] int array}): when
    any of them is non-zero on some shard, every shard raises CheckError at the same point.

    A pure callback whose result gates every leaf of `out`, so that the check runs whenever
    any result is used and leaves no failed effect token behind (an effectful callback's
    error is raised again when JAX waits for its tokens at exit). message(counts, totals)
    gives the text from this rank's counts and the totals over all shards (lists by name)."""
    names = tuple(counts)
    vals = jnp.stack([jnp.asarray(counts[n]).astype(jnp.int32).reshape(()) for n in names])
    totals = sum_over_shards(vals, axis_name)

    def host(v, t):
        v, t = [int(a) for a in np.asarray(v)], [int(a) for a in np.asarray(t)]
        if min(v + t, default=0) < 0:  # a count holds the sentinel: a wait of the op gave up
            from jax_ep._faults import timeout_error
            timeout = timeout_error()
            if timeout is not None:
                raise timeout
        if any(t):
            err = CheckError(op, dict(zip(names, v)), dict(zip(names, t)), message(v, t))
            with _raised_lock:   # the shards of one check raise back to back: one line
                told = bool(_raised) and (_raised[-1].op, _raised[-1].totals) == (op, err.totals)
                _raised.append(err)
            if not told:   # JAX's own report starts with its callback's traceback
                _log.error("%s. The step stops with jax.errors.JaxRuntimeError; wrap it in "
                           "jax_ep.checked(step) to get jax_ep.CheckError.", err)
            raise err
        return np.zeros((), np.int32)

    # sequential under vmap: one check per batch element (the one-GPU multi-rank mode vmaps the
    # EP axis; a user may vmap another).
    ok = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.int32), vals, totals,
                           vmap_method="sequential")
    return jax.tree.map(lambda a: jnp.where(ok == 0, a, jnp.zeros_like(a)), out)


def find_check_error(text):
    """The most recent CheckError whose message is in `text` (a JaxRuntimeError's), or None."""
    with _raised_lock:
        for err in reversed(_raised):
            if str(err) in text:
                return err
    return None


def _forget_failed_checks():
    """Drop JAX's runtime tokens of programs that a CheckError stopped: JAX waits for every
    host-callback program's token again when effects are flushed and at exit, and would report
    the same failure there once more (as "Exception ignored in atexit callback")."""
    try:
        from jax._src import dispatch  # private: the tokens JAX waits for at exit
        tokens = dispatch.runtime_tokens.output_runtime_tokens
    except (ImportError, AttributeError):
        return
    for device, token in list(tokens.items()):
        try:
            token.block_until_ready()
        except Exception as e:  # noqa: BLE001 - whatever JAX made of the failed check
            if find_check_error(str(e)) is not None:
                tokens.pop(device, None)


atexit.register(_forget_failed_checks)  # runs before JAX's own exit handlers (registered first)


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (e.g. a jitted training step), raising `jax_ep.CheckError` itself when a check of a
    jax_ep op inside it fails, and `jax_ep.PeerTimeoutError` when a wait of a jax_ep op gave up
    (in this call or before), instead of the `jax.errors.JaxRuntimeError` that JAX reports or
    the poisoned results (NaN, -1) of an op that gave up. Waits for fn's results (so that a
    failure surfaces in this call).

    Args:
      fn: any callable whose jax_ep ops should raise typed errors, usually the jitted step.

    Returns:
      A callable with fn's signature that returns fn's results once they are ready.

    Raises (from the returned callable):
      CheckError: a `check=True` (or JAX_EP_CHECK=1) check inside fn failed.
      PeerTimeoutError: a jax_ep wait of this process gave up. The results of the op that gave
        up are NaN (floats) and -1 (ints) then (docs/API.md#timeouts): without this wrapper,
        or `raise_if_timed_out` after the results are ready, a step would go on with them.
    """
    from jax_ep._faults import raise_if_timed_out, timeout_error

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            out = jax.block_until_ready(fn(*args, **kwargs))
        except Exception as e:  # JaxRuntimeError; under vmap JAX may report it as ValueError
            err = find_check_error(str(e))
            if err is not None:
                _forget_failed_checks()
            elif "DEADLINE_EXCEEDED" in str(e) and "jax_ep" in str(e):
                err = timeout_error()  # a jax_ep op refused to run after a wait gave up
            elif (timeout := timeout_error()) is not None and str(timeout) in str(e):
                err = timeout  # a check found the poisoned counts of an op that gave up
            if err is None:
                raise
            raise err from e
        raise_if_timed_out()
        return out
    return wrapper
