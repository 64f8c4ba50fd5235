"""R = 1: moe_ffn (fused) against the same with its second half unfused (grouped_matmul + the
combine op), paired rounds, with the expert compute; outputs compared."""
import os, sys, functools, contextlib
R_ = os.environ["R"]
sys.path.insert(0, R_ + "/benchmarks")
import numpy as np, jax, jax.numpy as jnp
import jax_ep
from jax_ep import moe, fused, high_throughput
from bench_layer import layer_inputs, topk_routing, with_backward, expert_compute, step_bytes, training_step
from harness import rank_mesh, rank_map, op_timer, paired, scan_fn

R = int(os.environ.get("RANKS", "1"))
T, H, I, L, K = (int(v) for v in os.environ.get("SHAPE", "4096,7168,2048,32,8").split(","))
BE = os.environ.get("BACKEND", "cuda")
E = R * L
mesh, ranked = rank_mesh(R, False)
wgu, wd, x, xr = map(ranked, layer_inputs(R, mesh, R, T, H, I, L, K))
w, idx = map(ranked, topk_routing(np.random.default_rng(0).standard_normal((R * T, E)), K))
lay = (x, idx, w, wgu, wd)
layer = lambda *a: jax_ep.moe_ffn(*a, num_experts=E, backend=BE)

def hybrid_second(a, w, res, addend, *, axis_name, backend, combine_blocks, weight_grad_acc):
    y = fused._unfused_matmul(a, w, res.expert_sizes, weight_grad_acc, BE)
    out = high_throughput.combine(y, res.handle, axis_name=axis_name, backend=BE)
    return out if addend is None else fused.plus_addend(out, addend)

@contextlib.contextmanager
def variant(v):
    saved = moe.matmul_combine_plus
    if v == "hybrid":
        moe.matmul_combine_plus = hybrid_second
    try:
        yield
    finally:
        moe.matmul_combine_plus = saved

rounds = int(os.environ.get("ROUNDS", "5"))
timers, outs, grads = {}, {}, {}
names = ["fused", "hybrid"]
for v in names:
    with variant(v):
        outs[v] = np.asarray(rank_map(mesh, layer)(*lay), np.float32)
        g = rank_map(mesh, lambda *a: jax.grad(lambda *b: jnp.sum(layer(*b).astype(jnp.float32)), argnums=(0, 3, 4))(*a))(*lay)
        grads[v] = [np.asarray(t, np.float32) for t in g]
        s = step_bytes(scan_fn(mesh, with_backward(layer, (0, 2, 3, 4)), 1).lower(*lay).compile())[0]
        t = step_bytes(rank_map(mesh, training_step(layer, (0, 2, 3, 4))).lower(*lay).compile())[0]
        print(f"{v}: step {s / 1e9:.3f} GB, training step {t / 1e9:.3f} GB", flush=True)
        for op, f in (("fwd", layer), ("fwd+bwd", with_backward(layer, (0, 2, 3, 4)))):
            timers[v, op] = op_timer(f, lay, 1, 9, reps=1, mesh=mesh)
ec = functools.partial(expert_compute, backend=BE)
for op, f in (("fwd", ec), ("fwd+bwd", with_backward(ec, (0, 1, 2, 3)))):
    timers["expert", op] = op_timer(f, (xr, w, wgu, wd), 1, 9, reps=1, mesh=mesh)
rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
print("hybrid vs fused: out rel diff", rel(outs["hybrid"], outs["fused"]),
      "grads", [rel(a, b) for a, b in zip(grads["hybrid"], grads["fused"])], flush=True)
times = {k: [t * 1e3 for t in ts] for k, ts in paired(timers, rounds).items()}
for v in names + ["expert"]:
    print(f"{v:8s} " + "  ".join(f"{op} {np.median(times[v, op]):.3f} ms {['%.3f' % t for t in times[v, op]]}" for op in ("fwd", "fwd+bwd")), flush=True)
for v in names:
    print(f"{v} / expert, median of the rounds' ratios: " + ", ".join(
        f"{op} {np.median(np.divide(times[v, op], times['expert', op])):.4f}" for op in ("fwd", "fwd+bwd")))
print("hybrid - fused, paired medians: " + ", ".join(
    f"{op} {np.median(np.subtract(times['hybrid', op], times['fused', op])):+.3f} ms" for op in ("fwd", "fwd+bwd")))
