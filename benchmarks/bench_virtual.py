"""The communication ops at R virtual ranks on one GPU (the one-GPU multi-rank mode).

An A/B tool for kernel changes when only one GPU is at hand: the R ranks share one GPU's SMs
and memory, so the figures are not those of R GPUs (benchmarks/bench.py measures those);
compare builds within one run only, e.g. by running this script against each build in turn.

    python benchmarks/bench_virtual.py --ranks 2 --out DIR [--tag NAME]
    python benchmarks/bench_virtual.py --backend reference --ranks 2 --tokens 16 \
        --ll-tokens 8 --hidden 256 --topk 2 --experts-per-rank 2 --reps 1 --out DIR
        (checks the script on a CPU)

Times each op as the slope between jit-compiled scans of 2 and 8 calls (harness.time_op),
medians over --reps interleaved pairs. Prints a table and writes DIR/bench_virtual<tag>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from harness import time_op  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import testing  # noqa: E402

AX = "vr"  # the virtual ranks' axis (the harness's shard_map uses "ep")


def ops(R, T, M, H, K, E, backend="cuda"):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([[rng.permutation(E)[:K] for _ in range(T)] for _ in range(R)]),
                      jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    vr = lambda f: testing.virtual_ranks(f, R, axis_name=AX)  # noqa: E731
    ll = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AX, backend=backend)
    ll_d = vr(lambda x, i: jax_ep.low_latency_dispatch(x, i, **ll))
    ll_bf = jax.jit(vr(lambda x, i: jax_ep.low_latency_dispatch(x, i, use_fp8=False, **ll)))(
        x, idx)
    y_ll = ll_bf.recv_x
    ll_c = vr(lambda y, i, w, h: jax_ep.low_latency_combine(y, i, w, h, axis_name=AX,
                                                            backend=backend))
    ht = dict(num_experts=E, axis_name=AX, backend=backend)
    ht_d = vr(lambda x, i, w: jax_ep.dispatch(x, i, w, **ht))
    r = jax.jit(ht_d)(x, idx, w)
    ht_c = vr(lambda y, h: jax_ep.combine(y, h, axis_name=AX, backend=backend))
    return [
        ("low_latency_dispatch (FP8)", ll_d, (x, idx)),
        ("low_latency_combine", ll_c, (y_ll, idx, w, ll_bf.handle)),
        ("dispatch (high-throughput)", ht_d, (x, idx, w)),
        ("combine (high-throughput)", ht_c, (r.recv_x, r.handle)),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="high-throughput tokens per rank")
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--tag", default="")
    p.add_argument("--backend", default="cuda", choices=["cuda", "reference"],
                   help="'reference' checks the script on a CPU (the pure-JAX ops)")
    a = p.parse_args()
    R, E = a.ranks, a.ranks * a.experts_per_rank
    rows = []
    for T, names in ((a.ll_tokens, ("low_latency_dispatch (FP8)", "low_latency_combine")),
                     (a.tokens, ("dispatch (high-throughput)", "combine (high-throughput)"))):
        for name, fn, args in ops(R, T, T, a.hidden, a.topk, E, a.backend):
            if name not in names:
                continue
            med, lo, hi = time_op(fn, args, reps=a.reps)
            rows.append({"op": name, "tokens": T, "us": med * 1e6, "min_us": lo * 1e6,
                         "max_us": hi * 1e6})
            print(f"{name:30s} T={T:5d}  {med * 1e6:9.1f} us  [{lo * 1e6:.1f}, {hi * 1e6:.1f}]",
                  flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"ranks": R, "backend": a.backend, "hidden": a.hidden, "topk": a.topk, "experts": E,
            "reps": a.reps, "jax_ep": jax_ep.__file__, "device": jax.devices()[0].device_kind}
    (out / f"bench_virtual{a.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                               indent=1))


if __name__ == "__main__":
    main()
