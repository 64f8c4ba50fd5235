"""What placing a rank's received pairs in the expert-major layout costs (`expert_layout.plan`,
the step every expert-major dispatch and the fused layer run before their rows move): the CUDA
kernels (`jax_ep_expert_positions`, a counting sort over blocks) against XLA's ops (a sort by
expert and scatters), on one GPU, in paired rounds of one run. The shapes are one rank's first
pass of `moe_ffn` at R ranks: R * T received rows, each of whose K slots names one of this
rank's L experts with probability 1 / R (top-K over R * L experts, uniform), and
`moe_capacity`'s rows with the fused layer's alignment. Each form is timed as one scalar that
reads every array it returns (sums of a few microseconds, in both figures alike), so that XLA
keeps all of its ops.

  python benchmarks/layout_plan.py --ranks 1,2,4 --out DIR
  python benchmarks/layout_plan.py --trace 8    (also each form's kernels per call, traced)
  XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/layout_plan.py \
      --backend reference --tokens 16 --experts 2 --topk 2   (checks the script on a CPU)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import jax_ep
from jax_ep import expert_layout, moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_times  # noqa: E402
from harness import barh_plot, op_timer, paired, ratio_median, scan_fn  # noqa: E402


def received_slots(R, T, L, K, seed):
    """[R * T, K] local expert ids or -1: each row's top-K distinct experts of R * L, those of
    this rank (the first L) kept."""
    rng = np.random.default_rng(seed)
    picks = rng.random((R * T, R * L)).argsort(axis=1)[:, :K]
    return jnp.asarray(np.where(picks < L, picks, -1).astype(np.int32))


def read_every_array(plan, ridx):
    """One int32 scalar that depends on every array of plan(ridx)."""
    return sum(jnp.sum(v, dtype=jnp.int32) for v in jax.tree_util.tree_leaves(plan(ridx)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="layout_plan_out")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated R (shapes only: one GPU)")
    ap.add_argument("--tokens", type=int, default=4096, help="per rank")
    ap.add_argument("--experts", type=int, default=32, help="per rank")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "reference"])
    ap.add_argument("--trace", type=int, default=0, metavar="CALLS",
                    help="also trace a scan of CALLS calls of each form and print its kernels' "
                         "summed durations per call (0: no trace)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    be, T, L, K = a.backend, a.tokens, a.experts, a.topk
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, backend {be}")
    if be == "cuda":
        A = int(jax_ep.runtime.extension().fused_block_rows)
        ways = {"CUDA kernels": "cuda", "XLA ops": "reference"}
    else:
        A = 1
        ways = {"XLA ops": "reference"}
        print("(reference backend: the CUDA kernels' row skipped)")
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    results = []
    for R in [int(r) for r in a.ranks.split(",")]:
        ridx = received_slots(R, T, L, K, seed=R)
        cap = moe.moe_capacity(T, num_experts=R * L, num_topk=K, num_ranks=R,
                               fused=be == "cuda", backend=be)
        plans = {name: functools.partial(expert_layout.plan, num_local_experts=L, capacity=cap,
                                         alignment=A, backend=way)
                 for name, way in ways.items()}
        outs = {name: jax.jit(f)(ridx) for name, f in plans.items()}
        ref = outs["XLA ops"]
        for name, out in outs.items():   # the same integers, every field
            for key in ref:
                if not np.array_equal(np.asarray(out[key]), np.asarray(ref[key])):
                    raise SystemExit(f"R={R}: {name}'s {key} differs from XLA's")
        # timed and traced as one scalar that reads every array: the harness keeps a call's
        # smallest output only, and XLA would drop whatever that leaves unused (the sort, the
        # scatters), while a custom call runs whole
        every = {name: functools.partial(read_every_array, f) for name, f in plans.items()}
        timers = {name: op_timer(f, (ridx,), reps=a.reps) for name, f in every.items()}
        rounds = paired(timers, a.rounds)
        row = {"R": R, "rows": R * T, "slots": R * T * K, "capacity": cap,
               "us": {n: float(np.median(v)) * 1e6 for n, v in rounds.items()},
               "rounds_us": {n: [x * 1e6 for x in v] for n, v in rounds.items()}}
        if "CUDA kernels" in rounds:
            row["kernels_over_xla"] = ratio_median(rounds["CUDA kernels"], rounds["XLA ops"])
        if a.trace:
            row["traced_us"] = {}
            for name, f in every.items():
                c = scan_fn(mesh, f, a.trace).lower(ridx).compile()
                jax.block_until_ready(c(ridx))
                with tempfile.TemporaryDirectory() as d:
                    res = kernel_times.trace_kernels(functools.partial(c, ridx), d, ".",
                                                     a.trace)
                row["traced_us"][name] = res["kernel_us_all"]
                if res["devices"]:
                    ks = sorted(next(iter(res["devices"].values()))["kernels"].items(),
                                key=lambda kv: -kv[1]["us_per_call"])
                    print(f"  R={R} {name}, traced: {res['kernel_us_all']:.1f} us of kernels per "
                          f"call, " + ", ".join(f"{k[:40]} {v['us_per_call']:.1f}"
                                                for k, v in ks[:8]))
        results.append(row)
        cells = "  ".join(f"{n} {u:8.1f} us" for n, u in row["us"].items())
        ratio = (f"  kernels / XLA {row['kernels_over_xla']:.2f}"
                 if "kernels_over_xla" in row else "")
        print(f"R={R}: {R * T} rows, {R * T * K} slots, capacity {cap}:  {cells}{ratio}")
    with open(os.path.join(a.out, "layout_plan.json"), "w") as f:
        json.dump({"device": dev.device_kind, "jax": jax.__version__, "backend": be,
                   "tokens": T, "experts": L, "topk": K, "alignment": A, "results": results},
                  f, indent=1)
    labels = [f"R={r['R']} {n}" for r in results for n in r["us"]]
    barh_plot(os.path.join(a.out, "layout_plan.png"), labels,
              [u for r in results for u in r["us"].values()], "us per call (slope)")
    print(f"wrote {os.path.join(a.out, 'layout_plan.json')}")


if __name__ == "__main__":
    main()
