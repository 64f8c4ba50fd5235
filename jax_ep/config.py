"""Every `JAX_EP_*` environment setting in one place: its name, default, meaning, when it is
read, and whether every rank must see the same value.

Settings that change what a kernel does are read when a call is traced or lowered and become
attributes of its custom call: they are then in the HLO (and the compilation-cache key), the
same for every rank of that program, and never read again at run time.
`jax_ep.config.describe()` prints the table; docs/API.md lists the user-facing ones.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple


class Setting(NamedTuple):
    name: str
    default: str
    meaning: str
    read: str                  # when: "trace", "trace (attribute)", "lowering (attribute)",
    #                            "start-up", "tests"
    same_on_every_rank: bool


SETTINGS = {s.name: s for s in (
    Setting("JAX_EP_TIMEOUT_S", "600",
            "seconds an in-kernel wait for a peer (and the per-process set-up's wait for the "
            "other processes) lasts before giving up; generous, as a slow peer is normal",
            "lowering (attribute)", False),
    Setting("JAX_EP_NUM_SMS", "32",
            "SMs (one thread block each) of the high-throughput communication kernels "
            "(jax_ep.set_num_blocks overrides it)", "trace", False),
    Setting("JAX_EP_CHECK", "0",
            "1: check=None means check=True (raise on invalid expert ids or dropped tokens)",
            "trace", True),
    Setting("JAX_EP_LL_PREREDUCE", "1",
            "0: the low-latency combine sends one row per (token, expert), no partial sums",
            "trace (attribute)", True),
    Setting("JAX_EP_FUSED_BACKWARD", "1",
            "0: moe_ffn(fused=True)'s backward runs the unfused ops instead of the fused kernels "
            "(docs/kernels.md#fused-backward): an A/B switch, the same results",
            "trace", True),
    Setting("JAX_EP_LL_DIAG", "0",
            "1: the low-latency kernels record per-warp timestamps (benchmarks/trace_phases.py)",
            "trace (attribute)", False),
    Setting("JAX_EP_VIRTUAL_RANKS", "",
            "jax_ep.testing.run_ranks: 1 forces virtual ranks on one GPU, 0 forbids them",
            "tests", False),
    Setting("JAX_EP_SYMMETRIC_BYTES", "4GiB",
            "per-process mode: bytes of the NVSHMEM arena for workspaces and buffers",
            "start-up", True),
    Setting("JAX_EP_DEBUG", "",
            "per-process mode: 1 logs the start-up steps", "start-up", False),
    Setting("JAX_EP_FORCE_REMOTE_PEERS", "",
            "per-process mode, tests: 1 treats every peer as remote (NVSHMEM puts and gets); "
            "read by the extension when it attaches", "start-up", True),
    Setting("JAX_EP_DEBUG_REMOTE", "",
            "per-process mode: 1 makes the remote-peer kernels print what they move; read by "
            "the extension", "start-up", False),
)}


def raw(name: str) -> str:
    """The setting's value as given (its default when unset or empty)."""
    return os.environ.get(name) or SETTINGS[name].default


def is_set(name: str) -> bool:
    return name in os.environ


_TRUE, _FALSE = ("1", "true", "True"), ("0", "false", "False", "")


def flag(name: str) -> bool:
    """A 0/1 setting (also true / false); ValueError naming the setting for anything else."""
    v = raw(name)
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(f"{name}={v!r}: expected 0 or 1 ({SETTINGS[name].meaning})")


def seconds(name: str) -> float:
    """A finite number of seconds above 0; ValueError naming the setting otherwise."""
    v = raw(name)
    try:
        s = float(v)
    except ValueError:
        s = math.nan
    if not (0 < s < math.inf) or s * 1e9 >= 2**63:
        raise ValueError(f"{name}={v!r}: expected a finite number of seconds > 0 (default "
                         f"{SETTINGS[name].default}: {SETTINGS[name].meaning})")
    return s


def int_in(name: str, lo: int, hi: int) -> int:
    v = raw(name)
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"{name}={v!r}: expected an integer in [{lo}, {hi}] "
                         f"({SETTINGS[name].meaning})")
    return n


def describe() -> str:
    """The table of settings: name, default, when read, same on every rank, meaning."""
    rows = [f"{s.name:<26} {s.default or '(unset)':<8} {s.read:<21} "
            f"{'same on every rank' if s.same_on_every_rank else '':<19} {s.meaning}"
            for s in SETTINGS.values()]
    return "\n".join(rows)
