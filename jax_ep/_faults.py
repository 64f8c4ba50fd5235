"""Waits that gave up: `jax_ep.PeerTimeoutError` and `jax_ep.raise_if_timed_out`.

A kernel wait that passes JAX_EP_TIMEOUT_S does not trap: it records why (op, rank, phase, the
peer it waited for), the op's kernels end, and the CUDA context stays usable. The op's results
are poisoned (floats NaN, ints -1). From then on every communication op of the process fails
when it runs, with the same message. docs/API.md#timeouts says what to do then;
docs/design.md#clean-timeouts says how it works.
"""
from __future__ import annotations

from jax_ep import runtime


class PeerTimeoutError(RuntimeError):
    """A jax_ep wait gave up: a peer did not arrive within JAX_EP_TIMEOUT_S.

    Attributes: `op` (e.g. "ll_dispatch"), `rank` and `num_ranks` (the waiting rank of its EP
    group), `peer` (the rank it waited for, -1 when not known), `phase` (the wait, "<op>: ..."),
    `timeout_s`, `setting` ("JAX_EP_TIMEOUT_S"), `records` (every device's record)."""

    setting = "JAX_EP_TIMEOUT_S"

    def __init__(self, message: str, records: list[dict]):
        super().__init__(message)
        first = records[0] if records else {}
        self.records = records
        self.phase = first.get("phase", "")
        self.op = self.phase.split(":", 1)[0] if self.phase else ""
        self.rank = first.get("rank", -1)
        self.num_ranks = first.get("num_ranks", 0)
        self.peer = first.get("peer", -1)
        self.timeout_s = first.get("timeout_ns", 0) / 1e9


def timeout_error() -> PeerTimeoutError | None:
    """The error of a wait of this process that gave up, or None (also without the extension).
    Reads host memory only: it neither waits for nor synchronises with the device."""
    ext = runtime.extension()
    if ext is None:
        return None
    message = ext.fault_message()
    if not message:
        return None
    return PeerTimeoutError(message, [dict(r) for r in ext.fault_records()])


def raise_if_timed_out() -> None:
    """Raise `jax_ep.PeerTimeoutError` when a jax_ep wait of this process gave up.

    The results of an op whose wait gave up are poisoned: every floating result is NaN and
    every int32 result -1 (`jax_ep.runtime.poison_int()`), so that no step goes on with plausible
    numbers. A wait gives up on the device while the program runs, so call this after the
    step's results are ready (`jax.block_until_ready`); `jax_ep.checked(step)` does both. Every
    later communication op raises anyway.

    Raises:
      PeerTimeoutError: a wait of this process gave up (op, rank, peer and phase in its
        attributes). Nothing is raised otherwise, nor without the CUDA extension.
    """
    err = timeout_error()
    if err is not None:
        raise err
