"""benchmarks/harness.py and benchmarks/kernel_times.py on CPU (no GPU, no compiled extension).

The harness checks read the compiled HLO of a scan of a trivial body and of the lax.all_to_all
baseline: one instance of the body per iteration, each ordered after the previous one, and
nothing else per iteration. XLA's CPU pipeline erases optimization barriers before its last
CSE (cse_barrier_expander), which then merges identical calls; the GPU pipeline keeps them
until after scheduling, so these tests disable that CPU pass to compile what the GPU keeps.
"""
import gzip
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import baselines  # noqa: E402
import harness  # noqa: E402
import kernel_times  # noqa: E402

GPU_LIKE = {"xla_disable_hlo_passes": "cse_barrier_expander"}
# ENTRY instructions that launch nothing
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "opt-barrier", "bitcast"}
OURS = r"jax_ep|dispatch_kernel|combine_kernel|copy_rows|layout"


def entry(hlo):
    """{name: (opcode, operand names)} of the ENTRY computation of compiled HLO text."""
    body = hlo[hlo.index("\nENTRY"):]
    body = body[body.index("{\n") + 2:body.index("\n}")]
    out = {}
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)", line)
        assert m, line
        out[m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)))
    return out


def ancestors(ins, name):
    seen, todo = set(), list(ins[name][1])
    while todo:
        n = todo.pop()
        if n in ins and n not in seen:
            seen.add(n)
            todo.extend(ins[n][1])
    return seen


def compiled(mesh, body, args, iters):
    return harness.scan_fn(mesh, body, iters).lower(*args).compile(
        compiler_options=GPU_LIKE).as_text()


def calls_in_order(ins, calls):
    """Each of `calls` (ENTRY names) depends on the one before it, in some order."""
    order = sorted(calls, key=lambda n: len(ancestors(ins, n)))
    return all(a in ancestors(ins, b) for a, b in zip(order, order[1:]))


@pytest.fixture
def inputs(mesh4):
    shard = NamedSharding(mesh4, P("ep"))
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal((4 * 16, 8)), jnp.bfloat16), shard)
    idx = jax.device_put(jnp.asarray(rng.integers(0, 8, (4 * 16, 2)), jnp.int32), shard)
    return x, idx


@pytest.mark.parametrize("iters", [3, 8])
def test_scan_of_trivial_body_adds_nothing_per_call(mesh4, inputs, iters):
    hlo = compiled(mesh4, lambda x, i: x[:1] * 2, inputs, iters)
    ins = entry(hlo)
    barriers = [n for n, (op, _) in ins.items() if op == "opt-barrier"]
    kernels = [n for n, (op, _) in ins.items() if op not in FREE]
    calls = [n for n in kernels if set(barriers) & ancestors(ins, n)]
    assert len(barriers) == iters
    assert len(calls) == iters, hlo               # not hoisted out of the scan nor merged
    assert calls_in_order(ins, calls), hlo        # call i + 1 after call i
    # the body's one fusion per call; outside them only the carry's zeros, once
    assert len(kernels) - len(calls) <= 1, hlo
    assert hlo.count(" multiply(") == iters, hlo
    assert " add(" not in hlo, hlo                # no carry arithmetic


def test_scan_kernel_count_grows_by_the_body_only(mesh4, inputs):
    def count(iters):
        ins = entry(compiled(mesh4, lambda x, i: x[:1] * 2, inputs, iters))
        return sum(op not in FREE for op, _ in ins.values())
    assert count(9) - count(4) == 5


@pytest.mark.parametrize("iters", [2, 5])
def test_scan_of_all_to_all_baseline(mesh4, inputs, iters):
    body = lambda x, i: baselines.all_to_all_dispatch(  # noqa: E731
        x, i, num_experts=8, axis_name="ep", capacity=4)[0]
    hlo = compiled(mesh4, body, inputs, iters)
    ins = entry(hlo)
    a2a = [n for n, (op, _) in ins.items() if op == "all-to-all"]
    assert len(a2a) == iters, hlo
    assert calls_in_order(ins, a2a), hlo
    # the inputs reach each call unchanged, through the barriers (no carry added to x)
    params = {n for n, (op, _) in ins.items() if op == "parameter"}
    assert {op for op, operands in ins.values() if params & set(operands)} == {"tuple"}, hlo


def test_timed_scan_runs(mesh4, inputs):
    med, lo, hi = harness.timed_scan(mesh4, lambda x, i: x[:1] * 2, inputs, 4, 3)
    assert 0 < lo <= med <= hi


# --- kernel_times ----------------------------------------------------------------------------

def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
         "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _x(pid, tid, ts, dur, name):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def synthetic_trace(extra_gpu0=()):
    """2 GPUs, 3 calls each of layout + dispatch (ours) + an XLA fusion, on stream lines; an
    "XLA Ops" line and a host process whose events must not count."""
    ev = [_meta(1, "/host:CPU"), _meta(1, "python", tid=5),
          _meta(7, "/device:GPU:0"), _meta(7, "Stream #13(Kernel)", tid=13),
          _meta(7, "XLA Ops", tid=2),
          _meta(8, "/device:GPU:1"), _meta(8, "Stream #14(Kernel)", tid=14),
          _meta(8, "XLA Ops", tid=2)]
    ev.append(_x(1, 5, 0, 500, "jax_ep dispatch_kernel host wrapper"))
    for j in range(3):
        t = 100 * j
        ev += [_x(7, 13, t, 2, "void jax_ep::layout_kernel<8>(int const*)"),
               _x(7, 13, t + 5, 10 + j, "void jax_ep::ll::dispatch_kernel<128>(Args)"),
               _x(7, 13, t + 20, 1, "loop_multiply_fusion"),
               _x(7, 2, t, 30, "custom-call.1"),
               _x(8, 14, t, 3, "void jax_ep::layout_kernel<8>(int const*)"),
               _x(8, 14, t + 5, 20, "void jax_ep::ll::dispatch_kernel<128>(Args)"),
               _x(8, 14, t + 30, 1, "loop_multiply_fusion"),
               _x(8, 2, t, 40, "custom-call.1")]
    ev += [_x(7, 13, *e) for e in extra_gpu0]
    return {"displayTimeUnit": "ns", "traceEvents": ev}


def test_kernel_durations_two_gpus():
    res = kernel_times.kernel_durations(synthetic_trace(), OURS, 3)
    assert set(res["devices"]) == {"/device:GPU:0", "/device:GPU:1"}
    g0 = res["devices"]["/device:GPU:0"]
    assert g0["op_us"] == [12, 13, 14]
    assert g0["all_us"] == [13, 14, 15]
    assert res["devices"]["/device:GPU:1"]["op_us"] == [23, 23, 23]
    k = g0["kernels"]
    assert len(k) == 3 and "custom-call.1" not in k       # the XLA Ops line is not a stream
    assert k["void jax_ep::ll::dispatch_kernel<128>(Args)"] == {"count": 3, "us_per_call": 11}
    assert res["kernel_us"] == pytest.approx((14 + 23) / 2)      # median of all 6 calls
    assert res["kernel_us_all"] == pytest.approx((15 + 24) / 2)
    assert any("dispatch_kernel" in line for line in kernel_times.report(res))


def test_kernel_durations_regex_and_uneven_counts():
    # a one-off kernel (e.g. the carry's zeros): 10 kernels on GPU 0 do not split into 3 calls
    res = kernel_times.kernel_durations(synthetic_trace([(400, 6, "wrapped_broadcast")]),
                                        r"nccl", 3)
    assert res["kernel_us"] is None                      # nothing matches: None, not 0
    g0 = res["devices"]["/device:GPU:0"]
    assert g0["op_us"] == []
    assert g0["all_us"] == [pytest.approx((13 + 14 + 15 + 6) / 3)]   # the mean
    assert res["kernel_us_all"] is not None
    assert kernel_times.report(res)[-1].endswith("op - us, all "
                                                 f"{res['kernel_us_all']:.1f} us")


def test_kernel_durations_no_gpu():
    trace = {"traceEvents": [_meta(1, "/host:CPU"), _meta(1, "python", tid=5),
                             _x(1, 5, 0, 50, "dispatch_kernel")]}
    res = kernel_times.kernel_durations(trace, OURS, 4)
    assert res == {"devices": {}, "kernel_us": None, "kernel_us_all": None}
    assert kernel_times.report(res) == ["    kernels: no GPU process in the trace"]
    assert kernel_times.kernel_durations({}, OURS, 4)["devices"] == {}


def test_kernel_durations_gpu_without_thread_names():
    trace = {"traceEvents": [_meta(3, "/device:GPU:0"),
                             _x(3, 1, 0, 4, "ncclDevKernel_SendRecv(ncclDevComm*)"),
                             _x(3, 1, 10, 4, "ncclDevKernel_SendRecv(ncclDevComm*)")]}
    res = kernel_times.kernel_durations(trace, r"nccl", 2)
    assert res["kernel_us"] == 4 and res["kernel_us_all"] == 4


def test_call_timeline_gaps_and_overlap():
    # GPU 0: the dispatch kernel (the most time of the names that occur once a call) starts at
    # 5, 105, 205; the first period [5, 105) holds it (10 us), the fusion at 20 (1 us, 5
    # after 15) and the next call's layout kernel at 100 (2 us, 79 after 21)
    res = kernel_times.call_timeline(synthetic_trace([(400, 6, "wrapped_broadcast")]), 3)
    g0 = res["/device:GPU:0"]
    assert g0["anchor"] == "void jax_ep::ll::dispatch_kernel<128>(Args)"
    assert [e[:3] for e in g0["events"]] == [(0, 10, 0), (15, 1, 5), (95, 2, 79)]
    assert g0["period_us"] == 100 and g0["busy_us"] == 13 and g0["idle_us"] == 87
    assert res["/device:GPU:1"]["period_us"] == 100
    # overlapping events (two streams) count once; an event past the period's end is cut there
    trace = {"traceEvents": [_meta(3, "/device:GPU:0"), _x(3, 1, 0, 10, "a"),
                             _x(3, 2, 4, 10, "b"), _x(3, 1, 20, 5, "c"), _x(3, 1, 30, 10, "a"),
                             _x(3, 1, 38, 4, "d")]}
    t = kernel_times.call_timeline(trace, 2)["/device:GPU:0"]
    assert t["anchor"] == "a" and [e[2] for e in t["events"]] == [0, 0, 6]
    assert t["busy_us"] == 19 and t["period_us"] == 30 and t["idle_us"] == 11
    assert t["t0"] == 0
    # 5 calls: the period after the second start, away from the last two calls (the outputs)
    five = {"traceEvents": [_meta(3, "/device:GPU:0")] + [_x(3, 1, 10 * i, 2, "a")
                                                           for i in range(5)]}
    assert kernel_times.call_timeline(five, 5)["/device:GPU:0"]["t0"] == 10
    assert kernel_times.call_timeline(trace, 1) == {}          # one call: no period
    assert kernel_times.call_timeline(trace, 5) == {}          # no name occurs 5 times


def test_host_events_in_a_window():
    trace = synthetic_trace()      # the host's 500 us wrapper on thread "python"
    trace["traceEvents"].append(_x(1, 5, 150, 4, "short"))
    # the GPUs' kernels in [100, 200) are not the host's
    assert kernel_times.host_events(trace, 100, 200) == [
        (-100, 500, "python", "jax_ep dispatch_kernel host wrapper")]
    assert kernel_times.host_events(trace, 100, 200, min_dur=1)[1] == (50, 4, "python", "short")
    assert kernel_times.host_events(trace, 600, 700) == []


def test_real_cpu_trace(mesh4, inputs, tmp_path):
    if not hasattr(jax, "profiler") or not hasattr(jax.profiler, "trace"):
        pytest.skip("jax.profiler unavailable")
    f = harness.scan_fn(mesh4, lambda x, i: x[:1] * 2, 3)
    jax.block_until_ready(f(*inputs))
    try:
        res = kernel_times.trace_kernels(lambda: f(*inputs), str(tmp_path), OURS, 3)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot start here
        pytest.skip(f"jax.profiler.trace failed on CPU: {e}")
    assert res == {"devices": {}, "kernel_us": None, "kernel_us_all": None}
    trace = kernel_times.load_trace(str(tmp_path))
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def test_load_trace_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        kernel_times.load_trace(str(tmp_path))
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump(synthetic_trace(), f)
    assert kernel_times.load_trace(str(tmp_path)) == synthetic_trace()


# --- bench.py (imports jax_ep: skipped where it does not import) -----------------------------

@pytest.fixture
def bench():
    pytest.importorskip("jax_ep")
    import bench
    return bench


def test_bench_kernel_times_never_fail(bench, mesh4, inputs, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "TRACE_DIR", str(tmp_path))
    *t, k = bench.timed_scan(mesh4, lambda x, i: x[:1] * 2, inputs, 3, 2)
    assert len(t) == 3 and k["kernel_us"] is None and k["kernel_us_all"] is None
    assert "no GPU process" in "\n".join(k["lines"])

    def boom(*a, **kw):
        raise RuntimeError("no profiler")
    monkeypatch.setattr(bench.kernel_times, "trace_kernels", boom)
    *t, k = bench.timed_scan(mesh4, lambda x, i: x[:1] * 2, inputs, 3, 2)
    assert k["kernel_us"] is None and k["lines"] == [
        "    (no kernel times: RuntimeError: no profiler)"]
    fields = bench.kernel_fields(k)
    assert fields["kernel_us"] is None and fields["kernel_us_all"] is None
    assert fields["wall_us"] > 0
    assert "no kernel times" in capsys.readouterr().out


def test_bench_table_kernel_columns(bench, capsys):
    row = dict(mode="ll", ranks=2, op="dispatch_bf16", impl="jax_ep", sms="-", us=40.0,
               recv_GBps=100.0)
    bench.print_table([dict(row, kernel_us=None, kernel_us_all=None)])
    out = capsys.readouterr().out
    assert "kernel us" not in out
    bench.print_table([dict(row, kernel_us=31.25, kernel_us_all=33.0)])
    out = capsys.readouterr().out
    assert "| kernel us | all kernels us |" in out and "| 31.2 | 33.0 |" in out


def test_bench_help(bench):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--kernel-times" in r.stdout


def test_time_slope_cancels_fixed_cost():
    """The slope between a short and a long run removes a fixed per-run cost exactly."""
    import time as _time
    # sleeps long against a loaded machine's scheduling jitter (a few ms on 2 busy cores)
    per_call, fixed = 0.01, 0.05

    def runner(n):
        def f():
            _time.sleep(fixed + n * per_call)
            return jnp.zeros(())
        return f
    med, lo, hi, wall = harness.time_slope(runner(2), runner(8), 2, 8, (), 5)
    assert abs(med - per_call) < 0.6 * per_call, med
    assert wall > per_call + fixed / 8 * 0.8  # the plain figure keeps the fixed cost


def test_fused_ab_baselines_and_their_undoing(monkeypatch):
    """fused_ab.py's two kinds of baseline: another checkout's fused.py (a module whose fused
    halves moe_ffn then traces) and `env:NAME=VALUE` (the installed halves traced with that
    setting); each is undone when its block ends, the setting's earlier value restored."""
    import fused_ab
    from jax_ep import fused, moe
    monkeypatch.setenv("JAX_EP_FUSED_BACKWARD", "1")
    env = fused_ab.load_baseline("env:JAX_EP_FUSED_BACKWARD=0")
    assert env == {"JAX_EP_FUSED_BACKWARD": "0"}
    with fused_ab.halves(env):
        assert os.environ["JAX_EP_FUSED_BACKWARD"] == "0"
        assert moe.matmul_combine_plus is fused.matmul_combine_plus
    assert os.environ["JAX_EP_FUSED_BACKWARD"] == "1"
    mod = fused_ab.load_baseline(fused.__file__)
    with fused_ab.halves(mod):
        assert moe.matmul_combine_plus is mod.matmul_combine_plus is not fused.matmul_combine_plus
        assert moe.dispatch_matmul_swiglu is mod.dispatch_matmul_swiglu
    assert moe.matmul_combine_plus is fused.matmul_combine_plus
    with pytest.raises(SystemExit, match="env:JAX_EP_NAME=VALUE"):
        fused_ab.load_baseline("env:FUSED_BACKWARD=0")


def test_bench_layer_balanced_routing_gives_every_expert_the_same_pairs():
    """bench_layer.py's balanced routing: every expert exactly S * K / E pairs (the expert
    compute's equal groups), K distinct experts per token, spread over the ranks, and weights
    that sum to one per token."""
    import bench_layer
    rng = np.random.default_rng(0)
    for S, E, K, R in ((64, 8, 2, 2), (4096, 32, 8, 1), (2 * 4096, 64, 8, 2), (96, 12, 4, 3)):
        w, idx = bench_layer.balanced_routing(rng, S, E, K)
        idx = np.asarray(idx)
        assert idx.shape == (S, K) and idx.min() >= 0 and idx.max() < E
        np.testing.assert_array_equal(np.bincount(idx.reshape(-1), minlength=E),
                                      np.full(E, S * K // E))
        assert all(len(set(row)) == K for row in idx.tolist())
        ranks = idx // (E // R)
        if R > 1:                                  # a token reaches several ranks
            assert (np.ptp(ranks, axis=1) > 0).all(), (S, E, K, R)
        np.testing.assert_allclose(np.asarray(w, np.float32).sum(axis=1), 1.0, atol=2e-2)


def test_bench_layer_paired_ratios_are_medians_of_the_rounds_ratios():
    """With paired rounds, a same-run ratio is the median over rounds of the two layers'
    ratio (each round's clock weighs on both sides), not the ratio of their medians."""
    import bench_layer
    rows = {
        "moe_ffn": {"fwd_ms": 2.0, "fwd_ms_rounds": [1.0, 2.0, 3.0], "step_bytes": 6},
        "expert compute alone": {"fwd_ms": 1.0, "fwd_ms_rounds": [1.0, 1.0, 3.0],
                                 "step_bytes": 4},
        "GShard capacity 1.25 + einsum": {"fwd_ms": 4.0},
        bench_layer.ROUTED: {"fwd_ms": 1.5, "fwd_ms_rounds": [2.0, 1.0, 3.0]},
    }
    r = bench_layer.ratios(rows)
    assert r["default / expert compute fwd"] == pytest.approx(1.0)   # median of 1, 2, 1
    assert r[f"default / {bench_layer.ROUTED} fwd"] == pytest.approx(1.0)     # 0.5, 2, 1
    assert r[f"{bench_layer.ROUTED} / expert compute fwd"] == pytest.approx(1.0)  # 2, 1, 1
    assert r["default / expert compute memory"] == pytest.approx(1.5)
    assert r["gshard / default fwd"] == pytest.approx(2.0)          # no rounds: the figures'
    del rows["moe_ffn"]["fwd_ms_rounds"]                             # one side without rounds
    assert bench_layer.ratios(rows)["default / expert compute fwd"] == pytest.approx(2.0)


def test_bench_layer_routed_sizes_keep_the_rows_and_the_routings_shares():
    """routed_sizes: per rank, T * K rows in groups of the routing's counts (exactly those at
    R = 1), masked slots ignored, a rank with no pairs in equal groups."""
    import bench_layer
    rng = np.random.default_rng(3)
    S, L, K = 512, 8, 4
    _, idx = bench_layer.draw_routing(rng, "zipf", S, L, K, zipf_s=1.5)
    idx = np.asarray(idx)
    np.testing.assert_array_equal(bench_layer.routed_sizes(idx, 1, L, S * K),
                                  np.bincount(idx.reshape(-1), minlength=L))
    R = 2
    _, idx = bench_layer.draw_routing(rng, "zipf", S, R * L, K, zipf_s=1.5)
    idx = np.asarray(idx).copy()
    idx[::3, 0] = -1
    got = bench_layer.routed_sizes(idx, R, L, 1000).reshape(R, L)
    counts = np.bincount(idx[idx >= 0], minlength=R * L).reshape(R, L)
    assert got.dtype == np.int32 and (got.sum(axis=1) == 1000).all()
    np.testing.assert_allclose(got, counts * 1000 / counts.sum(axis=1, keepdims=True), atol=1)
    idx = np.where(idx < L, idx, 0)                # rank 1 receives nothing
    got = bench_layer.routed_sizes(idx, R, L, 1001).reshape(R, L)
    assert got.sum() == 2002 and sorted(set(got[1].tolist())) == [125, 126]


def test_bench_layer_draw_routing_by_name():
    """draw_routing: "balanced" gives every expert the same pairs, "uniform" and "zipf" the
    softmax top-k of their logits (zipf's far more skewed), another name is refused."""
    import bench_layer
    S, E, K = 2048, 16, 4
    counts = {}
    for name in ("balanced", "uniform", "zipf"):
        w, idx = bench_layer.draw_routing(np.random.default_rng(1), name, S, E, K, zipf_s=2.0)
        idx = np.asarray(idx)
        assert idx.shape == (S, K) and np.asarray(w).shape == (S, K), name
        assert all(len(set(row)) == K for row in idx.tolist()), name
        counts[name] = np.bincount(idx.reshape(-1), minlength=E)
    assert (counts["balanced"] == S * K // E).all()
    assert counts["uniform"].max() < 1.3 * S * K / E < counts["zipf"].max()
    with pytest.raises(SystemExit, match="--routing: 'skewed'"):
        bench_layer.draw_routing(np.random.default_rng(1), "skewed", S, E, K)


@pytest.mark.parametrize("fused_first_half", [False, True])
def test_moe_parts_run_on_the_rows_of_the_layers_first_pass(mesh4, fused_first_half):
    """The parts of the layer that bench_moe.py and bench_moe_ranks.py time alone (the first
    half, unfused here: the fused one needs the CUDA backend; and the layer with only its first
    half fused, through its unfused fallback) size their expert-major rows as moe_ffn's first
    pass does (moe_capacity), not as an expert-major dispatch's worst case, so that the time
    split adds up to the layer."""
    import jax_ep
    import moe_parts
    from helpers import smap
    R, T, K, L, H, I = 4, 16, 4, 4, 8, 6
    E = R * L
    rows = jax_ep.moe_capacity(T, num_experts=E, num_topk=K, num_ranks=R, fused=True,
                               backend="reference")
    assert rows < T * R * min(K, L), "the check must tell the two capacities apart"
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).reshape(R, T, K),
                      jnp.int32)
    x = jnp.ones((R, T, H), jnp.float32)
    w = jnp.ones((R, T, K), jnp.float32)
    wgu = jnp.ones((R, L, H, 2 * I), jnp.float32)
    if fused_first_half:
        # the whole layer's output is [T, H]; its dispatch's rows show in the jaxpr
        wd = jnp.ones((R, L, I, H), jnp.float32)
        fn = moe_parts.fused_first_half_only(E, "reference")
        jaxpr = str(jax.make_jaxpr(smap(mesh4, fn, jit=False))(x, idx, w, wgu, wd))
        assert f"{rows},{H}]" in jaxpr.replace(" ", ""), jaxpr[:2000]
        return
    out = jax.eval_shape(smap(mesh4, moe_parts.first_half(False, E, "reference")), x, idx, w,
                         wgu)
    assert out.shape == (R, rows, 2 * I), out.shape


def test_layout_plan_times_every_array_of_the_xla_plan(mesh4):
    """layout_plan.py times `expert_layout.plan` through read_every_array, so the compiled scan
    still sorts the pairs: the harness keeps only a call's smallest output, and of a plan
    returned whole XLA drops what that leaves unused, the sort among it (which a custom call,
    run whole, would not get)."""
    import functools

    import layout_plan
    from jax_ep import expert_layout
    ridx = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(-1, 4, (4 * 64, 2)),
                                      jnp.int32), NamedSharding(mesh4, P("ep")))
    plan = functools.partial(expert_layout.plan, num_local_experts=4, capacity=160, alignment=1)

    def sorts(body):
        return " sort(" in compiled(mesh4, body, (ridx,), 2)
    assert sorts(functools.partial(layout_plan.read_every_array, plan))
    assert not sorts(plan)   # what the benchmark measured before it read every array
