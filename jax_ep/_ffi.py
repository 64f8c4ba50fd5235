"""The custom-call primitive behind every CUDA op: shape rule, lowering and registration.

One primitive serves all targets. Its lowering adds what only the lowering knows: the EP group
table (CUDA device ordinals of every group along `axis_name`, from the enclosing shard_map's
mesh, in the flat device order the executable is compiled for) and a call-site id (`site`),
and makes sure the peer runtime covers those devices. Nothing is allocated here: each call site
leases its workspace slot and buffers in the handlers' instantiate stage, once per compiled
executable, and gives them back when the executable is destroyed (csrc/runtime/lease.h). Calls
are marked side-effecting so XLA never merges or drops them.

Under `jax.vmap` over the op's EP axis (one device, no shard_map) a call becomes the one-GPU
multi-rank mode: the same handler body over R virtual ranks (target name + "_vr", operands and
results stacked over the ranks, docs/testing.md).
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import batching
from jax.interpreters import mlir

from jax_ep import runtime

from jax.extend.core import Primitive

ep_call_p = Primitive("jax_ep_call")
ep_call_p.multiple_results = True

_registered = False


def _register_targets():
    global _registered
    if _registered:
        return
    ext = runtime.extension()
    if ext is None:
        raise RuntimeError("jax_ep: the CUDA extension is not built")
    # The call-site state type first: the stateful handlers name it.
    jax.ffi.register_ffi_type(ext.site_state_type_name, ext.site_state_type(), platform="CUDA")
    for name, handler in ext.registrations().items():
        jax.ffi.register_ffi_target(name, handler, platform="CUDA")
    _registered = True


def _abstract_eval(*avals, target, out_types, attrs, axis_name, has_groups, pure, vranks,
                   aliases):
    del target, attrs, axis_name, has_groups, pure, vranks, aliases
    core.standard_vma_rule("jax_ep_call", *avals)
    base = avals[0]
    sharding = core.get_cur_mesh_sharding()
    return [base.update(shape=tuple(s), dtype=np.dtype(d), weak_type=False, sharding=sharding)
            for s, d in out_types]


ep_call_p.def_abstract_eval(_abstract_eval)


def group_table(mesh, axis_name) -> np.ndarray:
    """[num_groups, R]: every EP group along `axis_name`, in axis order.

    One process: CUDA device ordinals. Several processes (one GPU each): process indices, which
    are the NVSHMEM PEs.
    """
    names = list(mesh.axis_names)
    if axis_name not in names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {names}")
    devs = np.asarray(mesh.devices)
    devs = np.moveaxis(devs, names.index(axis_name), -1)
    ids = np.vectorize(runtime.member_id)(devs)
    return ids.reshape(-1, devs.shape[-1]).astype(np.int64)


# Pull ops (high-throughput): how many leading operands their peers read (the `ptrs` each op
# publishes; csrc/ffi/high_throughput.cc stage_operands stages the same ones).
def _stage_bytes(ext, target, avals) -> int:
    """Per-process mode: bytes of the staging buffer of a pull op (the extension's rule)."""
    n = ext.ht_staged_operands[target]
    return ext.ht_stage_bytes([int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
                               for a in avals[:n]])


def _lowering_device(ctx) -> int:
    """CUDA ordinal of the device a one-device computation is compiled for."""
    assignment = getattr(ctx.module_context.axis_context, "device_assignment", None)
    if assignment:
        if len(assignment) != 1:
            raise ValueError("jax_ep: the one-GPU multi-rank mode (jax.vmap over the EP axis) "
                             f"runs on one device; this computation spans {len(assignment)}")
        d = assignment[0]
        return int(d.local_hardware_id if d.local_hardware_id is not None else d.id)
    return runtime.current_cuda_device()


def _lowering(ctx, *args, target, out_types, attrs, axis_name, has_groups, pure, vranks,
              aliases):
    del out_types
    _register_targets()
    kwargs = dict(attrs)
    ext = runtime.extension()
    if has_groups and vranks:
        # One-GPU multi-rank mode: the group is `vranks` virtual ranks on this device, each with
        # its own workspace and buffers; the `_vr` handler runs them all (docs/testing.md).
        if runtime.per_process():
            raise ValueError("jax_ep: the one-GPU multi-rank mode (jax.vmap over the EP axis) "
                             "runs in one process")
        dev = _lowering_device(ctx)
        table = np.asarray([[ext.virtual_id(dev, r) for r in range(vranks)]], np.int64)
        runtime.ensure_peer_runtime([], table)
    elif has_groups:
        mesh = getattr(ctx.module_context.axis_context, "mesh", None)
        if mesh is None or not hasattr(mesh, "devices"):
            raise ValueError(
                "jax_ep: the CUDA backend runs inside jax.shard_map over a concrete Mesh, or "
                "under jax.vmap over the EP axis on one device (the one-GPU multi-rank mode) "
                f"(no mesh found while lowering {target})")
        table = group_table(mesh, axis_name)
        runtime.ensure_peer_runtime(list(np.asarray(mesh.devices).flat), table)
    if has_groups:
        kwargs["groups"] = table.reshape(-1)
        kwargs["group_size"] = np.int64(table.shape[1])
        # The call site's identity: its lease (slot, buffers) is taken when the executable is
        # built. The halves of a split op pass the one they share.
        site = kwargs.pop("site", None)
        kwargs["site"] = np.int64(runtime.new_site() if site is None else int(site))
        kwargs["timeout_ns"] = np.int64(runtime.timeout_ns())
        if "buffer_bytes" not in kwargs and target in ext.ht_staged_operands:
            # Per-process mode: peers read our operands from a symmetric staging buffer.
            kwargs["stage_bytes"] = np.int64(
                _stage_bytes(ext, target, ctx.avals_in) if runtime.per_process() else 0)
    name = target + "_vr" if vranks else target
    return jax.ffi.ffi_lowering(name, has_side_effect=not pure,
                                operand_output_aliases=dict(aliases) or None)(ctx, *args, **kwargs)


mlir.register_lowering(ep_call_p, _lowering, platform="cuda")


def _batch(axis_data, vals, dims, *, target, out_types, attrs, axis_name, has_groups, pure,
           vranks, aliases):
    """vmap. Over the op's own EP axis: the one-GPU multi-rank mode, one custom call running
    every rank (operands and results stacked along a leading axis of ranks). Over any other
    axis: one call per element, in order (a `lax.map`)."""
    params = dict(target=target, attrs=attrs, axis_name=axis_name, has_groups=has_groups,
                  pure=pure, aliases=aliases)
    size = int(axis_data.size)

    def stacked(v, d):
        return jnp.moveaxis(v, d, 0) if d is not None else \
            jnp.broadcast_to(v, (size,) + tuple(v.shape))

    if has_groups and not vranks and axis_data.name == axis_name:
        top = runtime.max_ranks()
        if top is not None and size > top:
            raise ValueError(f"jax_ep: {size} ranks along {axis_name!r}; the one-GPU "
                             f"multi-rank mode runs 1 to {top}")
        outs = ep_call_p.bind(
            *[stacked(v, d) for v, d in zip(vals, dims)],
            out_types=tuple(((size,) + tuple(s), d) for s, d in out_types), vranks=size,
            **params)
        return outs, [0] * len(outs)
    batched = [stacked(v, d) for v, d in zip(vals, dims) if d is not None]
    where = [d is not None for d in dims]

    def one(xs):
        it = iter(xs)
        args = [next(it) if b else v for v, b in zip(vals, where)]
        return ep_call_p.bind(*args, out_types=out_types, vranks=vranks, **params)

    outs = jax.lax.map(one, batched)
    return outs, [0] * len(outs)


batching.fancy_primitive_batchers[ep_call_p] = _batch


def varying_axes(x):
    """Mesh axes along which x varies inside shard_map (API moved between jax versions)."""
    aval = jax.typeof(x)
    v = getattr(aval, "vma", None)
    if v is None:
        v = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(v or ())


def _varying(x, axes):
    """x marked as varying along `axes` (e.g. an operand closed over from outside shard_map)."""
    missing = tuple(sorted(axes - varying_axes(x), key=str))
    if not missing:
        return x
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def varying(args, axis_name=None):
    """args, each marked as varying along every mesh axis that any of them (or axis_name)
    varies along: what custom calls and custom VJPs inside shard_map need their operands to
    agree on. A no-op outside shard_map."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if axis_name is not None:
        try:
            axes = axes | varying_axes(jax.lax.axis_index(axis_name))
        except Exception:  # noqa: BLE001 - older jax: axis_index carries no vma
            pass
    return [_varying(a, axes) for a in args] if axes else list(args)


def call(target, args, out_types, *, axis_name=None, pure=False, aliases=(), **attrs):
    """Bind a custom call. out_types: [(shape, dtype)]; attrs: static scalars; aliases:
    (operand index, result index) pairs, each result written in its operand's buffer (XLA
    copies the operand first when it is still needed).

    Calls are side-effecting (XLA never merges or drops them) unless `pure`: a computation
    without communication, which XLA may then remove when its result is unused.

    With axis_name, the lowering adds groups / group_size / site / timeout_ns (a `site`
    attribute given here is kept: the two halves of a split op share it) and, for the pull ops,
    `stage_bytes`. Push ops carry `buffer_bytes`, the size of their call site's receive buffers.
    """
    args = varying(args, axis_name)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))
    out_types = tuple((tuple(int(x) for x in s), np.dtype(d).name) for s, d in out_types)
    return ep_call_p.bind(*args, target=target, out_types=out_types, attrs=frozen,
                          axis_name=axis_name, has_groups=axis_name is not None, pure=bool(pure),
                          vranks=0, aliases=tuple((int(a), int(b)) for a, b in aliases))


def _freeze(v):
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return np.int64(v)
    raise TypeError(f"unsupported attribute {v!r}")
