"""Per-process mode: one JAX process per GPU under `jax.distributed`, peers through NVSHMEM.

Bootstrap (no MPI): process 0 makes an NVSHMEM unique id with nvshmem4py and puts its bytes in
`jax.distributed`'s key-value store; every process reads it and initialises NVSHMEM with
rank = jax.process_index(), so an NVSHMEM PE is a JAX process index. The extension then attaches
(registers its own NVSHMEM device state with the host library nvshmem4py loaded, allocates and
zeroes the symmetric arena) and runs a collective self-test kernel that calls NVSHMEM device
functions. Teardown at exit: one NVSHMEM finalize, skipped (with a note) if it does not finish
within the timeout, e.g. because a peer died.

Settings (every process the same): JAX_EP_SYMMETRIC_BYTES (arena, default 4 GiB; holds the
workspaces, the low-latency receive buffers and the high-throughput staging buffers);
NVSHMEM_SYMMETRIC_SIZE is set to the arena plus 512 MiB unless already set.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import threading

from jax_ep import config

_state: dict = {"attached": False, "self_test": None, "finalized": False}
_lock = threading.Lock()
_UID_BYTES = 128  # sizeof(nvshmemx_uniqueid_t)
_KV_KEY = "jax_ep/nvshmem_uid"


def _parse_bytes(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("G", 1 << 30),
                         ("M", 1 << 20), ("K", 1 << 10)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def arena_bytes() -> int:
    v = config.raw("JAX_EP_SYMMETRIC_BYTES")
    try:
        return _parse_bytes(v)
    except ValueError:
        raise ValueError(f"JAX_EP_SYMMETRIC_BYTES={v!r}: expected a size such as 4GiB, 512M "
                         "or 1073741824") from None


def attached() -> bool:
    return _state["attached"]


def _kv_client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax_ep: several JAX processes but no jax.distributed client: call "
            "jax.distributed.initialize() first (python -m jax_ep.launch does it)")
    return client


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem_core  # nvshmem4py
    except ImportError as e:
        raise RuntimeError(
            "jax_ep: one process per GPU needs nvshmem4py: pip install 'jax_ep[cuda13]' (or "
            f"[cuda12]), i.e. nvshmem4py-cu13 / -cu12 ({e})") from e
    return nvshmem_core


def _share_unique_id(nvshmem_core, rank: int, timeout_s: float):
    """Unique id from process 0 to everyone, through the jax.distributed key-value store."""
    client = _kv_client()
    if rank == 0:
        uid = nvshmem_core.get_unique_id()
        client.key_value_set_bytes(_KV_KEY, ctypes.string_at(uid.ptr, _UID_BYTES))
        return uid
    raw = client.blocking_key_value_get_bytes(_KV_KEY, int(timeout_s * 1000))
    if len(raw) != _UID_BYTES:
        raise RuntimeError(f"jax_ep: NVSHMEM unique id of {len(raw)} bytes, expected {_UID_BYTES}")
    uid = nvshmem_core.get_unique_id(empty=True)
    ctypes.memmove(uid.ptr, raw, _UID_BYTES)
    return uid


def _arrive(what: str, timeout_s: float) -> None:
    """Wait until every process reaches `what` (a barrier of jax.distributed's coordination
    service), at most timeout_s. NVSHMEM's collective set-up has no timeout of its own: a process
    that never gets there (it died, or runs no jax_ep op) would hold the others in it forever.
    Raises RuntimeError naming the processes that did not arrive."""
    import jax

    client = _kv_client()
    rank, n = jax.process_index(), jax.process_count()
    prefix = f"jax_ep/arrived/{what}/"
    client.key_value_set(prefix + str(rank), "1")
    try:
        client.wait_at_barrier(f"jax_ep/{what}", int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the coordination service's timeout error
        try:
            arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(prefix)}
        except Exception:  # noqa: BLE001 - the store itself may be gone
            arrived = {rank}
        missing = sorted(set(range(n)) - arrived)
        raise RuntimeError(
            f"jax_ep: process {rank} waited {timeout_s:.0f} s for the others to set up jax_ep "
            f"({what}); process(es) {missing or 'unknown'} did not arrive. Every process must "
            "set up jax_ep at the same point (jax_ep.initialize(), or its first jax_ep op); one "
            "that died, or is still busy (a long checkpoint, a slow compile), holds the others "
            "here. JAX_EP_TIMEOUT_S sets the limit.") from e


def _debug(msg: str) -> None:
    """JAX_EP_DEBUG=1: where the set-up is (a failing transport aborts without saying)."""
    if config.flag("JAX_EP_DEBUG"):
        import sys

        print(f"jax_ep debug: {msg}", file=sys.stderr, flush=True)


def _nvshmem_already_initialized() -> bool:
    """True when this process already initialised NVSHMEM (the user's own nvshmem4py code)."""
    try:
        lib = ctypes.CDLL("libnvshmem_host.so.3", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False
    # NVSHMEM_STATUS_IS_INITIALIZED = 2 (nvshmem_constants.h); higher values are MPG modes.
    return int(lib.nvshmemx_init_status()) >= 2


def initialize(ext, timeout_s: float) -> dict:
    """Initialise NVSHMEM (unless already done in this process) and attach the extension."""
    import jax

    with _lock:
        if _state["attached"]:
            return _state["self_test"]
        if not ext.nvshmem_built():
            raise NotImplementedError(
                "jax_ep: this build has no per-process (NVSHMEM) transport: rebuild with the "
                "nvidia-nvshmem wheel installed (pip install --no-build-isolation "
                "'.[cuda13]'), or run one process over all GPUs of the node")
        local = jax.local_devices()
        if len(local) != 1:
            raise NotImplementedError(
                f"jax_ep: {jax.process_count()} processes with {len(local)} GPUs each: the "
                "per-process mode needs exactly one GPU per process (python -m jax_ep.launch "
                "starts one per GPU), or use one process for all GPUs of a node")
        device = int(local[0].local_hardware_id)
        ext.cuda_set_device(device)
        arena = arena_bytes()
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(arena + (512 << 20)))
        # NVLink multicast (NVLS) stays off: a program that uses it can take a shared host's
        # GPUs out of service, and the peer transport does not need it.
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        nvshmem_core = _import_nvshmem()
        # Everyone here before any collective step (NVSHMEM init, the arena, the self-test).
        _arrive("setup", timeout_s)
        if not _nvshmem_already_initialized():
            rank, n = jax.process_index(), jax.process_count()
            uid = _share_unique_id(nvshmem_core, rank, timeout_s)
            try:
                from cuda.core import Device  # cuda.core >= 0.5
            except ImportError:  # pragma: no cover
                from cuda.core.experimental import Device  # type: ignore
            dev = Device(device)
            dev.set_current()
            _debug(f"process {rank}: NVSHMEM init")
            nvshmem_core.init(device=dev, uid=uid, rank=rank, nranks=n,
                              initializer_method="uid")
            _debug(f"process {rank}: NVSHMEM initialised")
            atexit.register(_finalize, nvshmem_core, timeout_s)
        if config.flag("JAX_EP_DEBUG"):
            ext.debug_segv_backtrace()
        ext.sym_attach(arena)
        _debug("arena attached; self-test")
        pe, npes, got, want, mapped = (int(v) for v in ext.sym_self_test())
        result = {"pe": pe, "n_pes": npes, "token": got, "token_expected": want,
                  "next_pe_mapped": bool(mapped)}
        if pe != jax.process_index() or npes != jax.process_count() or got != want:
            raise RuntimeError(
                "jax_ep: NVSHMEM self-test failed: kernel saw PE %d of %d (process %d of %d), "
                "received %d (expected %d)" % (pe, npes, jax.process_index(),
                                               jax.process_count(), got, want))
        _state["attached"] = True
        _state["self_test"] = result
        return result


def _finalize(nvshmem_core, timeout_s: float) -> None:
    """NVSHMEM finalize at exit; a dead peer must not turn it into a hang."""
    if _state["finalized"]:
        return
    _state["finalized"] = True
    done = threading.Event()

    def run():
        try:
            nvshmem_core.finalize()
        except Exception:  # noqa: BLE001 - exit path: nothing to raise to
            pass
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if not done.wait(timeout_s):
        import sys

        print("jax_ep: NVSHMEM finalize did not finish within %.0f s (a peer gone?); exiting "
              "without it" % timeout_s, file=sys.stderr, flush=True)
        os._exit(1)
