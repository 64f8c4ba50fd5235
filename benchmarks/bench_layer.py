"""The MoE layer over R GPUs against its own expert compute and the plain-JAX layers a user would
write: forward, forward + backward, and the memory XLA plans for one training step.

Per rank: T tokens, hidden H, intermediate I, L experts (E = R * L), top-K, bf16; routing
uniform (softmax top-k of random logits), Zipf-skewed (expert e drawn with weight
1 / (1 + rank of e)^s, the ranks of the experts shuffled) or balanced (every expert receives
exactly R * T * K / E pairs, as the expert compute's equal groups: no expert's segment ends in a
partial GEMM tile when that is a multiple of 128); each (R, routing) block draws its routing
from the same seed, whatever blocks ran before it. For each R and each routing, in one run,
after warm-up, each figure the median slope between a jit-compiled scan of n_short calls and one
of n_long calls (benchmarks/harness.py; --scan, 1 and 9 calls: a slope over 8 calls, since one
over 2 let a forward round move by 40 % where 8 keep it within 7 %; a layer that takes over
SLOW_CALL_S a call, n_short + 2 calls); with --rounds N, every layer's timers run once per round
in turn (harness.paired), each figure is the median of the rounds' and each ratio the median of
the rounds' ratios, so that a clock drifting during the run weighs on both sides:
- `moe_ffn` with its default arguments, and with fused=False and fused=True;
- the expert compute alone: both grouped GEMMs, the activation and the weighted sum over K, on
  T * K rows per rank in L equal groups, no communication (the layer's floor);
- the expert compute on routed groups: the same on groups of the routing's sizes (each rank's
  counts per expert, scaled to T * K rows; at R = 1 the routing's own), whose last GEMM tiles
  are partial as the layer's are: what any grouped-GEMM layer pays for the routing's unevenness;
- the communication alone: `dispatch` and `combine` of the received rows;
- at R > 1, two plain-JAX layers: a GShard-style layer (a capacity factor per expert,
  `lax.all_to_all`, batched einsums) and `lax.ragged_all_to_all` + `lax.ragged_dot` (MaxText's
  GPU path); one that fails (out of memory, say) is reported as failed with its error, and an
  op that ran out of memory under one routing is not built again under the next.
Memory: temp + arguments + outputs - aliased, per device, from `compiled.memory_analysis()` of
the forward + backward (one call), twice: "step", whose gradients are each reduced to a scalar
(as the timed scans do, so XLA may free one before the next exists), and "train", a training
step that returns every gradient (what an optimizer update then reads: all of them at once;
the expert compute's gradient of its T * K rows summed per token, [T, H] as a layer's), one
call compiled on its own.
Every layer's output is checked against a dense MoE on a sample of tokens (float32, every
expert evaluated); the GShard layer drops the pairs past its capacity, so its error is
reported, not asserted.
Prints a table and the same-run ratios, writes bench_layer.json and bench_layer.png after
every block (a run cut short keeps the blocks it finished).

--compile-only plans the memory and runs nothing (no timing, no check), from abstract inputs.
--mock-topology 1x<R>x1 (JAX's mock GPU client: R mock GPUs on the first one) gives the plan of
R GPUs on a machine with fewer; the peer runtime is then not set up, since no mock GPU can run.

  python benchmarks/bench_layer.py --ranks 1,2,4 --out DIR
  python benchmarks/bench_layer.py --ranks 4 --mock-topology 1x4x1  (memory plans only)
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_layer.py \
      --backend reference --ranks 1,2 --tokens 32 --hidden 128 --inter 128 --experts 4 \
      --topk 2 --reps 1 --out DIR   (checks the script on a CPU)
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import moe as _moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
from harness import barh_plot, paired, rank_map, ratio_median, scan_fn, time_slope  # noqa: E402

# Seconds a call past which a layer's slope is taken over 2 calls: the host's jitter (about a
# millisecond an execution) is then under 1 % of it, and 8 calls of the ragged layer would take
# seconds each repetition.
SLOW_CALL_S = 0.05


# ---------------------------------------------------------------------------------------------
# The plain-JAX layers (per shard, inside shard_map over "ep")
# ---------------------------------------------------------------------------------------------

def gshard_layer(x, idx, w, wgu, wd, *, num_experts, capacity_factor=1.25, axis_name="ep"):
    """GShard's pattern: each source gives each expert `C = ceil(T * K * factor / E)` rows
    (pairs past them are dropped), one `all_to_all` there and one back, batched einsums."""
    R = lax.axis_size(axis_name)
    T, K = idx.shape
    E, H = num_experts, x.shape[1]
    L = E // R
    C = max(1, math.ceil(T * K * capacity_factor / E))
    flat = idx.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(E)[None, :]).astype(jnp.int32)        # [T*K, E]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    keep = (flat >= 0) & (pos < C)
    e = jnp.where(keep, flat, E)
    p = jnp.where(keep, pos, 0)
    buf = jnp.zeros((E + 1, C, H), x.dtype).at[e, p].set(jnp.repeat(x, K, axis=0),
                                                         mode="drop")[:E]
    got = lax.all_to_all(buf.reshape(R, L, C, H), axis_name, 0, 0, tiled=True)    # [R(s), L]
    rows = got.transpose(1, 0, 2, 3).reshape(L, R * C, H)
    h = jnp.einsum("lch,lhf->lcf", rows, wgu, preferred_element_type=jnp.float32)
    y = jnp.einsum("lci,lih->lch", _moe.swiglu(h).astype(x.dtype), wd,
                   preferred_element_type=jnp.float32).astype(x.dtype)
    back = lax.all_to_all(y.reshape(L, R, C, H).transpose(1, 0, 2, 3), axis_name, 0, 0,
                          tiled=True).reshape(E, C, H)
    out = back[jnp.minimum(e, E - 1), p].astype(jnp.float32)                     # [T*K, H]
    wk = jnp.where(keep, w.reshape(-1).astype(jnp.float32), 0.0)
    return jnp.sum((out * wk[:, None]).reshape(T, K, H), axis=1).astype(x.dtype)


def ragged_layer(x, idx, w, wgu, wd, *, num_experts, axis_name="ep"):
    """Each token once to each rank holding one of its experts with `lax.ragged_all_to_all`
    (worst-case R * T receive rows), the experts with sort + `lax.ragged_dot`, and back."""
    R = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    T, K = idx.shape
    L = num_experts // R
    dest = jnp.where(idx >= 0, idx // L, -1)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(R)[None, None, :], axis=1)   # [T, R]
    key = jnp.where(in_rank.T, jnp.arange(R)[:, None], R).reshape(-1)            # [R*T]
    order = jnp.argsort(key, stable=True)
    tok, valid = order % T, key[order] < R
    sizes = lax.all_gather(jnp.sum(in_rank, axis=0).astype(jnp.int32), axis_name)  # [s, q]
    send = sizes[me]
    send_off = (jnp.cumsum(send) - send).astype(jnp.int32)
    recv = sizes[:, me]
    recv_off = (jnp.cumsum(recv) - recv).astype(jnp.int32)
    lower = jnp.arange(R)[:, None] < me
    out_off = jnp.sum(jnp.where(lower, sizes, 0), axis=0).astype(jnp.int32)       # on each q
    back_off = jnp.sum(jnp.where(lower.T, sizes, 0), axis=1).astype(jnp.int32)   # on each s

    def there(a, fill):
        return lax.ragged_all_to_all(a[tok], jnp.full((R * T,) + a.shape[1:], fill, a.dtype),
                                     send_off, send, out_off, recv, axis_name=axis_name)
    rx, ridx, rw = there(x, 0), there(idx, -1), there(w, 0)
    local = jnp.where((ridx >= 0) & (ridx // L == me), ridx % L, -1)
    y = baselines.ragged_dot_moe(rx, local, rw, wgu, wd)                        # [R*T, H]
    got = lax.ragged_all_to_all(y, jnp.zeros_like(y), recv_off, recv, back_off, send,
                                axis_name=axis_name)
    got = jnp.where(valid[:, None], got, 0).astype(jnp.float32)
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[tok].add(got).astype(x.dtype)


# the expert compute on the routing's group sizes (routed_sizes): a baseline beside the floor
ROUTED = "expert compute on routed groups"
# the expert computes (their rows are T * K per rank) and the baselines that are parts of a
# layer, not layers (no check against the dense MoE)
EXPERT_COMPUTES = ("expert compute alone", ROUTED)
BASELINES = (*EXPERT_COMPUTES, "communication alone")


def expert_compute(xr, w, wgu, wd, sizes=None, *, backend):
    """The layer's floor: both grouped GEMMs, the activation and the weighted sum over K of the
    T * K rows of this rank (row t * K + k is slot k of token t), in L equal groups, or in groups
    of `sizes` [L] (routed_sizes)."""
    T, K = w.shape
    L = wgu.shape[0]
    if sizes is None:
        sizes = jnp.full((L,), T * K // L, jnp.int32)
    gm = functools.partial(jax_ep.grouped_matmul, backend=backend)
    y = gm(_moe.swiglu(gm(xr, wgu, sizes)).astype(wd.dtype), wd, sizes)
    y = y.reshape(T, K, -1).astype(jnp.float32) * w.astype(jnp.float32)[:, :, None]
    return jnp.sum(y, axis=1).astype(xr.dtype)


def routed_sizes(idx, R, L, rows):
    """[R * L] int32: per rank, the pairs each of its L experts receives under the routing
    (ids idx [S, K], -1 masked), scaled to `rows` in all by largest remainders; at R = 1, with
    every slot routed, the routing's own counts. A rank that receives nothing gets equal
    groups."""
    idx = np.asarray(idx).reshape(-1)
    counts = np.bincount(idx[idx >= 0], minlength=R * L).reshape(R, L).astype(np.float64)
    out = np.zeros((R, L), np.int64)
    for r in range(R):
        total = counts[r].sum()
        exact = counts[r] * rows / total if total else np.full(L, rows / L)
        out[r] = np.floor(exact)
        short = rows - int(out[r].sum())
        out[r, np.argsort(out[r] - exact, kind="stable")[:short]] += 1
    return out.reshape(-1).astype(np.int32)


def communication(x, idx, w, *, num_experts, backend):
    """The layer's token traffic alone: each token to its ranks once, and its rows back."""
    res = jax_ep.dispatch(x, idx, w, num_experts=num_experts, backend=backend)
    return jax_ep.combine(res.recv_x, res.handle, backend=backend)


def dense_moe(x, idx, w, wgu, wd):
    """out[t] = sum_k w[t, k] * FFN_{idx[t, k]}(x[t]), every expert evaluated, in float32."""
    x32 = x.astype(jnp.float32)

    def step(acc, ew):
        e, gu, d = ew
        h = x32 @ gu.astype(jnp.float32)
        y = _moe.swiglu(h) @ d.astype(jnp.float32)
        we = jnp.sum(jnp.where(idx == e, w.astype(jnp.float32), 0.0), axis=1)
        return acc + we[:, None] * y, None
    E = wgu.shape[0]
    acc, _ = lax.scan(step, jnp.zeros(x.shape, jnp.float32), (jnp.arange(E), wgu, wd))
    return acc


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------

def keep(*trees):
    """A scalar that depends on every leaf (XLA drops the work of an unused result)."""
    return sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree_util.tree_leaves(trees))


def _value_and_grads(fn, argnums, args):
    """sum(fn(*args)) and its gradients in the arguments `argnums`."""
    def loss(*diff):
        full = list(args)
        for i, a in zip(argnums, diff):
            full[i] = a
        return jnp.sum(fn(*full).astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=tuple(range(len(argnums))))(
        *[args[i] for i in argnums])


def with_backward(fn, argnums):
    """fn's forward and the gradients of sum(fn) in the arguments `argnums`, reduced to one
    scalar."""
    def fb(*args):
        v, g = _value_and_grads(fn, argnums, args)
        return v + keep(g)
    return fb


def training_step(fn, argnums, tokens_of_rows=0):
    """fn's forward and the gradients of sum(fn) in the arguments `argnums`, all returned.
    tokens_of_rows = K: the first argument holds K rows per token (the expert compute's
    T * K rows), whose gradient a layer sums per token, as the dispatch's transpose does: it
    is returned summed so ([T, H], as a layer's)."""
    def step(*args):
        v, g = _value_and_grads(fn, argnums, args)
        if tokens_of_rows:
            g0 = g[0].astype(jnp.float32)
            g0 = jnp.sum(g0.reshape(-1, tokens_of_rows, g0.shape[-1]), axis=1)
            g = (g0.astype(g[0].dtype),) + tuple(g[1:])
        return v[None], g
    return step


def step_bytes(compiled):
    """(total, temp) bytes per device that XLA plans for the executable."""
    m = compiled.memory_analysis()
    if m is None:
        return None, None
    total = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes)
    return int(total), int(m.temp_size_in_bytes)


def first_line(e):
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}"


def layer_inputs(seed, mesh, R, T, H, I, L, K):
    """(w_gate_up [E, H, 2I], w_down [E, I, H], x [R * T, H], the expert compute's rows
    [R * T * K, H]) in bf16, E = R * L, scaled so that every layer's output is O(1): drawn on
    the GPUs, each rank's share on its own (with `mesh`, a Mesh over "ep"), since drawing the
    R = 4 weights (6.6e9 numbers) on the host took longer than timing the layer."""
    E = R * L
    shard = NamedSharding(mesh, P("ep")) if isinstance(mesh, Mesh) else None

    def draw(key):
        k = jax.random.split(key, 4)

        def normal(i, shape, scale):
            return (jax.random.normal(k[i], shape, jnp.float32) * scale).astype(jnp.bfloat16)
        return (normal(0, (E, H, 2 * I), 1 / math.sqrt(H)), normal(1, (E, I, H), 1 / math.sqrt(I)),
                normal(2, (R * T, H), 1.0), normal(3, (R * T * K, H), 1.0))
    return jax.jit(draw, out_shardings=shard)(jax.random.key(seed))


def add_shape_args(ap):
    """The layer's shape arguments of the layer benchmarks (per rank: T tokens, L experts),
    DeepEP's shapes by default."""
    ap.add_argument("--tokens", type=int, default=4096, help="per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32, help="per rank")
    ap.add_argument("--topk", type=int, default=8)


def topk_routing(logits, K):
    """(weights [S, K] bfloat16, ids [S, K]) of the softmax router over logits [S, E]: the
    routing every layer of the benchmarks takes."""
    w, idx = jax.jit(functools.partial(jax_ep.routing.softmax_topk, k=K))(
        jnp.asarray(logits, jnp.float32))
    return w.astype(jnp.bfloat16), idx


def dense_check(mesh, x, idx, w, wgu, wd):
    """dense_moe of the tokens x [S, H] (routing idx, w: [S, K], replicated), each rank over
    its own experts (wgu, wd sharded over "ep"), summed over the ranks."""
    def part(x, idx, w, gu, d):
        first = lax.axis_index("ep") * gu.shape[0]      # the rank's first expert id
        local = jnp.where(idx >= 0, idx - first, -1)    # ids of other ranks match no local one
        return lax.psum(dense_moe(x, local, w, gu, d), "ep")
    rep = P()
    return jax.jit(jax.shard_map(part, mesh=mesh, in_specs=(rep, rep, rep, P("ep"), P("ep")),
                                 out_specs=rep, check_vma=False))(x, idx, w, wgu, wd)


def balanced_routing(rng, S, E, K):
    """(weights [S, K] bfloat16, ids [S, K]): token t's experts t + k * (E // K) mod E, k < K
    (distinct for E >= K, spread over the ranks), so that every expert receives exactly
    S * K / E pairs when E divides S; the weights a softmax of random logits."""
    t = np.arange(S)[:, None]
    idx = (t + np.arange(K)[None, :] * max(1, E // K)) % E
    g = rng.standard_normal((S, K))
    w = np.exp(g - g.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return jnp.asarray(w, jnp.bfloat16), jnp.asarray(idx, jnp.int32)


def abstract_inputs(mesh, R, T, H, I, L, K):
    """layer_inputs' shapes as jax.ShapeDtypeStruct (sharded over "ep"), and the routing's
    (weights, ids): what --compile-only lowers, with nothing drawn or placed on a device."""
    E = R * L
    shard = NamedSharding(mesh, P("ep"))

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=shard)
    return ((spec((E, H, 2 * I), jnp.bfloat16), spec((E, I, H), jnp.bfloat16),
             spec((R * T, H), jnp.bfloat16), spec((R * T * K, H), jnp.bfloat16)),
            (spec((R * T, K), jnp.bfloat16), spec((R * T, K), jnp.int32)))


def without_peer_runtime():
    """--compile-only under a mock topology: the lowering's peer runtime (workspaces and peer
    access on every device of the mesh) not set up, since mock devices cannot run, and the one
    process over the mock devices kept (JAX's mock client reports one process per mock host)."""
    from jax_ep import runtime
    runtime.ensure_peer_runtime = lambda devices, groups=None: None
    runtime.per_process = lambda: False


def zipf_logits(rng, n, E, s):
    """Logits whose softmax top-k draws expert e about in proportion to 1 / (1 + rank e)^s."""
    rank = rng.permutation(E)
    return rng.gumbel(size=(n, E)) - s * np.log1p(rank)[None, :]


def draw_routing(rng, routing, S, E, K, zipf_s=1.0):
    """(weights [S, K] bfloat16, ids [S, K]) of S tokens over E experts, by the routing's name:
    "uniform" (softmax top-k of random logits), "zipf" (Zipf-skewed logits, exponent zipf_s) or
    "balanced" (balanced_routing)."""
    if routing == "balanced":
        return balanced_routing(rng, S, E, K)
    if routing not in ("uniform", "zipf"):
        raise SystemExit(f"--routing: {routing!r}: expected uniform, zipf or balanced")
    return topk_routing(rng.standard_normal((S, E)) if routing == "uniform"
                        else zipf_logits(rng, S, E, zipf_s), K)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="1,2,4",
                    help="comma-separated EP sizes; those above the device count are skipped")
    add_shape_args(ap)
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scan", default="1,9", help="n_short,n_long calls of the timed scans")
    ap.add_argument("--check-tokens", type=int, default=128,
                    help="tokens per rank checked against the dense MoE")
    ap.add_argument("--skip", default="", help="comma-separated layer names not to run")
    ap.add_argument("--only", default="", help="comma-separated layer names to run alone")
    ap.add_argument("--backend", default="cuda", help="'reference' checks the script on a CPU")
    ap.add_argument("--rounds", type=int, default=1,
                    help="paired rounds: every layer's timers once per round, in turn")
    ap.add_argument("--compile-only", action="store_true",
                    help="the memory plans alone: nothing runs")
    ap.add_argument("--mock-topology", default="",
                    help="1x<R>x1: R mock GPUs of JAX's mock GPU client on the first GPU, for "
                         "the memory plans of more GPUs than the machine has (implies "
                         "--compile-only)")
    args = ap.parse_args()
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    be = args.backend
    n_short, n_long = (int(v) for v in args.scan.split(","))
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    mock = args.mock_topology
    if mock:  # (before the backend starts)
        jax.config.update("jax_mock_gpu_topology", mock)
        jax.config.update("jax_cuda_visible_devices", "0")
        # XLA shares GEMM autotuning between processes through the distributed store, which
        # mock processes do not have: each compiles its own
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_shard_autotuning=false").strip()
        args.compile_only = True
        without_peer_runtime()
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    print(f"device: {devs[0].device_kind} x {len(devs)}, jax {jax.__version__}, backend {be}"
          + (f", mock topology {mock} (compiled only)" if mock else
             ", compiled only" if args.compile_only else ""))
    results, summary = [], []
    timers_later = args.rounds > 1 and not args.compile_only  # timed after all layers, paired
    # {(layer, R, op): why}: an op that ran out of memory under one routing is not compiled
    # again under the next (the buffers of every layer here follow the shapes, not the routing;
    # the ragged layer's backward compiles for minutes before it fails)
    out_of_memory = {}

    def save():
        with open(os.path.join(args.out, "bench_layer.json"), "w") as f:
            json.dump(dict(device=devs[0].device_kind, jax=jax.__version__, backend=be,
                           mock_topology=mock or None, rounds=args.rounds, summary=summary,
                           results=results), f, indent=1)
        ok = [r for r in results if "fwd_ms" in r]
        if ok:
            barh_plot(os.path.join(args.out, "bench_layer.png"),
                      [f"{r['shape'].split(' ')[0]} {r['routing']}: {r['name']}" for r in ok],
                      [r["fwd_ms"] for r in ok], f"forward ms per layer, {devs[0].device_kind}",
                      log=True, figsize=(11, max(3, 0.3 * len(ok))))

    for R in (int(r) for r in args.ranks.split(",")):
        if R > len(devs):
            print(f"\n== R={R}: skipped, {len(devs)} devices")
            continue
        mesh = Mesh(np.array(devs[:R]), ("ep",))
        E = R * L
        if args.compile_only:
            (wgu, wd, x, xr), (w, idx) = abstract_inputs(mesh, R, T, H, I, L, K)
        else:
            wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
        for routing in args.routing.split(","):
            if not args.compile_only:  # (compiled only: the routing is not drawn)
                # each block draws from the same seed: its routing does not depend on the
                # blocks run before it
                w, idx = draw_routing(np.random.default_rng(0), routing, R * T, E, K,
                                      args.zipf)
            tag = f"R={R} T={T} H={H} I={I} L={L} K={K} {routing}"
            group = dict(num_experts=E, num_topk=K, num_ranks=R, backend=be)
            load = ("(not drawn)" if args.compile_only else " ".join(
                f"{v:.2f}" for v in np.bincount(np.asarray(idx).reshape(-1) // L, minlength=R)
                / (T * K)))
            print(f"\n== {tag}: pairs per rank / T*K: {load}"
                  + "; moe_ffn's rows per pass: " + ", ".join(
                      f"{name} {jax_ep.moe_capacity(T, fused=f, **group)}"
                      for name, f in (("unfused", False), ("fused", True))))
            lay = (x, idx, w, wgu, wd)
            if args.compile_only:
                sizes = jax.ShapeDtypeStruct((R * L,), jnp.int32,
                                             sharding=NamedSharding(mesh, P("ep")))
            else:
                sizes = jax.device_put(routed_sizes(idx, R, L, T * K),
                                       NamedSharding(mesh, P("ep")))
            layers = {
                "moe_ffn": (lambda *a: jax_ep.moe_ffn(*a, num_experts=E, backend=be), lay),
                "moe_ffn(fused=False)": (lambda *a: jax_ep.moe_ffn(
                    *a, num_experts=E, fused=False, backend=be), lay),
                "moe_ffn(fused=True)": (lambda *a: jax_ep.moe_ffn(
                    *a, num_experts=E, fused=True, backend=be), lay),
                "expert compute alone": (functools.partial(expert_compute, backend=be),
                                         (xr, w, wgu, wd)),
                ROUTED: (functools.partial(expert_compute, backend=be), (xr, w, wgu, wd, sizes)),
                "communication alone": (functools.partial(communication, num_experts=E,
                                                          backend=be), (x, idx, w)),
            }
            if R > 1:
                layers["GShard capacity 1.25 + einsum"] = (
                    functools.partial(gshard_layer, num_experts=E), lay)
                layers["ragged_all_to_all + ragged_dot"] = (
                    functools.partial(ragged_layer, num_experts=E), lay)
            # the default is timed once, under its own name and that of its setting
            default = inspect.signature(jax_ep.moe_ffn).parameters["fused"].default
            if default is None:  # fused wherever it applies: here (bfloat16, high-throughput)
                default = True
            same = f"moe_ffn(fused={default})"
            diff = {"expert compute alone": (0, 1, 2, 3), ROUTED: (0, 1, 2, 3),
                    "communication alone": (0, 2)}
            rows, timers = {}, {}
            # the dense MoE on the first check_tokens tokens of every rank
            S = min(args.check_tokens, T)
            pick = (np.arange(R)[:, None] * T + np.arange(S)[None, :]).reshape(-1)
            if not args.compile_only:
                dense = np.asarray(dense_check(mesh, x[pick], idx[pick], w[pick], wgu, wd))
            for name, (fn, fargs) in layers.items():
                if name in skip or (only and name not in only):
                    continue
                if name == same and "moe_ffn" in rows:
                    rows[name] = dict(rows["moe_ffn"], name=name, same_as="moe_ffn")
                    results.append(rows[name])
                    print(f"  {name:<34} the default (above)")
                    continue
                row = dict(name=name, shape=tag, ranks=R, routing=routing)
                current = "fwd"
                try:
                    if not args.compile_only:
                        out = rank_map(mesh, fn)(*fargs)
                        if name not in BASELINES:
                            got = np.asarray(out, np.float64)[pick]
                            row["rel_err_vs_dense"] = float(np.linalg.norm(got - dense)
                                                            / max(np.linalg.norm(dense), 1e-30))
                        del out
                    for op, f in (("fwd", fn),
                                  ("fwd+bwd", with_backward(fn, diff.get(name, (0, 2, 3, 4))))):
                        current = op
                        if (name, R, op) in out_of_memory:
                            row["failed"] = out_of_memory[name, R, op]
                            break
                        if args.compile_only:
                            if op == "fwd+bwd":
                                row["step_bytes"], row["step_temp_bytes"] = step_bytes(
                                    scan_fn(mesh, f, 1).lower(*fargs).compile())
                            continue
                        fs = scan_fn(mesh, f, n_short).lower(*fargs).compile()
                        if op == "fwd+bwd" and n_short == 1:
                            row["step_bytes"], row["step_temp_bytes"] = step_bytes(fs)
                        # (one run here: a failure is this row's; and its time: a layer slower
                        # than SLOW_CALL_S a call needs no slope over many calls)
                        jax.block_until_ready(fs(*fargs))
                        t0 = time.perf_counter()
                        jax.block_until_ready(fs(*fargs))
                        n_l = (n_short + 2 if (time.perf_counter() - t0) / n_short > SLOW_CALL_S
                               else n_long)
                        row[op + "_scan"] = [n_short, n_l]
                        fl = scan_fn(mesh, f, n_l).lower(*fargs).compile()
                        if timers_later:
                            timers[name, op] = functools.partial(
                                time_slope, fs, fl, n_short, n_l, fargs, args.reps)
                            continue
                        med, lo, hi, _ = time_slope(fs, fl, n_short, n_l, fargs, args.reps)
                        row[op + "_ms"] = med * 1e3
                        row[op + "_ms_range"] = [lo * 1e3, hi * 1e3]
                        del fs, fl
                except Exception as e:  # a baseline out of memory, say: reported, not fatal
                    row["failed"] = first_line(e)
                    if "RESOURCE_EXHAUSTED" in str(e) and not args.compile_only:
                        out_of_memory[name, R, current] = (
                            f"not run: out of memory under {routing} routing ({row['failed']})")
                    if name.startswith("moe_ffn") or name in BASELINES:
                        traceback.print_exc()
                if "failed" not in row:
                    try:
                        row["train_step_bytes"], _ = step_bytes(rank_map(mesh, training_step(
                            fn, diff.get(name, (0, 2, 3, 4)),
                            tokens_of_rows=K if name in EXPERT_COMPUTES else 0))
                            .lower(*fargs).compile())
                    except Exception as e:  # noqa: BLE001 - reported beside the timings
                        row["train_failed"] = first_line(e)
                if not timers_later:  # (else the compiled scans stay for the rounds)
                    jax.clear_caches()
                rows[name] = row
                results.append(row)
                if not timers_later:
                    print_row(row)
            if timers_later:
                print(f"  {args.rounds} paired rounds of {len(timers)} timers ...", flush=True)
                got = paired(timers, args.rounds)
                timers.clear()
                for (name, op), meds in got.items():
                    rows[name][op + "_ms"] = float(np.median(meds)) * 1e3
                    rows[name][op + "_ms_rounds"] = [m * 1e3 for m in meds]
                for name, row in rows.items():
                    if "same_as" in row:  # the default's copy, made before the rounds
                        row.update({k: v for k, v in rows[row["same_as"]].items()
                                    if k.endswith(("_ms", "_rounds"))})
                    else:
                        print_row(row)
                jax.clear_caches()
            summary.append(dict(shape=tag, ranks=R, routing=routing, ratios=ratios(rows)))
            print("  same-run ratios" + (" (medians of the rounds' ratios)" if timers_later
                                         else "") + ": " + ", ".join(
                f"{k} {v:.2f}" for k, v in summary[-1]["ratios"].items()))
            for name in ("moe_ffn", "moe_ffn(fused=False)", "moe_ffn(fused=True)"):
                err = rows.get(name, {}).get("rel_err_vs_dense")
                assert err is None or err < 2e-2, (name, err)
            save()  # every finished block, so that a run cut short keeps them

    save()
    print("\nwrote", os.path.join(args.out, "bench_layer.json"))


def print_row(row):
    """One layer's line of the table."""
    gb, tgb = row.get("step_bytes"), row.get("train_step_bytes")
    print(f"  {row['name']:<34} fwd {row.get('fwd_ms', float('nan')):9.3f} ms  "
          f"fwd+bwd {row.get('fwd+bwd_ms', float('nan')):9.3f} ms  "
          f"step {gb / 1e9 if gb else float('nan'):6.2f} GB  "
          f"train {tgb / 1e9 if tgb else float('nan'):6.2f} GB"
          + (f"  err {row['rel_err_vs_dense']:.1e}" if "rel_err_vs_dense" in row else "")
          + (f"  FAILED {row['failed']}" if "failed" in row else "")
          + (f"  train FAILED {row['train_failed']}" if "train_failed" in row else ""),
          flush=True)


def ratios(rows):
    """The same-run ratios of one (R, routing): the layer against its floor and the baselines."""
    out = {}

    def get(name, key):
        return rows.get(name, {}).get(key)

    def ratio(num, den, key):  # paired rounds: the median of the rounds' ratios
        a, b = get(num, key + "_rounds"), get(den, key + "_rounds")
        if a and b:
            return ratio_median(a, b)
        a, b = get(num, key), get(den, key)
        return a / b if a and b else None
    base = "expert compute alone"
    for key, what in (("fwd_ms", "fwd"), ("fwd+bwd_ms", "fwd+bwd"), ("step_bytes", "memory"),
                      ("train_step_bytes", "training-step memory")):
        for name, short in (("moe_ffn", "default"), ("moe_ffn(fused=True)", "fused"),
                            ("moe_ffn(fused=False)", "unfused")):
            r = ratio(name, base, key)
            if r:
                out[f"{short} / expert compute {what}"] = r
            r = ratio(name, ROUTED, key)
            if r and "memory" not in what:
                out[f"{short} / {ROUTED} {what}"] = r
        for name, short in (("GShard capacity 1.25 + einsum", "gshard"),
                            ("ragged_all_to_all + ragged_dot", "ragged")):
            r = ratio(name, "moe_ffn", key)
            if r and "memory" not in what:
                out[f"{short} / default {what}"] = r
    for key, what in (("fwd_ms", "fwd"), ("fwd+bwd_ms", "fwd+bwd")):
        r = ratio(ROUTED, base, key)
        if r:
            out[f"{ROUTED} / expert compute {what}"] = r
    r = ratio("moe_ffn(fused=True)", "moe_ffn(fused=False)", "fwd_ms")
    if r:
        out["fused / unfused fwd"] = r
    return out


if __name__ == "__main__":
    sys.exit(main())
