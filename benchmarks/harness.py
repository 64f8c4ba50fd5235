"""The timing harness of bench.py: `iters` calls of one op in one jit-compiled lax.scan.

No jax_ep import here: the harness is tested on CPU (tests/test_bench_harness.py) without the
compiled extension.
"""
from __future__ import annotations

import functools
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


def _smallest(tree):
    return min(jax.tree_util.tree_leaves(tree), key=lambda leaf: leaf.size)


def add_virtual_arg(ap):
    """--virtual: the R ranks of a benchmark as virtual ranks on the first device."""
    ap.add_argument("--virtual", action="store_true",
                    help="the R ranks as virtual ranks on the first device (the one-GPU "
                         "multi-rank mode: each rank's kernels on its share of the SMs)")


def rank_mesh(R, virtual):
    """(mesh, ranked) for R ranks: the "ep" Mesh of the first R devices and the identity, or
    (virtual) jax_ep.testing.virtual_ranks over R ranks (per-rank bodies under vmap: rank_map
    takes it) and the stacking of an argument's rows over them; (None, None) when R exceeds
    the devices."""
    if virtual:
        import jax_ep.testing   # (here only: the harness itself needs no jax_ep)

        def ranked(a):
            return a.reshape(R, -1, *a.shape[1:])
        return functools.partial(jax_ep.testing.virtual_ranks, num_ranks=R), ranked
    devs = jax.devices()
    if R > len(devs):
        return None, None
    return Mesh(np.array(devs[:R]), ("ep",)), lambda a: a


def rank_map(mesh, fn):
    """jit of fn as a per-rank body: shard_map over `mesh`'s "ep" axis, or, when `mesh` is not
    a Mesh but a callable (e.g. jax_ep.testing.virtual_ranks with num_ranks bound: the one-GPU
    multi-rank mode, arguments stacked over the ranks), that callable applied to fn."""
    if not isinstance(mesh, Mesh):
        return jax.jit(mesh(fn))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                 check_vma=False))


def scan_fn(mesh, body, iters):
    """jit(shard_map) (see rank_map) of body(*args) called `iters` times in one unrolled
    lax.scan, with no kernel of the harness between calls. Call i + 1 reads its inputs through
    an optimization barrier that also takes the smallest output leaf of call i: it starts after
    call i, and its inputs are loop-variant, so XLA can neither hoist nor merge the calls.

    The barrier also takes the leaf of call i - 1: XLA's algebraic simplifier drops a barrier
    operand whose result is unused unless that operand has another user, and dropping it would
    cut the chain (the calls then merge). With each leaf in two barriers, none is dropped.
    Returns the last two leaves, each with a leading axis of 1 per shard."""
    def shard(*a):
        out = _smallest(jax.eval_shape(body, *a))

        def step(carry, _):
            prev, last = carry
            a2, _, _ = jax.lax.optimization_barrier((a, last, prev))
            return (last, _smallest(body(*a2))), None
        zero = jnp.zeros(out.shape, out.dtype)
        # Fully unrolled: a rolled XLA while loop costs a device->host predicate copy per
        # iteration (tens of us), which would swamp the microsecond ops being timed.
        (prev, last), _ = jax.lax.scan(step, (zero, zero), None, length=iters, unroll=True)
        return prev[None], last[None]

    return rank_map(mesh, shard)


def time_fn(f, args, iters, reps):
    """(median, min, max) seconds of one f(*args) / iters over `reps` runs, after 2 warm-ups."""
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts)), float(np.min(ts)), float(np.max(ts))


def time_slope(f_short, f_long, n_short, n_long, args, reps):
    """Seconds per call as the slope between a scan of n_short calls and one of n_long: the
    fixed cost of one execution (host dispatch of the program, its launch, the carry's zero fill,
    the final synchronisation), about 0.2 to 1.2 ms on the GPU machines, cancels instead of
    adding cost / n_long to every call. Returns (median, min, max) over `reps` interleaved pairs
    of runs, and the median of the long scan's total / n_long (the plain per-call figure)."""
    for _ in range(2):
        jax.block_until_ready(f_short(*args))
        jax.block_until_ready(f_long(*args))
    slopes, walls = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f_short(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(f_long(*args))
        t2 = time.perf_counter()
        slopes.append(((t2 - t1) - (t1 - t0)) / (n_long - n_short))
        walls.append((t2 - t1) / n_long)
    return (float(np.median(slopes)), float(np.min(slopes)), float(np.max(slopes)),
            float(np.median(walls)))


def timed_scan(mesh, body, args, iters, reps):
    """(median, min, max) seconds per call of body(*args), `iters` calls in one lax.scan."""
    return time_fn(scan_fn(mesh, body, iters), args, iters, reps)


def op_timer(fn, args, n_short=2, n_long=8, reps=5, mesh=None):
    """A timer of fn(*args) on the first device (or per rank over `mesh`, as rank_map), compiled
    here, once (so fn is traced as it is now): each call returns (median, min, max) seconds per
    call, the slope between a jit-compiled scan of n_short calls and one of n_long (scan_fn:
    calls chained through optimization barriers, so they neither merge nor overlap), over
    `reps` interleaved pairs of runs."""
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    fs, fl = (scan_fn(mesh, fn, n).lower(*args).compile() for n in (n_short, n_long))

    def timer():
        med, lo, hi, _ = time_slope(fs, fl, n_short, n_long, args, reps)
        return med, lo, hi
    return timer


def time_op(fn, args, n_short=2, n_long=8, reps=5):
    """op_timer's (median, min, max) seconds per call of fn(*args), measured once."""
    return op_timer(fn, args, n_short, n_long, reps)()


def paired(timers, rounds):
    """Each timer (no arguments -> (median, min, max) seconds) once per round, in turn, so that
    a clock drifting during the run weighs on every side alike: {name: [median of each
    round]}."""
    out = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            out[name].append(timer()[0])
    return out


def ratio_median(num, den):
    """Median over rounds of num[i] / den[i]."""
    return float(np.median([a / b for a, b in zip(num, den)]))


def barh_plot(path, labels, values, xlabel, *, log=False, figsize=(11, 5)):
    """A horizontal bar chart (first label on top) saved to path; says so and returns when
    matplotlib is missing (the JSON beside it has every figure)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: {e}")
        return
    fig, ax = plt.subplots(figsize=figsize)
    ax.barh(labels, values)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
