"""Multi-rank runs for tests: the R ranks of an EP axis on R GPUs, or on one GPU.

The one-GPU multi-rank mode runs R "virtual ranks" of the real CUDA kernels on a single device:
each rank has its own workspace and buffers there, the peer tables point at them, and one
custom call launches every rank's kernels on a stream of its own, after checking that all R
grids can be resident together (they wait on each other). Only the peer table and the launch
differ from R GPUs; the device code is the production code. It is `jax.vmap` over the EP axis:
a jax_ep op under `vmap(..., axis_name=<its axis_name>)` on one device runs that way, and so
does the reference backend, so both can be compared in one program.

What it proves and what it cannot: docs/testing.md.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jax_ep import config, runtime

__all__ = ["virtual_ranks", "run_ranks", "use_virtual_ranks", "absent_ranks"]


def virtual_ranks(fn, num_ranks: int, *, axis_name: str = "ep"):
    """`fn` (a per-rank body, as given to `shard_map`) as `num_ranks` ranks on one device.

    The returned function takes and returns pytrees of arrays stacked over the ranks: leaf
    `[R, ...]` is rank r's value at index r. Take gradients inside `fn` (each rank's gradient
    is that of the sum over ranks, as inside `shard_map`). Unless the block count was chosen
    (`jax_ep.set_num_blocks`, JAX_EP_NUM_SMS), each rank's kernels get their share of the SMs;
    a count whose R grids cannot be resident together raises an error naming it.
    """
    R = int(num_ranks)
    top = runtime.max_ranks()   # None without the extension: the reference has no limit
    if not 1 <= R <= (top or R):
        raise ValueError(f"num_ranks={num_ranks}: the one-GPU multi-rank mode runs 1 to "
                         f"{top if top else 'any number of'} ranks")
    vfn = jax.vmap(fn, axis_name=axis_name, axis_size=R)

    @functools.wraps(fn)
    def run(*args):
        # The R grids share one device: unless the block count was chosen (set_num_blocks,
        # JAX_EP_NUM_SMS), each rank's bandwidth kernels default to its share of the SMs.
        ext = runtime.extension()
        if ext is None or not runtime.num_blocks_is_default():
            return vfn(*args)
        share = max(1, ext.device_sm_count(runtime.current_cuda_device()) // R)
        with runtime.default_num_blocks(min(runtime.num_blocks(), share)):
            return vfn(*args)

    return run


def use_virtual_ranks(num_ranks: int) -> bool:
    """Whether `run_ranks` uses virtual ranks: fewer GPUs than ranks, or JAX_EP_VIRTUAL_RANKS=1
    (JAX_EP_VIRTUAL_RANKS=0 never)."""
    forced = config.raw("JAX_EP_VIRTUAL_RANKS")
    if forced not in ("", "0", "1"):
        raise ValueError(f"JAX_EP_VIRTUAL_RANKS={forced!r}: expected 0 or 1")
    if forced:
        return forced == "1"
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    return bool(gpus) and len(gpus) < int(num_ranks)


def run_ranks(fn, num_ranks: int, *, axis_name: str = "ep"):
    """`fn` over `num_ranks` ranks with stacked inputs and outputs (leaves `[R, ...]`), jitted.

    On R devices of the default backend when there are that many (`shard_map` over a mesh of
    the first R), else as virtual ranks on the first device (see `use_virtual_ranks`).
    """
    R = int(num_ranks)
    if use_virtual_ranks(R):
        return jax.jit(virtual_ranks(fn, R, axis_name=axis_name))
    devices = jax.devices()
    if len(devices) < R:
        raise ValueError(f"run_ranks: {R} ranks need {R} devices, have {len(devices)}")
    mesh = Mesh(np.array(devices[:R]), (axis_name,))

    def body(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name),
                                 check_vma=False))


@contextlib.contextmanager
def absent_ranks(ranks):
    """Within the block, the given virtual ranks do not run jax_ep's communication ops, as if
    their process had stopped before them: the other ranks' waits give up after
    JAX_EP_TIMEOUT_S (see `jax_ep.PeerTimeoutError`). Read when an op runs, so run the program
    inside the block. CUDA backend, one-GPU multi-rank mode only (the reference never waits).
    Once a wait gave up, every communication op of the process fails: run this in a process of
    its own."""
    top = runtime.max_ranks()  # the extension's rank limit (None without it)
    mask = 0
    for r in ranks:
        if (isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0
                or (top is not None and r >= top)):
            raise ValueError(f"absent_ranks: rank {r!r} is not an int in [0, {top or 'R'})")
        mask |= 1 << int(r)
    ext = runtime.extension()
    if ext is None:
        raise RuntimeError("absent_ranks needs the CUDA extension (the reference never waits)")
    ext.set_absent_virtual_ranks(mask)
    try:
        yield
    finally:
        ext.set_absent_virtual_ranks(0)
