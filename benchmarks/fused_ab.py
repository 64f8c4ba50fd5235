"""An A/B of the fused halves' Python, in one process: `moe_ffn` with the installed `jax_ep.fused`
against the same layer with another checkout's `jax_ep/fused.py` (e.g. the last commit's: `git show
HEAD:jax_ep/fused.py > /tmp/fused_base.py`) swapped in for the layer's two fused halves (their
forward and custom-VJP rules; the kernels are the installed ones), against another checkout's
`jax_ep/moe.py` swapped in for `moe_ffn` (the layer's passes around the installed halves), or
against the installed one traced with a setting (`--baseline env:JAX_EP_FUSED_BACKWARD=0`: the
backward on the unfused ops). Forward and forward + backward, timed in paired rounds (each variant
in turn, so that clock drift weighs alike), the memory XLA plans for the step and for the forward
alone, and how far the output and the gradients of the baseline are from the installed one's.

  python benchmarks/fused_ab.py --baseline /tmp/fused_base.py --ranks 2,1 --out DIR
  python benchmarks/fused_ab.py --baseline env:JAX_EP_FUSED_BACKWARD=0 --ranks 4,2 --out DIR
  python benchmarks/fused_ab.py --baseline /tmp/fused_base.py --ranks 2 --virtual --out DIR
      (R virtual ranks on one GPU: each rank's kernels on its share of the SMs)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import numpy as np

import jax

import jax_ep
from jax_ep import fused, moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import (add_shape_args, layer_inputs, step_bytes, topk_routing,  # noqa: E402
                         training_step, with_backward)
from harness import (add_virtual_arg, op_timer, paired, rank_map, rank_mesh,  # noqa: E402
                     scan_fn)


def load_baseline(spec):
    """`env:NAME=VALUE`: that setting (a dict), else the module of another checkout's fused.py
    or moe.py at that path (importing the installed jax_ep)."""
    if spec.startswith("env:"):
        name, _, value = spec[4:].partition("=")
        if not name.startswith("JAX_EP_"):
            raise SystemExit(f"--baseline {spec!r}: expected env:JAX_EP_NAME=VALUE")
        return {name: value}
    spec_ = importlib.util.spec_from_file_location("jax_ep._fused_baseline", spec)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


def second_half(mod):
    """A fused.py module's GEMM + combine as the layer calls it (`matmul_combine_plus`). A
    fused.py from before the addend has only `matmul_combine`: the extra passes' sum is then
    added by XLA (`plus_addend`), a pass over [T, H] wherever the layer has a loop of them,
    which that baseline's figures carry."""
    if hasattr(mod, "matmul_combine_plus"):
        return mod.matmul_combine_plus

    def plus(a, w, res, addend, **kw):
        out = mod.matmul_combine(a, w, res, **kw)
        return out if addend is None else fused.plus_addend(out, addend)
    return plus


@contextlib.contextmanager
def halves(variant):
    """moe_ffn traced with a variant: None, the installed one; a fused.py module, its fused
    halves; a moe.py module, its moe_ffn (the installed kernels and ops beneath); a dict, the
    installed layer with those settings."""
    saved = moe.dispatch_matmul_swiglu, moe.matmul_combine_plus, jax_ep.moe_ffn
    env = variant if isinstance(variant, dict) else {}
    saved_env = {k: os.environ.get(k) for k in env}
    if hasattr(variant, "moe_ffn"):
        jax_ep.moe_ffn = variant.moe_ffn
    elif variant is not None and not env:
        moe.dispatch_matmul_swiglu, moe.matmul_combine_plus = (variant.dispatch_matmul_swiglu,
                                                               second_half(variant))
    os.environ.update(env)
    try:
        yield
    finally:
        moe.dispatch_matmul_swiglu, moe.matmul_combine_plus, jax_ep.moe_ffn = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True,
                    help="another checkout's jax_ep/fused.py, or env:JAX_EP_NAME=VALUE")
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="2,1")
    add_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scan", default="2,6", help="n_short,n_long calls of the timed scans")
    add_virtual_arg(ap)
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name")
    args = ap.parse_args()
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    n_short, n_long = (int(v) for v in args.scan.split(","))
    variants = {"installed": None, "baseline": load_baseline(args.baseline)}
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    where = "1, virtual ranks" if args.virtual else len(devs)
    print(f"device: {devs[0].device_kind} x {where}, jax {jax.__version__}, "
          f"baseline {args.baseline}")
    rows = []
    for R in (int(r) for r in args.ranks.split(",")):
        mesh, ranked = rank_mesh(R, args.virtual)
        if mesh is None:
            continue
        E = R * L
        wgu, wd, x, _ = map(ranked, layer_inputs(R, mesh, R, T, H, I, L, K))
        w, idx = map(ranked, topk_routing(rng.standard_normal((R * T, E)), K))
        lay = (x, idx, w, wgu, wd)

        def layer(*a):
            return jax_ep.moe_ffn(*a, num_experts=E)
        timers, outs, mem, mem_fwd = {}, {}, {}, {}
        for name, mod in variants.items():
            with halves(mod):
                # the output, and the gradients in x, the weights and both weight matrices
                grads = rank_map(mesh, training_step(layer, (0, 2, 3, 4)))(*lay)[1]
                outs[name] = [np.asarray(v, np.float32) for v in
                              (rank_map(mesh, layer)(*lay), *grads)]
                for op, f in (("fwd", layer), ("fwd+bwd", with_backward(layer, (0, 2, 3, 4)))):
                    timers[name, op] = op_timer(f, lay, n_short, n_long, reps=1, mesh=mesh)
                # (one call in the harness's scan: bench_layer.py's step figure)
                mem[name] = step_bytes(scan_fn(mesh, with_backward(layer, (0, 2, 3, 4)), 1)
                                       .lower(*lay).compile())[0]
                mem_fwd[name] = step_bytes(scan_fn(mesh, layer, 1).lower(*lay).compile())[0]
        times = {key: [t * 1e3 for t in ts] for key, ts in paired(timers, args.rounds).items()}
        print(f"\n== R={R} T={T} H={H} I={I} L={L} K={K} uniform, default arguments: ms per call, "
              f"median of {args.rounds} paired rounds; memory XLA plans for the step and the "
              "forward")
        for name in variants:
            diffs = [float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                     for a, b in zip(outs[name], outs["installed"])]
            row = dict(ranks=R, name=name, step_bytes=mem[name], fwd_bytes=mem_fwd[name],
                       rel_diff_vs_installed=diffs[0], grad_rel_diffs_vs_installed=diffs[1:])
            for op in ("fwd", "fwd+bwd"):
                row[op + "_ms"] = float(np.median(times[name, op]))
                row[op + "_rounds"] = times[name, op]
            rows.append(row)
            print(f"  {name:<10} fwd {row['fwd_ms']:7.3f}  fwd+bwd {row['fwd+bwd_ms']:7.3f}  "
                  f"step {mem[name] / 1e9:.2f} GB  fwd {mem_fwd[name] / 1e9:.3f} GB  "
                  f"diff {row['rel_diff_vs_installed']:.1e}, "
                  f"gradients {max(diffs[1:]):.1e}")
    with open(os.path.join(args.out, f"fused_ab{args.tag}.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, virtual=args.virtual,
                       baseline=args.baseline, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
