"""Where the time of one jax_ep call goes: the in-kernel phase tracer (Slot::trace).

For R in --ranks (skipped when there are fewer GPUs), on a ("ep",) mesh over the first R GPUs,
runs each op --runs times (jit + shard_map, block_until_ready after each call), then reads the
phase timestamps of the last call on every device of the group (jax_ep.runtime.phase_traces)
and prints, per op and device, the time between consecutive marks in microseconds.

Ops: HT dispatch bf16 with H = 8 (layout + synchronisation only), HT dispatch bf16 H = 7168,
HT combine bf16 H = 7168, LL dispatch FP8 (128 tokens / rank, H = 7168), LL combine bf16.
Mark indices: csrc/transport/trace_marks.h.

--fused: instead, the fused second GEMM + combine of `moe_ffn` alone (its inputs from the fused
dispatch + first GEMM, run before), 4096 tokens / rank, H = 7168, I = 2048, 32 experts / rank,
top-8: per column chunk, when its last tile was stored, its last first-step (sum) task and its
last second-step (pull) task ended (marks named by `_C.fused_trace_marks`). Read it with
--absolute: each column in us since the device's first mark.

With JAX_EP_LL_DIAG=1 the LL kernels also record, per phase, the latest time any block or warp
reached a point (its first ticket, the end of its items, its fence and count...): marks 0..11
of the LL slots. Read them with --absolute (each column in us since the device's first mark).

  python benchmarks/trace_phases.py [--ranks 1 2 4] [--runs 5] [--scan 20]
  JAX_EP_LL_DIAG=1 python benchmarks/trace_phases.py --ranks 4 --scan 20 --ll-only --absolute
  python benchmarks/trace_phases.py --ranks 1 4 --fused --absolute [--combine-blocks 16]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep  # noqa: E402
from jax_ep import fused, moe, runtime  # noqa: E402
from harness import _smallest  # noqa: E402

# What each trace index records, from the extension (csrc/transport/trace_marks.h). LL slots
# (64 and up) with JAX_EP_LL_DIAG=1 also hold per-warp diagnostic points (DIAG_MARKS): the latest
# time any block / warp reached them.
MARKS = dict(runtime.extension().trace_marks) if runtime.extension() is not None else {}
DIAG_MARKS = dict(runtime.extension().diag_marks) if runtime.extension() is not None else {}
FUSED_MARKS = (dict(runtime.extension().fused_trace_marks)
               if runtime.extension() is not None else {})


def routing(rng, n, K, E):
    return np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32)


def snapshot(group):
    return {d: runtime.phase_traces(group, d) for d in group}


def report(name, group, before, after, host_us, names=None):
    """Print the marks of the slot(s) this op changed, per device."""
    slots = sorted({s for d in group for s, row in after[d].items()
                    if before[d].get(s) != row})
    if not slots:
        print(f"  {name}: no trace slot changed (op did not run the CUDA kernels?)")
        return
    for s in slots:
        rows = {}
        for d in group:
            old = before[d].get(s, [0] * len(after[d].get(s, [])))
            new = after[d].get(s)
            if new is None:
                continue
            # marks this call wrote (a mark it did not reach keeps an older call's value)
            rows[d] = {i: v for i, v in enumerate(new) if v != 0 and v != old[i]}
        idxs = sorted({i for r in rows.values() for i in r})
        starts = {d: min(r.values()) for d, r in rows.items() if r}
        t0 = min(starts.values()) if starts else 0
        print(f"  {name}  (slot {s}; host {host_us:.1f} us/call, median of the runs)")
        if names is None:
            names = {**MARKS, **DIAG_MARKS} if s >= 64 else MARKS
        print("    marks: " + ", ".join(f"{i}={names.get(i, '?')}" for i in idxs))
        hdr = "    dev  skew  " + "".join(
            f"{(f'{p}->{i}' if p is not None else f'{i}'):>9s}"
            for p, i in zip([None] + idxs[:-1], idxs)) + "     span"
        print(hdr)
        for d, r in rows.items():
            if not r:
                print(f"    {d:3d}  (no marks)")
                continue
            cells, prev = [], None
            for i in idxs:
                if i not in r:
                    cells.append(f"{'-':>9s}")
                    continue
                # first column: 0 (the device's first mark); then us since the previous mark
                # (--absolute: every column since the device's first mark)
                base = r[prev] if prev is not None and not ABSOLUTE else starts[d]
                cells.append(f"{(r[i] - base) / 1e3:9.1f}")
                prev = i
            span = (max(r.values()) - starts[d]) / 1e3
            print(f"    {d:3d} {(starts[d] - t0) / 1e3:5.1f}  " + "".join(cells) +
                  f"{span:9.1f}")


ABSOLUTE = False  # --absolute
LL_ONLY = False  # --ll-only
FUSED = False  # --fused
COMBINE_BLOCKS = 0  # --combine-blocks (0: the kernel's automatic share)
SCAN = 1  # calls per jitted program (--scan): the marks read are those of the last call


def run_op(name, mesh, group, body, args, runs, names=None):
    def many(*a):  # SCAN back-to-back calls, unrolled: steady state, not one isolated call
        # Call i + 1 reads its inputs through an optimization barrier that also takes the
        # smallest outputs of calls i and i - 1, as harness.scan_fn's calls do: otherwise the
        # calls whose outputs nothing uses are dropped, and only the last one runs.
        prev = last = None
        for i in range(SCAN):
            a2 = a if i == 0 else jax.lax.optimization_barrier((a, last, prev))[0]
            out = body(*a2)
            prev, last = (last if i else _smallest(out)), _smallest(out)
        return out, prev[None], last[None]  # the last two leaves kept: each in two barriers

    f = jax.jit(jax.shard_map(many, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                              check_vma=False))
    jax.block_until_ready(f(*args))  # compile + first call (the slot's first epoch)
    before = snapshot(group)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        out = jax.block_until_ready(f(*args))[0]
        ts.append(time.perf_counter() - t)
    after = snapshot(group)
    report(name, group, before, after, float(np.median(ts)) * 1e6 / SCAN, names)
    return out


def suite(R, gpus, runs):
    devs = gpus[:R]
    mesh = Mesh(np.array(devs), ("ep",))
    # the EP group key, as the lowering builds it (jax_ep._ffi.group_table)
    group = [int(d.local_hardware_id if d.local_hardware_id is not None else d.id)
             for d in mesh.devices.flat]
    print(f"R={R}: group (CUDA ordinals) {group}", flush=True)
    shard = NamedSharding(mesh, P("ep"))
    T, H, K, E = 4096, 7168, 8, 32 * R
    L = E // R
    rng = np.random.default_rng(0)
    idx = jax.device_put(jnp.asarray(routing(rng, R * T, K, E)), shard)
    w = jax.device_put(jnp.asarray(rng.random((R * T, K)), jnp.float32), shard)
    if LL_ONLY:
        return suite_ll(R, mesh, group, shard, rng, H, K, E, L, runs)
    if FUSED:
        return suite_fused(R, mesh, group, shard, idx, w, H, E, runs)
    x8 = jax.device_put(jnp.asarray(rng.standard_normal((R * T, 8)), jnp.bfloat16), shard)
    x = jax.jit(lambda k: jax.random.normal(k, (R * T, H), jnp.bfloat16),
                out_shardings=shard)(jax.random.key(0))

    run_op("HT dispatch bf16 H=8", mesh, group, lambda x, i, w: jax_ep.dispatch(
        x, i, w, num_experts=E, backend="cuda").recv_x, (x8, idx, w), runs)
    del x8

    def disp(x, i, w):
        r = jax_ep.dispatch(x, i, w, num_experts=E, backend="cuda")
        h = r.handle
        return (r.recv_x, h.recv_src, h.send_rows, h.recv_count[None], h.num_dropped[None],
                h.num_invalid[None])
    hargs = run_op("HT dispatch bf16 H=7168", mesh, group, disp, (x, idx, w), runs)
    del x
    run_op("HT combine bf16 H=7168", mesh, group, lambda y, *h: jax_ep.combine(
        y, jax_ep.DispatchHandle(h[0], h[1], h[2][0], h[3][0], h[4][0]), backend="cuda"),
        hargs, runs)
    del hargs
    suite_ll(R, mesh, group, shard, rng, H, K, E, L, runs)


def suite_fused(R, mesh, group, shard, idx, w, H, E, runs, I=2048):
    """The fused GEMM + combine alone: its inputs from the fused dispatch + first GEMM (one
    program, run once), then that kernel (the program whose slot the report shows)."""
    def normal(key, shape, scale):
        return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale)
                       .astype(jnp.bfloat16), out_shardings=shard)(jax.random.key(key))
    x = normal(2, (R * 4096, H), 1.0)
    wgu = normal(3, (E, H, 2 * I), 1 / np.sqrt(H))
    wd = normal(4, (E, I, H), 1 / np.sqrt(I))

    def inputs(x, i, w, wgu):  # every leaf with a leading axis of 1 per shard
        res, h = fused.dispatch_matmul(x, i, w, wgu, num_experts=E, backend="cuda")
        return jax.tree.map(lambda v: v[None], (moe.swiglu(h).astype(jnp.bfloat16), res))
    packed = jax.jit(jax.shard_map(inputs, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                   check_vma=False))(x, idx, w, wgu)
    del x, wgu

    def second_half(packed, wd):
        a, res = jax.tree.map(lambda v: v[0], packed)
        return fused.matmul_combine(a, wd, res, backend="cuda", combine_blocks=COMBINE_BLOCKS)
    run_op(f"fused GEMM + combine H={H} I={I} (combine_blocks {COMBINE_BLOCKS or 'auto'})",
           mesh, group, second_half, (packed, wd), runs, names=FUSED_MARKS)


def suite_ll(R, mesh, group, shard, rng, H, K, E, L, runs):
    M = 128
    xl = jax.jit(lambda k: jax.random.normal(k, (R * M, H), jnp.bfloat16),
                 out_shardings=shard)(jax.random.key(1))
    idxl = jax.device_put(jnp.asarray(routing(rng, R * M, K, E)), shard)
    wl = jax.device_put(jnp.asarray(rng.random((R * M, K)), jnp.float32), shard)

    def ll_disp(x, i):
        r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                        use_fp8=True, backend="cuda")
        return (r.recv_x[0], r.handle.recv_src, r.handle.recv_slot, r.handle.recv_count,
                r.handle.src_rows)
    _, *h = run_op("LL dispatch fp8 T=M=128 H=7168", mesh, group, ll_disp, (xl, idxl), runs)
    y = jax.jit(lambda: jnp.ones((R * L, R * M, H), jnp.bfloat16), out_shardings=shard)()
    run_op("LL combine bf16 T=M=128 H=7168", mesh, group,
           lambda y, s, sl, c, rr, i, w: jax_ep.low_latency_combine(
               y, i, w, jax_ep.LowLatencyHandle(s, sl, c, jnp.zeros((), jnp.int32), rr, i),
               backend="cuda"),
           (y, *h, idxl, wl), runs)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scan", type=int, default=1,
                   help="calls per program; >1 shows the steady state of back-to-back calls")
    p.add_argument("--absolute", action="store_true",
                   help="every column in us since the device's first mark (not since the "
                        "previous column)")
    p.add_argument("--ll-only", action="store_true", help="only the low-latency ops")
    p.add_argument("--fused", action="store_true",
                   help="only the fused GEMM + combine, its marks per column chunk")
    p.add_argument("--combine-blocks", type=int, default=0,
                   help="--fused: blocks that only combine (0: automatic)")
    a = p.parse_args()
    global SCAN, ABSOLUTE, LL_ONLY, FUSED, COMBINE_BLOCKS
    SCAN = max(1, a.scan)
    ABSOLUTE, LL_ONLY, FUSED, COMBINE_BLOCKS = a.absolute, a.ll_only, a.fused, a.combine_blocks
    gpus = jax.devices()
    print(f"devices: {len(gpus)} x {gpus[0].device_kind}; jax {jax.__version__}; "
          f"num_blocks {runtime.num_blocks()}")
    print("columns: skew = device's first mark - earliest first mark of the group (us); "
          "a->b = us from mark a to mark b (first column: 0, the device's first mark); "
          "span = first to last mark (us); '-' = mark not written by the last call (the next "
          "column then counts from the last mark written)")
    for R in a.ranks:
        if R > len(gpus):
            print(f"skip R={R}: only {len(gpus)} devices")
            continue
        suite(R, gpus, a.runs)


if __name__ == "__main__":
    main()
