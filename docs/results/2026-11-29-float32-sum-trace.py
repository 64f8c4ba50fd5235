"""A/B of moe.py (installed vs a baseline moe.py loaded as a module), R = 2, kernel traces of the
fused layer forward and forward + backward, alternating rounds: us per call of all kernels on
each GPU, and the kernels whose names differ most between the two."""
import functools, importlib.util, os, sys, tempfile
import numpy as np
import jax
from jax.sharding import Mesh
import jax_ep
R_DIR = sys.argv[1]
sys.path.insert(0, os.path.join(R_DIR, "benchmarks"))
import kernel_times
from bench_layer import draw_routing, layer_inputs, with_backward
from harness import scan_fn
spec = importlib.util.spec_from_file_location("jax_ep._moe_baseline", sys.argv[2])
base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)
ROUNDS = 3
R, T, H, I, L, K, CALLS = 2, 4096, 7168, 2048, 32, 8, 5
mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
E = R * L
wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
w, idx = draw_routing(np.random.default_rng(0), "uniform", R * T, E, K)
lay = (x, idx, w, wgu, wd)
for op in ("fwd", "fwd+bwd"):
    comp = {}
    for name, mod in (("new", jax_ep), ("base", base)):
        f = functools.partial(mod.moe_ffn, num_experts=E, backend="cuda")
        fn = (lambda *a, f=f: f(*a)) if op == "fwd" else with_backward(lambda *a, f=f: f(*a), (0, 2, 3, 4))
        comp[name] = scan_fn(mesh, fn, CALLS).lower(*lay).compile()
        for _ in range(2):
            jax.block_until_ready(comp[name](*lay))
    tot = {n: [] for n in comp}
    per = {n: {} for n in comp}
    for r in range(ROUNDS):
        for name, c in comp.items():
            with tempfile.TemporaryDirectory() as dd:
                t = kernel_times.trace_kernels(functools.partial(c, *lay), dd, ".", CALLS)
            dev0 = sorted(t["devices"])[0]
            row = {}
            for dev, dv in sorted(t["devices"].items()):
                row[dev[-5:]] = sum(v["us_per_call"] for v in dv["kernels"].values())
            tot[name].append(row)
            for k, v in t["devices"][dev0]["kernels"].items():
                per[name].setdefault(k, []).append(v["us_per_call"])
    for dev in tot["new"][0]:
        for name in tot:
            vals = [rw[dev] for rw in tot[name]]
            print(f"{op:8s} {name:4s} {dev} all kernels median {np.median(vals):8.1f} us  " + " ".join(f"{v:7.1f}" for v in vals))
    keys = set(per["new"]) | set(per["base"])
    diffs = sorted(keys, key=lambda k: -abs(np.median(per["new"].get(k, [0])) - np.median(per["base"].get(k, [0]))))
    for k in diffs[:8]:
        print(f"{op:8s} GPU0 new {np.median(per['new'].get(k, [0])):8.1f} base {np.median(per['base'].get(k, [0])):8.1f} us  {k[:90]}")
    del comp
    jax.clear_caches()
