"""Kernel durations per call from a jax.profiler trace (bench.py --kernel-times).

DeepEP reports its low-latency figures as kernel durations from a profiler; this gives the same
measure beside bench.py's scan timing. The trace is the Chrome / perfetto JSON that
jax.profiler.trace writes (plugins/profile/<run>/<host>.trace.json.gz): "traceEvents" holds
complete events (ph "X": name, ts and dur in us, pid, tid) and metadata events (ph "M") naming
processes and threads. Each GPU is a process named like "/device:GPU:0"; its kernels (and
memcpys) sit on threads named "Stream #<id>...", beside lines that XLA derives from them ("XLA
Ops", "XLA Modules", "Steps", ...), which would count the same time twice.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics

import jax


def _names(events) -> tuple:
    """({pid: process name}, {pid: {tid: thread name}}) from a trace's metadata events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads.setdefault(e["pid"], {})[e.get("tid")] = str(e.get("args", {}).get("name", ""))
    return procs, threads


def gpu_kernels(trace_json: dict) -> dict:
    """{GPU process name: [(ts, dur, name)] in start order} of the kernel events of each GPU."""
    events = trace_json.get("traceEvents", [])
    procs, threads = _names(events)
    gpus = {pid: name for pid, name in procs.items() if "GPU" in name.upper()}
    out = {name: [] for name in gpus.values()}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        named = threads.get(e["pid"])
        if named and not named.get(e.get("tid"), "").startswith("Stream"):
            continue  # a derived line (XLA Ops, ...), not the stream the kernel ran on
        out[gpus[e["pid"]]].append((float(e.get("ts", 0)), float(e.get("dur", 0)),
                                    e.get("name", "")))
    return {name: sorted(ks) for name, ks in out.items()}


def _per_call(durs, calls):
    """Summed duration of each call's kernels: the kernels in start order, `calls` equal runs;
    the mean (one value) when the count does not split evenly."""
    if not durs:
        return []
    if len(durs) % calls:
        return [sum(durs) / calls]
    k = len(durs) // calls
    return [sum(durs[j * k:(j + 1) * k]) for j in range(calls)]


def kernel_durations(trace_json: dict, name_regex: str, calls: int) -> dict:
    """Kernels of a trace of `calls` calls of one op, per GPU, and the op's per-call figures.

    Returns {"devices": {GPU: {"kernels": {name: {"count", "us_per_call"}}, "op_us": [per-call
    sums of the kernels whose name matches name_regex (case-insensitive)], "all_us": [the same,
    all kernels]}}, "kernel_us": median of op_us over calls and devices, "kernel_us_all": the
    same for all_us}. No GPU process (a CPU trace): devices is empty and both figures None; a
    figure is also None when no kernel counts towards it."""
    pat = re.compile(name_regex, re.IGNORECASE)
    devices = {}
    for dev, ks in gpu_kernels(trace_json).items():
        by_name = {}
        for _, dur, name in ks:
            n = by_name.setdefault(name, {"count": 0, "us_per_call": 0.0})
            n["count"] += 1
            n["us_per_call"] += dur / calls
        devices[dev] = dict(kernels=by_name,
                            op_us=_per_call([d for _, d, n in ks if pat.search(n)], calls),
                            all_us=_per_call([d for _, d, _ in ks], calls))

    def med(key):
        vals = [v for d in devices.values() for v in d[key]]
        return statistics.median(vals) if vals else None
    return dict(devices=devices, kernel_us=med("op_us"), kernel_us_all=med("all_us"))


def call_timeline(trace_json: dict, calls: int) -> dict:
    """Where a GPU has no kernel during one call, on each GPU of a trace of `calls` calls of an
    op (harness.scan_fn's): the period from one start of the op's anchor kernel (of the names
    that occur exactly `calls` times, the one with the most time) to its next start, so the
    tail of one call and the head of the next; the period after anchor calls // 2 - 1 (at
    least the first), away from the scan's last two calls where it can (their results are the
    executable's outputs, buffers allocated anew on each run). The trace cannot be split into
    calls by count: XLA names the fusions of each unrolled call apart, and the scan adds
    one-off kernels. Per GPU: {"anchor": its name, "period_us": the time per call there,
    "busy_us": the union of the events' intervals in it, "idle_us": the rest, "events":
    [(start, dur, gap, name)] in us from the period's start, gap the time since the latest end
    before it (0 when they overlap), "t0": the period's start in the trace's clock}. A GPU with
    fewer than 2 calls or no anchor is left out. Under the profiler the host's work costs more
    (graph launches and updates most), so the gaps after a host read overstate it."""
    out = {}
    if calls < 2:
        return out
    for dev, ks in gpu_kernels(trace_json).items():
        count, total = {}, {}
        for _, dur, name in ks:
            count[name] = count.get(name, 0) + 1
            total[name] = total.get(name, 0.0) + dur
        anchors = [n for n in count if count[n] == calls]
        if not anchors:
            continue
        anchor = max(anchors, key=lambda n: total[n])
        starts = [ts for ts, _, name in ks if name == anchor]
        j = max(0, calls // 2 - 1)
        t0, t1 = starts[j], starts[j + 1]
        events, end, busy = [], t0, 0.0
        for ts, dur, name in ks:
            if not t0 <= ts < t1:
                continue
            events.append((ts - t0, dur, max(0.0, ts - end), name))
            busy += max(0.0, min(ts + dur, t1) - max(ts, end))
            end = max(end, ts + dur)
        out[dev] = dict(anchor=anchor, period_us=t1 - t0, busy_us=busy,
                        idle_us=t1 - t0 - busy, events=events, t0=t0)
    return out


def host_events(trace_json: dict, t0: float, t1: float, min_dur: float = 5.0) -> list:
    """[(start, dur, thread, name)] of the host's events (every process not a GPU's) that
    overlap [t0, t1) and last at least min_dur us, in start order, start in us from t0: what
    the host did while a GPU had no kernel."""
    events = trace_json.get("traceEvents", [])
    procs, threads = _names(events)
    out = []
    for e in events:
        if e.get("ph") != "X" or "GPU" in procs.get(e.get("pid"), "").upper():
            continue
        ts, dur = float(e.get("ts", 0)), float(e.get("dur", 0))
        if dur >= min_dur and ts < t1 and ts + dur > t0:
            out.append((ts - t0, dur, threads.get(e.get("pid"), {}).get(e.get("tid"), ""),
                        e.get("name", "")))
    return sorted(out)


def report(res: dict, width: int = 60, top: int = 4) -> list:
    """Lines to print for one kernel_durations result (the `top` longest kernels per device;
    the JSON row keeps the totals, the trace keeps everything)."""
    if not res["devices"]:
        return ["    kernels: no GPU process in the trace"]
    lines = []
    for dev, d in res["devices"].items():
        ks = sorted(d["kernels"].items(), key=lambda kv: -kv[1]["us_per_call"])
        more = f", {len(ks) - top} more" if len(ks) > top else ""
        lines.append(f"    {dev}: " + (", ".join(
            f"{v['count']} x {name[:width]} ({v['us_per_call']:.1f} us/call)"
            for name, v in ks[:top]) or "no kernels") + more)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines.append(f"    kernels per call (median over calls and devices): op "
                 f"{fmt(res['kernel_us'])} us, all {fmt(res['kernel_us_all'])} us")
    return lines


def load_trace(log_dir: str) -> dict:
    """The newest *.trace.json.gz under log_dir (jax.profiler.trace's output)."""
    paths = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


def trace_run(fn, log_dir: str) -> dict:
    """The trace (load_trace's) of one run of fn() under the profiler."""
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    return load_trace(log_dir)


def trace_kernels(fn, log_dir: str, name_regex: str, calls: int) -> dict:
    """kernel_durations of one run of fn() (`calls` calls of the op) under the profiler."""
    return kernel_durations(trace_run(fn, log_dir), name_regex, calls)
