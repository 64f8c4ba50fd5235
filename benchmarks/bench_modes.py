"""One process over all GPUs beside one process per GPU (NVSHMEM), same GPUs, one run.

Runs benchmarks/bench.py twice with the same arguments: first in this machine's one-process
mode, then under `python -m jax_ep.launch -n R` (R processes, one GPU each), then prints the two
side by side (jax_ep rows and the lax baselines) and writes results_modes.json and
bench_modes.png into --out. Arguments after the options go to bench.py unchanged.

  python benchmarks/bench_modes.py --ranks 4 --out /tmp/b -- --mode ht ll --sms 24 --iters 10
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
      python benchmarks/bench_modes.py --ranks 2 --out DIR -- --backend reference --mode ll \
      --ll-fused-only --tokens 16 --ll-tokens 8 --hidden 256 --topk 2 --experts-per-rank 2 \
      --iters 4 --reps 1   (checks the script on a CPU: R host devices, then R processes)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("rest", nargs=argparse.REMAINDER)
    a = p.parse_args()
    rest = [x for x in a.rest if x != "--"]
    a.out = os.path.abspath(a.out)  # the runs start in /tmp
    os.makedirs(a.out, exist_ok=True)
    bench = os.path.join(HERE, "bench.py")
    common = ["--ranks", str(a.ranks), "--out", a.out] + rest
    runs = {
        "one process": [sys.executable, bench, "--tag=_one_process"] + common,
        "one per GPU": [sys.executable, "-m", "jax_ep.launch", "-n", str(a.ranks), bench,
                        "--tag=_per_process"] + common,
    }
    # One device per process: no forced host devices there (a CPU check's XLA_FLAGS gives the
    # one-process run its R devices).
    per = dict(os.environ)
    per["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              per.get("XLA_FLAGS", "")).strip()
    envs = {"one process": dict(os.environ), "one per GPU": per}
    results = {}
    for mode, cmd in runs.items():
        print(f"=== {mode}: {' '.join(cmd)}", flush=True)
        r = subprocess.run(cmd, cwd="/tmp", env=envs[mode])
        tag = "_one_process" if mode == "one process" else "_per_process"
        path = os.path.join(a.out, f"results{tag}.json")
        if r.returncode != 0 or not os.path.exists(path):
            sys.exit(f"bench_modes: the {mode} run failed (exit {r.returncode})")
        with open(path) as f:
            results[mode] = json.load(f)["rows"]
    key = lambda r: (r["mode"], r["ranks"], r["op"], r["impl"], str(r["sms"]))  # noqa: E731
    one = {key(r): r for r in results["one process"]}
    per = {key(r): r for r in results["one per GPU"]}
    rows = []
    print("\n| mode | GPUs | op | impl | SMs | one process us | one per GPU us | per-GPU / one |")
    print("|---|---|---|---|---|---|---|---|")
    for k in one:
        if k not in per:
            continue
        u1, u2 = one[k]["us"], per[k]["us"]
        rows.append(dict(zip(("mode", "ranks", "op", "impl", "sms"), k), one_process_us=u1,
                         per_process_us=u2))
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {u1:.1f} | {u2:.1f} | "
              f"{u2 / u1:.2f} |")
    with open(os.path.join(a.out, "results_modes.json"), "w") as f:
        json.dump(dict(args=vars(a), rows=rows), f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(11, 5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["one_process_us"] for r in rows], 0.4,
               label="one process")
        ax.bar([x + 0.2 for x in xs], [r["per_process_us"] for r in rows], 0.4,
               label="one process per GPU (NVSHMEM)")
        ax.set_yscale("log")
        ax.set_ylabel("median us per call (log)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['mode']} {r['op']}\n{r['impl']} {r['sms']}" for r in rows],
                           rotation=90, fontsize=6)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "bench_modes.png"), dpi=120)
    except Exception as e:  # noqa: BLE001 - matplotlib missing: the JSON has everything
        print(f"(no plot: {e})")


if __name__ == "__main__":
    main()
