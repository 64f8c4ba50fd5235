"""jax_ep benchmark: our CUDA kernels beside lax.all_to_all and lax.ragged_all_to_all, one run,
same GPUs: one process over all of them, or (under python -m jax_ep.launch -n R) one process
per GPU, where process 0 reports. benchmarks/bench_modes.py runs both modes in one go.

Each op is timed as jit-compiled lax.scans of its calls back to back (no kernel of the harness
between calls, benchmarks/harness.py): per call = (time of a scan of --iters calls - time of one
of --iters/4) / the difference in calls, so the fixed cost of launching one program (host
dispatch) cancels; median over --reps interleaved pairs, after warm-up. The plain figure, the
long scan's wall time / --iters, is kept as "wall us". With --kernel-times, one more run of
each scan under jax.profiler also gives the op's kernel durations per call
(benchmarks/kernel_times.py), the measure DeepEP reports. Prints a table, writes results.json
and a plot into --out.

  python benchmarks/bench.py --ranks 2 4 --mode ht ll --out /tmp/bench
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python benchmarks/bench.py --backend reference --ranks 4 --tokens 16 --ll-tokens 8 \
      --hidden 256 --topk 2 --experts-per-rank 2 --iters 4 --reps 1 --overlap-matmul 64 \
      --out DIR   (checks the script on a CPU: the reference backend, no --sms sweep)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

if "--cmd-buffers" in sys.argv:  # XLA command buffers (CUDA graphs) around our custom calls too
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                               " --xla_gpu_graph_min_graph_size=1")

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import harness  # noqa: E402
import jax_ep  # noqa: E402
import kernel_times  # noqa: E402

# The kernels that are the op, by name (kernel_us): ours, the NCCL (or XLA) collectives of the
# lax baselines, or every kernel of the scan (ops without a collective).
OURS = r"jax_ep|dispatch_kernel|combine_kernel|copy_rows|layout"
NCCL = r"nccl|all_to_all|ragged"
ANY = r"."
TRACE_DIR = None  # --kernel-times: each op's profiler trace goes under it
BACKEND = "cuda"  # --backend "reference" checks the script on a CPU (test_benchmarks_smoke.py)
_traces = 0


def put(value, dtype, sharding=None):
    """Global array from a host value that every process computes the same way (seeded): each
    process places its own shards, so this works with one process or one per GPU.
    put(value, sharding) keeps the dtype; put(value, dtype, sharding) converts first."""
    if sharding is None:
        dtype, sharding = None, dtype
    arr = np.asarray(value) if dtype is None else np.asarray(jnp.asarray(value, dtype))
    return jax.make_array_from_callback(arr.shape, sharding, lambda i: arr[i])


def ragged_ok() -> bool:
    """lax.ragged_all_to_all baseline: one process only. With several processes XLA 0.11 runs
    it through an NCCL send/recv fallback (refused unless a flag allows it) that did not finish
    one timed scan in minutes on 4 x H200; it is left out there, with a note. XLA:CPU has no
    ragged-all-to-all: left out on a CPU too."""
    if jax.default_backend() == "cpu":
        print("  (lax.ragged_all_to_all baseline skipped: XLA:CPU does not implement it)")
        return False
    if jax.process_count() == 1:
        return True
    print("  (lax.ragged_all_to_all baseline skipped: several processes)")
    return False


def timed_scan(mesh, body, args, iters, reps, kernels=OURS):
    """(median, min, max) seconds per call of body(*args): the slope between a lax.scan of
    iters // 4 calls and one of `iters` calls (harness.time_slope), and a dict: wall_us, the long
    scan's total / iters (launch overhead included); kernel_us / kernel_us_all, the kernel
    durations per call of one more run under the profiler with --kernel-times (kernels whose
    name matches `kernels` / all kernels), None without it or where profiling fails; "lines"
    to print."""
    global _traces
    f = harness.scan_fn(mesh, body, iters)
    short = max(1, iters // 4)
    *t, wall = harness.time_slope(harness.scan_fn(mesh, body, short), f, short, iters, args, reps)
    t = tuple(t)
    k = dict(kernel_us=None, kernel_us_all=None, wall_us=wall * 1e6, lines=[])
    if TRACE_DIR is None:
        return t + (k,)
    _traces += 1
    log_dir = os.path.join(TRACE_DIR, f"{_traces:03d}_p{jax.process_index()}")
    ran = []

    def run():
        ran.append(True)
        return f(*args)
    try:
        res = kernel_times.trace_kernels(run, log_dir, kernels, iters)
    except Exception as e:  # noqa: BLE001 - no profiler here: the scan timing stands alone
        why = (str(e).splitlines() or [""])[0]
        k["lines"] = [f"    (no kernel times: {type(e).__name__}: {why})"]
        if not ran:  # the other processes run this program (its collectives) all the same
            jax.block_until_ready(f(*args))
        return t + (k,)
    k.update(kernel_us=res["kernel_us"], kernel_us_all=res["kernel_us_all"],
             lines=kernel_times.report(res) + [f"    trace: {log_dir}"])
    return t + (k,)


def kernel_fields(k):
    """Prints timed_scan's kernel report; the row's kernel fields."""
    for line in k["lines"]:
        print(line, flush=True)
    return dict(kernel_us=k["kernel_us"], kernel_us_all=k["kernel_us_all"],
                wall_us=k.get("wall_us"))


def routing(rng, n, K, E):
    return np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32)


def ht_suite(mesh, R, a, sms_list, rows):
    T, H, K, E = a.tokens, a.hidden, a.topk, a.experts_per_rank * R
    L = E // R
    rng = np.random.default_rng(0)
    shard = NamedSharding(mesh, P("ep"))
    x = put(rng.standard_normal((R * T, H)), jnp.bfloat16, shard)
    idx_np = routing(rng, R * T, K, E)
    idx = put(idx_np, shard)
    w = put(rng.random((R * T, K)), jnp.float32, shard)
    xq, xs = jax.jit(jax_ep.quantize_fp8)(x)
    # bytes: DeepEP counts bytes received per rank (each token once per rank, self included)
    dest = idx_np // L
    in_rank = np.zeros((R * T, R), bool)
    for k in range(K):
        in_rank[np.arange(R * T), dest[:, k]] = True
    recv_tok = in_rank.reshape(R, T, R).sum(axis=(0, 1)).mean()            # per receiving rank
    sent_remote = np.mean([in_rank[s * T:(s + 1) * T][:, [q for q in range(R) if q != s]].sum()
                           for s in range(R)])
    row_bf16, row_fp8 = 2 * H, H + 4 * (H // 128)
    it, reps = a.iters, a.reps

    def record(op, impl, sms, t, row_bytes):
        med, lo, hi, k = t
        print(f"  R={R} {op:22s} {impl:24s} sms={sms!s:>4} {med * 1e6:10.1f} us "
              f"(recv {recv_tok * row_bytes / med / 1e9:6.1f} GB/s, egress "
              f"{sent_remote * row_bytes / med / 1e9:6.1f} GB/s)", flush=True)
        rows.append(dict(mode="ht", ranks=R, op=op, impl=impl, sms=sms, us=med * 1e6,
                         us_min=lo * 1e6, us_max=hi * 1e6,
                         recv_GBps=recv_tok * row_bytes / med / 1e9,
                         egress_GBps=sent_remote * row_bytes / med / 1e9,
                         tokens=T, hidden=H, topk=K, experts=E, **kernel_fields(k)))

    if BACKEND != "cuda":
        print(f"  (--sms sweep skipped: the {BACKEND} backend has no kernel blocks to set)")
        sms_list = ["-"]
    for sms in sms_list:
        jax_ep.set_num_blocks(None if sms == "-" else sms)
        t = timed_scan(mesh, lambda x, i, w: jax_ep.dispatch(
            x, i, w, num_experts=E, backend=BACKEND).recv_x, (x, idx, w), it, reps)
        record("dispatch_bf16", "jax_ep", sms, t, row_bf16)
        t = timed_scan(mesh, lambda q, s, i, w: jax_ep.dispatch(
            (q, s), i, w, num_experts=E, backend=BACKEND).recv_x[0], (xq, xs, idx, w), it, reps)
        record("dispatch_fp8", "jax_ep", sms, t, row_fp8)

        def comb(x, i, w):
            r = jax_ep.dispatch(x, i, w, num_experts=E, backend=BACKEND)
            h = r.handle
            return (r.recv_x, h.recv_src, h.send_rows, h.recv_count[None], h.num_dropped[None],
                    h.num_invalid[None])
        hargs = harness.rank_map(mesh, comb)(x, idx, w)
        t = timed_scan(mesh, lambda y, *h: jax_ep.combine(
            y, jax_ep.DispatchHandle(h[0], h[1], h[2][0], h[3][0], h[4][0]), backend=BACKEND),
            hargs, it, reps)
        record("combine_bf16", "jax_ep", sms, t, row_bf16)
    jax_ep.set_num_blocks(None)
    x8 = x[:, :8]
    t = timed_scan(mesh, lambda x, i, w: jax_ep.dispatch(
        x, i, w, num_experts=E, backend=BACKEND).recv_x, (x8, idx, w), it, reps)
    record("dispatch_bf16_H8 (layout+sync)", "jax_ep", "-", t, 16)
    cap = int(np.ceil(1.25 * in_rank.reshape(R, T, R).sum(axis=1).mean()))
    t = timed_scan(mesh, lambda x, i: baselines.all_to_all_dispatch(
        x, i, num_experts=E, axis_name="ep", capacity=cap)[0], (x, idx), it, reps, NCCL)
    record("dispatch_bf16", "lax.all_to_all(cap 1.25)", "-", t, row_bf16)
    if ragged_ok():
        t = timed_scan(mesh, lambda x, i: baselines.ragged_dispatch(
            x, i, num_experts=E, axis_name="ep")[0], (x, idx), max(2, it // 5),
            max(3, reps // 2), NCCL)
        record("dispatch_bf16", "lax.ragged_all_to_all", "-", t, row_bf16)

    def a2a_combine(x, i):
        recv, lay = baselines.all_to_all_dispatch(x, i, num_experts=E, axis_name="ep",
                                                  capacity=cap)
        return baselines.all_to_all_combine(recv, lay, axis_name="ep", num_tokens=T)
    t = timed_scan(mesh, a2a_combine, (x, idx), it, reps, NCCL)
    record("dispatch+combine_bf16", "lax.all_to_all(cap 1.25)", "-", t, row_bf16)


def ll_suite(mesh, R, a, rows):
    T = M = a.ll_tokens
    H, K, E = a.hidden, a.topk, a.experts_per_rank * R
    rng = np.random.default_rng(1)
    shard = NamedSharding(mesh, P("ep"))
    x = put(rng.standard_normal((R * T, H)), jnp.bfloat16, shard)
    idx_np = routing(rng, R * T, K, E)
    idx = put(idx_np, shard)
    w = put(rng.random((R * T, K)), jnp.float32, shard)
    pairs = R * T * K / R                                   # (token, expert) rows per rank
    it, reps = a.iters * 4, a.reps

    def record(op, impl, t, row_bytes):
        med, lo, hi, k = t
        print(f"  R={R} LL {op:19s} {impl:24s} {med * 1e6:10.1f} us", flush=True)
        rows.append(dict(mode="ll", ranks=R, op=op, impl=impl, sms="-", us=med * 1e6,
                         us_min=lo * 1e6, us_max=hi * 1e6,
                         recv_GBps=pairs * row_bytes / med / 1e9, tokens=T, hidden=H, topk=K,
                         experts=E, **kernel_fields(k)))

    t = timed_scan(mesh, lambda x, i: x[:1] * 2, (x, idx), it, reps, ANY)
    record("harness (x[:1]*2)", "-", t, 0)
    t = timed_scan(mesh, lambda x, i: jax_ep.low_latency_dispatch(
        x, i, num_experts=E, max_tokens_per_rank=M, use_fp8=True, backend=BACKEND).recv_x[0],
        (x, idx), it, reps)
    record("dispatch_fp8", "jax_ep", t, H + 4 * H // 128)
    t = timed_scan(mesh, lambda x, i: jax_ep.low_latency_dispatch(
        x, i, num_experts=E, max_tokens_per_rank=M, use_fp8=False, backend=BACKEND).recv_x,
        (x, idx), it, reps)
    record("dispatch_bf16", "jax_ep", t, 2 * H)

    kw = dict(num_experts=E, max_tokens_per_rank=M, backend=BACKEND)

    def disp(x, i):
        r = jax_ep.low_latency_dispatch(x, i, use_fp8=False, **kw)
        h = r.handle
        return r.recv_x, h.recv_src, h.recv_slot, h.recv_count, h.src_rows
    hargs = harness.rank_map(mesh, disp)(x, idx)

    def handle(s, sl, c, rr, i):
        return jax_ep.LowLatencyHandle(s, sl, c, jnp.zeros((), jnp.int32), rr, i)
    t = timed_scan(mesh, lambda y, s, sl, c, rr, i, w: jax_ep.low_latency_combine(
        y, i, w, handle(s, sl, c, rr, i), backend=BACKEND), hargs + (idx, w), it, reps)
    record("combine_bf16", "jax_ep", t, 2 * H)
    if a.ll_fused_only:
        return

    # The send / receive split, back to back (its cost over the fused op) ...
    t = timed_scan(mesh, lambda x, i: jax_ep.low_latency_dispatch_recv(
        jax_ep.low_latency_dispatch_send(x, i, use_fp8=True, **kw)).recv_x[0],
        (x, idx), it, reps)
    record("dispatch_fp8", "jax_ep send+recv", t, H + 4 * H // 128)
    t = timed_scan(mesh, lambda y, s, sl, c, rr, i, w: jax_ep.low_latency_combine_recv(
        jax_ep.low_latency_combine_send(y, i, w, handle(s, sl, c, rr, i), backend=BACKEND)),
        hargs + (idx, w), it, reps)
    record("combine_bf16", "jax_ep send+recv", t, 2 * H)

    # ... and with other work between the halves: a [N, N] bf16 matmul per call, ordered
    # send -> matmul -> recv by data dependencies, against matmul + fused dispatch.
    n_mm = a.overlap_matmul
    mm = put(rng.standard_normal((R * n_mm, n_mm)) / 64, jnp.bfloat16, shard)

    def mm_only(m):
        return (m @ m)[:1, :1]

    def fused_then_mm(x, i, m):
        r = jax_ep.low_latency_dispatch(x, i, use_fp8=True, **kw)
        return (m @ m)[:1, :1] + r.recv_count[:1, None].astype(m.dtype)

    def send_mm_recv(x, i, m):
        pend = jax_ep.low_latency_dispatch_send(x, i, use_fp8=True, **kw)
        first = jax.tree_util.tree_leaves(pend)[0].ravel()[0]             # a scalar of it
        m = m + first.astype(m.dtype) * 0                                   # after the send
        prod, pend = jax.lax.optimization_barrier((m @ m, pend))            # recv after it
        r = jax_ep.low_latency_dispatch_recv(pend)
        return prod[:1, :1] + r.recv_count[:1, None].astype(m.dtype)

    record(f"matmul {n_mm}^2 (bf16)", "-", timed_scan(mesh, mm_only, (mm,), it, reps, ANY), 0)
    record("dispatch_fp8 + matmul", "fused, then matmul",
           timed_scan(mesh, fused_then_mm, (x, idx, mm), it, reps), H + 4 * H // 128)
    record("dispatch_fp8 + matmul", "send, matmul, recv",
           timed_scan(mesh, send_mm_recv, (x, idx, mm), it, reps), H + 4 * H // 128)
    cap = int(np.ceil(1.25 * T * (1 - (1 - 1 / R) ** K)))
    t = timed_scan(mesh, lambda x, i: baselines.all_to_all_dispatch(
        x, i, num_experts=E, axis_name="ep", capacity=cap)[0], (x, idx), it, reps, NCCL)
    record("dispatch_bf16", "lax.all_to_all(cap 1.25)", t, 2 * H)
    if ragged_ok():
        t = timed_scan(mesh, lambda x, i: baselines.ragged_dispatch(
            x, i, num_experts=E, axis_name="ep")[0], (x, idx), it, reps, NCCL)
        record("dispatch_bf16", "lax.ragged_all_to_all", t, 2 * H)


def main():
    global TRACE_DIR, BACKEND
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mode", nargs="+", default=["ht", "ll"], choices=["ht", "ll"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--overlap-matmul", type=int, default=2048,
                   help="N of the [N, N] matmul run between the LL send and receive")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=32)
    p.add_argument("--sms", type=int, nargs="+", default=[24, 132])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--backend", default="cuda", choices=["cuda", "reference"],
                   help="'reference' checks the script on a CPU (the pure-JAX ops)")
    p.add_argument("--cmd-buffers", action="store_true",
                   help="run under XLA command buffers (CUDA graphs), custom calls included")
    p.add_argument("--ll-fused-only", action="store_true",
                   help="LL: only the fused ops (no split, overlap or baselines): A/B runs")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--kernel-times", action="store_true",
                   help="also run each scan once under jax.profiler and report its kernel "
                        "durations per call (traces kept in OUT/traces)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    BACKEND = a.backend
    if a.kernel_times:
        TRACE_DIR = os.path.join(os.path.abspath(a.out), "traces")
    if jax.process_index() != 0:  # per-process mode: process 0 reports for everyone
        sys.stdout = open(os.devnull, "w")
    gpus = jax.devices()
    mode = "one process" if jax.process_count() == 1 else f"{jax.process_count()} processes"
    print(f"devices: {len(gpus)} x {gpus[0].device_kind}; jax {jax.__version__}; {mode}")
    rows = []
    for R in a.ranks:
        if R > len(gpus):
            print(f"skip R={R}: only {len(gpus)} devices")
            continue
        if jax.process_count() > 1 and R != len(gpus):
            print(f"skip R={R}: per-process mode runs R = number of processes")
            continue
        mesh = Mesh(np.array(gpus[:R]), ("ep",))
        if "ht" in a.mode:
            ht_suite(mesh, R, a, a.sms, rows)
        if "ll" in a.mode:
            ll_suite(mesh, R, a, rows)
    meta = dict(device=gpus[0].device_kind, jax=jax.__version__, args=vars(a),
                runtime=jax_ep.runtime_info(), process_mode=mode)
    if jax.process_index() != 0:
        return
    with open(os.path.join(a.out, f"results{a.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
    print_table(rows)
    try:
        plot(rows, os.path.join(a.out, f"bench{a.tag}.png"))
    except Exception as e:  # matplotlib missing: the JSON has everything
        print(f"(no plot: {e})")


def print_table(rows):
    kern = any(r.get("kernel_us") is not None or r.get("kernel_us_all") is not None
               for r in rows)
    us = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print("\n| mode | GPUs | op | impl | SMs | median us | wall us | recv GB/s | "
          "speed-up vs all_to_all | vs ragged |" +
          (" kernel us | all kernels us |" if kern else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if kern else ""))
    for r in rows:
        base = {b["impl"]: b["us"] for b in rows if b["mode"] == r["mode"] and
                b["ranks"] == r["ranks"] and b["impl"] != "jax_ep" and
                b["op"] == "dispatch_bf16"}
        a2a = base.get("lax.all_to_all(cap 1.25)")
        rag = base.get("lax.ragged_all_to_all")
        sp = lambda b: f"{b / r['us']:.1f}x" if (b and r["impl"] == "jax_ep") else "-"  # noqa
        print(f"| {r['mode']} | {r['ranks']} | {r['op']} | {r['impl']} | {r['sms']} | "
              f"{r['us']:.1f} | {us(r.get('wall_us'))} | {r['recv_GBps']:.0f} | {sp(a2a)} | "
              f"{sp(rag)} |" +
              (f" {us(r.get('kernel_us'))} | {us(r.get('kernel_us_all'))} |" if kern else ""))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5))
    labels = [f"{r['mode']} R={r['ranks']}\n{r['op']}\n{r['impl']}"
              f"{'' if r['sms'] == '-' else ' ' + str(r['sms']) + 'SM'}" for r in rows]
    ax.bar(range(len(rows)), [r["us"] for r in rows],
           color=["tab:green" if r["impl"] == "jax_ep" else "tab:gray" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("median us per call (log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_title("jax_ep vs lax.all_to_all / lax.ragged_all_to_all (same run, same GPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
