"""Process mode, peers, buffers and settings of the CUDA backend; `runtime_info()`.

One process driving all GPUs of a node: each device gets a small workspace (flags and published
addresses, see csrc/runtime/workspace.h) and peer access to the others. High-throughput kernels
read their peers' XLA buffers directly (no data buffers). Low-latency kernels push into receive
buffers of their call site, sized from the op's static shapes by the extension
(jax_ep._C.ll_dispatch_buffer_bytes and friends). Each call site of a compiled program leases
its workspace slot and buffers while the program lives (csrc/runtime/lease.h).

One process per GPU (jax.distributed): the same kernels, with workspaces and buffers in the
NVSHMEM symmetric heap and peers addressed through nvshmem_ptr (jax_ep/per_process.py,
csrc/nvshmem/symmetric.h). The group tables then name JAX process indices (= NVSHMEM PEs), and
high-throughput operands are staged through symmetric buffers, since a peer process cannot read
this process's XLA buffers.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from typing import TYPE_CHECKING

from jax_ep import config

if TYPE_CHECKING:  # jax itself is imported where it is used (python -m jax_ep.launch)
    from collections.abc import Sequence

    import jax

_lock = threading.Lock()
_ext = None
_ext_error: str | None = None
_ext_loaded = False
_warned = False
_site_counter = itertools.count(1)
_num_blocks: int | None = None


def _load_extension():
    global _ext, _ext_error, _ext_loaded
    if not _ext_loaded:
        _ext_loaded = True
        try:
            from jax_ep import _C  # type: ignore[attr-defined]

            _ext = _C
        except ImportError as e:  # built without nvcc, or not built at all
            _ext_error = str(e)
    return _ext


def extension():
    """The compiled module jax_ep._C, or None when the package was installed without CUDA."""
    return _load_extension()


def cuda_build() -> str | None:
    """What the install chose for the CUDA build: "built", "off" (JAX_EP_BUILD_CUDA=OFF),
    "no_nvcc" (no CUDA compiler found), or None (not installed by the build, e.g. a source
    tree on sys.path). Recorded at build time in jax_ep/_build_info.py."""
    try:
        from jax_ep import _build_info  # type: ignore[attr-defined]
    except ImportError:
        return None
    return getattr(_build_info, "CUDA_BUILD", None)


def _missing_extension_notice() -> str:
    build = cuda_build()
    if build == "built":
        return (f"jax_ep: the CUDA extension was built but does not load ({_ext_error}); "
                "using the pure-JAX reference backend.")
    why = {
        "off": "the CUDA build was switched off at install: JAX_EP_BUILD_CUDA=OFF",
        "no_nvcc": "the install found no CUDA compiler (nvcc)",
    }.get(build, "not installed with pip, or installed without nvcc")
    return (f"jax_ep: the CUDA extension is not built ({why}); "
            "using the pure-JAX reference backend.")


def cuda_backend_available() -> bool:
    """True when the CUDA extension is built and JAX's default backend is a CUDA GPU."""
    global _warned
    ext = _load_extension()
    if ext is None:
        if not _warned:
            _warned = True
            warnings.warn(_missing_extension_notice(), stacklevel=3)
        return False
    import jax

    try:
        return jax.default_backend() == "gpu" and any(
            "cuda" in d.client.platform_version.lower() or d.platform == "gpu"
            for d in jax.local_devices()[:1])
    except RuntimeError:
        return False


def current_cuda_device() -> int:
    """CUDA ordinal of this process's first local JAX device (what trace-time size queries of
    the extension ask about)."""
    import jax

    d = jax.local_devices()[0]
    return int(d.local_hardware_id if d.local_hardware_id is not None else d.id)


def timeout_ns() -> int:
    """Wait limit of every in-kernel wait (JAX_EP_TIMEOUT_S, default 600 s).

    Raises ValueError naming the variable for a value that is not a finite number of seconds
    above 0 (a zero, negative, inf or NaN limit would make every wait fail, or none)."""
    return int(config.seconds("JAX_EP_TIMEOUT_S") * 1e9)


def set_num_blocks(n: int | None) -> None:
    """How many SMs (one thread block each) the high-throughput communication kernels take.

    The default is JAX_EP_NUM_SMS, else 32. Takes effect for functions traced afterwards.
    More blocks can speed up an op that runs alone; fewer leave more of the GPU to work that
    runs at the same time (docs/API.md, "Backends and runtime").

    Args:
      n: the block count, 1 to the extension's maximum; None restores the default.

    Raises:
      ValueError: n outside that range.
    """
    global _num_blocks
    hi = max_num_blocks()
    if n is not None and not 1 <= int(n) <= hi:
        raise ValueError(f"num_blocks must be in [1, {hi}], got {n}")
    _num_blocks = None if n is None else int(n)


def max_num_blocks() -> int:
    """The largest block count the kernels take (the extension defines it)."""
    return limits().get("max_num_blocks", 1 << 30)


def num_blocks() -> int:
    if _num_blocks is not None:
        return _num_blocks
    if not config.is_set("JAX_EP_NUM_SMS"):
        return _default_num_blocks
    return config.int_in("JAX_EP_NUM_SMS", 1, max_num_blocks())


_default_num_blocks = 32


def num_blocks_is_default() -> bool:
    """True when neither set_num_blocks nor JAX_EP_NUM_SMS chose the block count."""
    return _num_blocks is None and not config.is_set("JAX_EP_NUM_SMS")


@contextlib.contextmanager
def default_num_blocks(n: int):
    """The default block count of calls traced inside (the one-GPU multi-rank mode's share)."""
    global _default_num_blocks
    prev, _default_num_blocks = _default_num_blocks, int(n)
    try:
        yield
    finally:
        _default_num_blocks = prev


def check_enabled(check: bool | None) -> bool:
    if check is not None:
        return bool(check)
    return config.flag("JAX_EP_CHECK")


def new_site() -> int:
    """A new call-site id: the key of the call site's lease (its workspace slot and buffers,
    csrc/runtime/lease.h). Only an identity within this process: the slot itself is taken when
    an executable holding the call site is built, and given back when it is destroyed."""
    with _lock:
        return next(_site_counter)


_pair_sites: dict = {}


def site_for_pair(kind: str, pair) -> int:
    """The call-site id of the split sends keyed `pair` (of one kind; the user's name with the
    op's static layout): every send with that key shares one lease, so their pendings have one
    structure (a pending may then be carried across `lax.scan` iterations: the send before the
    loop and the one in its body)."""
    with _lock:
        key = (kind, pair)
        if key not in _pair_sites:
            _pair_sites[key] = next(_site_counter)
        return _pair_sites[key]


def limits() -> dict:
    """The sizes the CUDA kernels serve, as the extension defines them: `max_ranks` (ranks of
    an EP group), `max_local_experts` (experts per rank of the low-latency ops) and
    `max_layout_ranks` (`get_dispatch_layout`'s num_ranks). The ops check them at trace time
    on every backend, so a program that runs on the reference runs on the kernels. Empty
    without the extension (the reference alone has no such limits)."""
    ext = _load_extension()
    if ext is None:
        return {}
    got = {k: getattr(ext, k, None) for k in ("max_ranks", "max_local_experts",
                                              "max_layout_ranks", "max_num_blocks")}
    return {k: int(v) for k, v in got.items() if v is not None}   # an older build: fewer


def max_ranks():
    """The largest EP group the kernels serve (None without the extension)."""
    return limits().get("max_ranks")


def poison_int() -> int | None:
    """The value of every int32 result of an op whose wait gave up (every floating result is
    NaN), as the extension defines it (`jax_ep._C.poison_int`); None without the extension.
    docs/API.md#timeouts."""
    ext = _load_extension()
    v = None if ext is None else getattr(ext, "poison_int", None)
    return None if v is None else int(v)


def per_process() -> bool:
    """True when JAX runs several processes: the per-process (NVSHMEM) transport is used."""
    import jax

    return jax.process_count() > 1


def member_id(device) -> int:
    """The entry of a JAX device in the EP group tables of this process mode: its process
    index (= NVSHMEM PE) with several processes, else its CUDA ordinal. (The one-GPU
    multi-rank mode's tables name virtual ids instead: `_C.virtual_id`.)"""
    if per_process():
        return int(device.process_index)
    return int(device.local_hardware_id if device.local_hardware_id is not None else device.id)


def ensure_peer_runtime(devices, groups=None) -> None:
    """Workspaces and peer access for these EP groups (idempotent).

    devices: the jax devices involved; groups: [num_groups, R] group-table entries (default:
    all devices as one group, `member_id` of each). With several processes, NVSHMEM is
    initialised first (the per-process mode). The extension's process mode makes the
    workspaces (csrc/runtime/mode.h).
    """
    ext = _load_extension()
    if ext is None:
        raise RuntimeError("jax_ep: backend='cuda' needs the CUDA extension, which is not built")
    if per_process():
        from jax_ep import per_process as pp

        pp.initialize(ext, timeout_ns() / 1e9)
    if groups is None:
        groups = [[member_id(d) for d in devices]]
    with _lock:
        ext.init_groups([[int(v) for v in g] for g in groups])


def initialize(devices: Sequence[jax.Device] | None = None) -> None:
    """Set up the runtime ahead of time (optional: the first lowered op does it lazily).

    One process: workspaces and peer access on `devices` (default: all local GPUs). Several
    processes (after jax.distributed.initialize, one GPU each): NVSHMEM through nvshmem4py with a
    unique id shared over jax.distributed's key-value store, the symmetric arena and a self-test
    kernel (collective: every process must call it, or lower its first op).

    Args:
      devices: the GPUs of the EP groups; default `jax.local_devices()` in one process,
        `jax.devices()` with several.

    Raises:
      RuntimeError: the CUDA extension is not built (the reference backend needs no set-up).
    """
    import jax

    if devices is None:
        devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
    ensure_peer_runtime(devices)


def _process_mode(ext) -> str:
    import jax

    n = jax.process_count()
    cuda = ext is not None and jax.default_backend() == "gpu"
    if n == 1:
        return "one process, all local GPUs (peer access)" if cuda else \
            "one process (reference backend)"
    return f"{n} processes, one GPU each (NVSHMEM)" if cuda else \
        f"{n} processes (reference backend)"


def runtime_info() -> dict:
    """Which backend and process mode is in use, the peers and the buffer sizes.

    Returns:
      A dict, for logs and bug reports: `extension_built`, `extension_error`, `jax_backend`,
      `default_backend` ("cuda" or "reference": what backend="auto" picks), `process_mode`,
      `timeout_s` (JAX_EP_TIMEOUT_S), `num_blocks`; with the extension also the peer devices,
      EP groups, workspace and call-site buffer sizes, leases and slots.
    """
    import jax

    ext = _load_extension()
    info = {
        "extension_built": ext is not None,
        "cuda_build": cuda_build(),
        "extension_error": _ext_error,
        "jax_backend": jax.default_backend(),
        "default_backend": "cuda" if (ext is not None and jax.default_backend() == "gpu")
        else "reference",
        "process_mode": _process_mode(ext),
        "timeout_s": timeout_ns() / 1e9,
        "num_blocks": num_blocks(),
    }
    if ext is not None:
        info.update({
            "peer_devices": list(ext.runtime_devices()),
            "ep_groups": int(ext.runtime_num_groups()),
            "workspace_bytes_per_device_per_group": int(ext.workspace_bytes()),
            "call_site_buffer_bytes_per_device": {
                int(d): int(ext.lease_buffer_bytes(int(d))) for d in ext.runtime_devices()},
            "call_site_leases": dict(ext.lease_stats()),
            "num_slots": int(ext.num_slots),
            "nvshmem_built": bool(ext.nvshmem_built()),
            "max_ranks": int(ext.max_ranks),
        })
        if ext.sym_active():
            from jax_ep import per_process as pp

            info.update({
                "nvshmem_pe": int(ext.sym_my_pe()),
                "nvshmem_n_pes": int(ext.sym_n_pes()),
                "symmetric_arena_bytes": int(ext.sym_arena_bytes()),
                "symmetric_arena_used": int(ext.sym_arena_used()),
                "nvshmem_self_test": pp._state["self_test"],
                # Peers without load/store access: their data moves by NVSHMEM puts and gets
                # (JAX_EP_FORCE_REMOTE_PEERS=1 makes every other PE one, for testing).
                "nvshmem_remote_pes": [int(v) for v in ext.sym_remote_pes()],
            })
    return info


def phase_traces(group, device) -> dict[int, list[int]]:
    """Diagnostic: phase timestamps (ns, %globaltimer) of the last call on each slot.

    group: the EP group's CUDA ordinals in axis order (as the lowering uses them, see
    jax_ep._ffi.group_table: `[d.local_hardware_id for d in mesh devices]`); device: the CUDA
    ordinal to read. Run an op, block on its result, then call this: it returns
    {slot: [trace_slots timestamps]} for the slots with any non-zero mark. The mark indices are
    named in csrc/transport/trace_marks.h; a mark the last call did not reach keeps
    an older call's value, and 0 means never written. Synchronous device reads: not for hot paths.
    """
    ext = _load_extension()
    if ext is None:
        raise RuntimeError("jax_ep: phase_traces needs the CUDA extension, which is not built")
    vals = list(ext.read_traces([int(v) for v in group], int(device)))
    n = int(ext.trace_slots)
    out = {}
    for s in range(len(vals) // n):
        row = [int(v) for v in vals[s * n:(s + 1) * n]]
        if any(row):
            out[s] = row
    return out
