"""What the layer's dropless passes cost when the first pass holds every pair: `moe_ffn` as it is
(the pair counts' all_gather and the extra passes' while loops, forward and backward, which run
no pass here), the same layer with the fused forward's passes summed after the first pass
instead of before its GEMM + combine, and the same layer with one pass forced (`passes_needed`
patched to 1: no exchange, no loop; exact only while the first pass holds every pair, as
uniform routing at the default capacity does), beside the expert compute alone, in paired
rounds of one run, with the memory XLA plans for each one's step and training step (as
bench_layer.py's: gradients reduced to scalars, and every gradient returned).

XLA reads a while loop's predicate on the host: the stream drains there, and the GPU idles
until the host has launched what follows (docs/design.md#layer-passes-sync,
docs/design.md#layer-passes-early).

  python benchmarks/pass_loop_cost.py --ranks 2 --out DIR      (over R GPUs, one process)
  python benchmarks/pass_loop_cost.py --ranks 2 --virtual      (R virtual ranks on one GPU)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/pass_loop_cost.py \
      --backend reference --ranks 2 --tokens 16 --hidden 64 --inter 32 --experts 2 --topk 2
      (checks the script on a CPU)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

import numpy as np

import jax

import jax_ep
from jax_ep import moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import (add_shape_args, expert_compute, layer_inputs,  # noqa: E402
                         step_bytes, topk_routing, training_step, with_backward)
from harness import (add_virtual_arg, op_timer, paired, rank_map, rank_mesh,  # noqa: E402
                     scan_fn)


@contextlib.contextmanager
def passes(kind):
    """moe_ffn traced as it is (None), with the passes after the first summed after it ("late":
    the loop at the end of the forward), or with passes_needed forced to 1 ("one": no loop)."""
    saved = moe.el.passes_needed, moe._Passes
    if kind == "one":
        moe.el.passes_needed = lambda *a, **k: 1
    elif kind == "late":
        moe._Passes = lambda plan, ids_of, early, unwritten: saved[1](plan, ids_of, False,
                                                                      unwritten)
    try:
        yield
    finally:
        moe.el.passes_needed, moe._Passes = saved


VARIANTS = {"moe_ffn": None, "passes summed after the first": "late",
            "one pass forced (no loop)": "one"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="2")
    add_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scan", default="2,6", help="n_short,n_long calls of the timed scans")
    ap.add_argument("--fused", default="default", help="default, True or False")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name")
    add_virtual_arg(ap)
    args = ap.parse_args()
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    be = args.backend
    fused = {"default": None, "True": True, "False": False}[args.fused]
    n_short, n_long = (int(v) for v in args.scan.split(","))
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    where = "1, virtual ranks" if args.virtual else len(devs)
    print(f"device: {devs[0].device_kind} x {where}, jax {jax.__version__}, backend {be}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    rows = []
    for R in (int(r) for r in args.ranks.split(",")):
        mesh, ranked = rank_mesh(R, args.virtual)
        if mesh is None:
            continue
        E = R * L
        wgu, wd, x, xr = map(ranked, layer_inputs(R, mesh, R, T, H, I, L, K))
        w, idx = map(ranked, topk_routing(rng.standard_normal((R * T, E)), K))
        lay = (x, idx, w, wgu, wd)

        def layer(*a):
            return jax_ep.moe_ffn(*a, num_experts=E, fused=fused, backend=be)
        timers, outs, plans = {}, {}, {}

        def plan(f, argnums, fargs, tokens_of_rows=0):
            """What XLA plans per GPU for a step (bench_layer's "step" and "training step")."""
            bwd = with_backward(f, argnums)
            return (step_bytes(scan_fn(mesh, bwd, 1).lower(*fargs).compile())[0],
                    step_bytes(rank_map(mesh, training_step(f, argnums, tokens_of_rows))
                               .lower(*fargs).compile())[0])
        for name, p in VARIANTS.items():
            with passes(p):
                outs[name] = np.asarray(rank_map(mesh, layer)(*lay), np.float32)
                plans[name] = plan(layer, (0, 2, 3, 4), lay)
                for op, f in (("fwd", layer), ("fwd+bwd", with_backward(layer, (0, 2, 3, 4)))):
                    timers[name, op] = op_timer(f, lay, n_short, n_long, reps=1, mesh=mesh)
        ec = functools.partial(expert_compute, backend=be)
        ec_args = (xr, w, wgu, wd)
        if not args.virtual:
            plans["expert compute alone"] = plan(ec, (0, 1, 2, 3), ec_args, K)
        # (not with virtual ranks: they share one GPU, so no rank's expert compute is a base)
        names = [*VARIANTS] + ([] if args.virtual else ["expert compute alone"])
        for op, f in (("fwd", ec), ("fwd+bwd", with_backward(ec, (0, 1, 2, 3))))[
                :0 if args.virtual else 2]:
            timers["expert compute alone", op] = op_timer(f, ec_args, n_short, n_long, reps=1,
                                                          mesh=mesh)
        # each side in turn, so that clock drift weighs alike
        times = {key: [t * 1e3 for t in ts] for key, ts in paired(timers, args.rounds).items()}
        ref = outs["moe_ffn"]
        print(f"\n== R={R}{' virtual' if args.virtual else ''} T={T} H={H} I={I} L={L} K={K} "
              f"uniform, fused={args.fused}: "
              f"ms per call, median of {args.rounds} paired rounds")
        base = {op: float(np.median(times["expert compute alone", op])) if not args.virtual
                else float("nan") for op in ("fwd", "fwd+bwd")}
        for name in names:
            row = dict(ranks=R, virtual=args.virtual, name=name)
            for op in ("fwd", "fwd+bwd"):
                row[op + "_ms"] = float(np.median(times[name, op]))
                row[op + "_rounds"] = times[name, op]
                row[op + "_over_expert_compute"] = row[op + "_ms"] / base[op]
            if name in plans:
                row["step_bytes"], row["train_step_bytes"] = plans[name]
            if name in outs:
                row["rel_diff_vs_first"] = float(np.linalg.norm(outs[name] - ref)
                                                 / max(np.linalg.norm(ref), 1e-30))
            rows.append(row)
            print(f"  {name:<34} fwd {row['fwd_ms']:7.3f} ({row['fwd_over_expert_compute']:.3f})"
                  f"  fwd+bwd {row['fwd+bwd_ms']:7.3f} "
                  f"({row['fwd+bwd_over_expert_compute']:.3f})"
                  + (f"  step {row['step_bytes'] / 1e9:.2f} GB, training step "
                     f"{row['train_step_bytes'] / 1e9:.2f} GB" if name in plans else "")
                  + (f"  diff {row['rel_diff_vs_first']:.1e}" if name in outs else ""))
        layer, late, one = (rows[-len(names) + i] for i in range(3))
        print("  the loop and the count exchange: " + ", ".join(
            f"{op} {layer[op + '_ms'] - one[op + '_ms']:.3f} ms" for op in ("fwd", "fwd+bwd")))
        print("  the passes summed before the first pass's GEMM + combine, against after it: "
              + ", ".join(f"{op} {layer[op + '_ms'] - late[op + '_ms']:.3f} ms"
                          for op in ("fwd", "fwd+bwd")))
    with open(os.path.join(args.out, f"pass_loop_cost{args.tag}.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
