"""Bad input: trace-time ValueError / TypeError naming the argument; check=True at run time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax.sharding import PartitionSpec as P
from helpers import BACKEND, ht_fn, ll_fn, num_shards, routing, smap, stack

E = 8
f32, bf16, f16, i32, fp8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn


def S(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def trace(mesh, fn, *args):
    """Abstractly evaluate fn per shard (args are per-shard ShapeDtypeStructs): trace only."""
    n = num_shards(mesh)
    glob = jax.tree.map(lambda s: S((n,) + s.shape, s.dtype), args)
    return jax.eval_shape(smap(mesh, fn, jit=False), *glob)


def ht(**kw):
    kw = {"num_experts": E, "backend": BACKEND, **kw}
    return lambda *a: jax_ep.dispatch(*a, **kw).recv_count

# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------


GOOD_X, GOOD_IDX, GOOD_W = S((5, 16), f32), S((5, 2), i32), S((5, 2), f32)

DISPATCH_BAD = [
    # (args, kwargs, exception, regex the message must match)
    ((S((5, 16, 2), f32), GOOD_IDX), {}, ValueError, r"^x\b.*rank-2.*\(5, 16, 2\)"),
    ((S((5,), f32), GOOD_IDX), {}, ValueError, r"^x\b.*rank-2"),
    ((S((5, 16), i32), GOOD_IDX), {}, TypeError, r"^x\b.*int32.*float32"),
    ((S((5, 16), fp8), GOOD_IDX), {}, TypeError, r"^x\b.*float8_e4m3fn"),
    (((S((5, 128), fp8),), GOOD_IDX), {}, ValueError, r"^x\b.*tuple"),
    (((S((5, 128), bf16), S((5, 1), f32)), GOOD_IDX), {}, TypeError, r"x\[0\].*bfloat16"),
    (((S((5, 100), fp8), S((5, 1), f32)), GOOD_IDX), {}, ValueError, r"x\[0\].*H=100.*128"),
    (((S((5, 256), fp8), S((5, 1), f32)), GOOD_IDX), {}, ValueError, r"x\[1\].*\(5, 1\).*\(5, 2\)"),
    (((S((5, 256), fp8), S((5, 2), bf16)), GOOD_IDX), {}, TypeError, r"x\[1\].*bfloat16"),
    ((GOOD_X, S((5,), i32)), {}, ValueError, r"^topk_idx\b.*rank-2"),
    ((GOOD_X, S((5, 2), f32)), {}, TypeError, r"^topk_idx\b.*float32.*int32"),
    ((GOOD_X, S((4, 2), i32)), {}, ValueError, r"^topk_idx\b.*4 rows.*T=5"),
    ((GOOD_X, GOOD_IDX, S((5, 3), f32)), {}, ValueError, r"^topk_weights\b.*\(5, 3\).*\(5, 2\)"),
    ((GOOD_X, GOOD_IDX, S((5, 2), i32)), {}, TypeError, r"^topk_weights\b.*int32"),
    ((GOOD_X, GOOD_IDX, S((5,), f32)), {}, ValueError, r"^topk_weights\b.*rank-2"),
    ((GOOD_X, GOOD_IDX), {"num_experts": 6}, ValueError, r"num_experts=6.*divisible.*4"),
    ((GOOD_X, GOOD_IDX), {"num_experts": 8.0}, TypeError, r"num_experts.*int"),
    ((GOOD_X, GOOD_IDX), {"num_experts": 0}, ValueError, r"num_experts.*>= 1.*0"),
    ((GOOD_X, GOOD_IDX), {"capacity": 0}, ValueError, r"capacity.*>= 1.*0"),
    ((GOOD_X, GOOD_IDX), {"capacity": 3.5}, TypeError, r"capacity.*int"),
    ((GOOD_X, GOOD_IDX), {"axis_name": "tp"}, ValueError, r"axis_name='tp'"),
    ((GOOD_X, GOOD_IDX), {"backend": "triton"}, ValueError, r"backend='triton'.*reference"),
]


@pytest.mark.parametrize("args,kw,exc,match", DISPATCH_BAD,
                         ids=[f"{i}-{c[3][:20]}" for i, c in enumerate(DISPATCH_BAD)])
def test_dispatch_bad_input(mesh4, args, kw, exc, match):
    fn = ht(**kw)
    with pytest.raises(exc, match=match):
        trace(mesh4, fn, *args)


def test_dispatch_good_input_traces(mesh4):
    """The baseline of the table above is valid (so each row tests its one defect)."""
    out = trace(mesh4, ht(), GOOD_X, GOOD_IDX, GOOD_W)
    assert out.shape == (4,)
    trace(mesh4, ht(), (S((5, 256), fp8), S((5, 2), f32)), GOOD_IDX)
    trace(mesh4, ht(), S((5, 16), bf16), GOOD_IDX)
    trace(mesh4, ht(capacity=3), S((5, 16), f16), GOOD_IDX)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CUDA backend exists on GPUs")
def test_cuda_backend_unavailable_is_a_clear_error(mesh2):
    with pytest.raises(ValueError, match=r"backend='cuda'"):
        trace(mesh2, ht(backend="cuda"), GOOD_X, GOOD_IDX)


# --------------------------------------------------------------------------------------------
# combine
# --------------------------------------------------------------------------------------------

def combine_with(y_struct, handle_fn=None, **kw):
    """Dispatch a [5, 16] f32 x, then combine y (a zeros array of y_struct's shape/dtype)."""

    def f(x, idx):
        res = jax_ep.dispatch(x, idx, num_experts=E, backend=BACKEND)
        handle = res.handle if handle_fn is None else handle_fn(res.handle)
        y = jnp.zeros(y_struct.shape, y_struct.dtype)
        return jax_ep.combine(y, handle, **{"backend": BACKEND, **kw})

    return f


COMBINE_BAD = [
    (S((20,), f32), None, {}, ValueError, r"^y\b.*rank-2"),
    (S((20, 16), i32), None, {}, TypeError, r"^y\b.*int32"),
    (S((19, 16), f32), None, {}, ValueError, r"^y\b.*19 rows.*capacity=20"),
    (S((20, 16), f32), tuple, {}, TypeError, r"^handle\b.*DispatchHandle"),
    (S((20, 16), f32), None, {"axis_name": "dp"}, ValueError, r"axis_name='dp'"),
    (S((20, 16), f32), None, {"backend": "nccl"}, ValueError, r"backend='nccl'"),
]


@pytest.mark.parametrize("y,hf,kw,exc,match", COMBINE_BAD,
                         ids=[str(i) for i in range(len(COMBINE_BAD))])
def test_combine_bad_input(mesh4, y, hf, kw, exc, match):
    with pytest.raises(exc, match=match):
        trace(mesh4, combine_with(y, hf, **kw), GOOD_X, GOOD_IDX)


def test_combine_good_input_traces(mesh4):
    for dt in (f32, bf16, f16):
        out = trace(mesh4, combine_with(S((20, 16), dt)), GOOD_X, GOOD_IDX)
        assert out.shape == (4, 5, 16) and out.dtype == dt


# --------------------------------------------------------------------------------------------
# low latency
# --------------------------------------------------------------------------------------------

def ll(**kw):
    kw = {"num_experts": E, "max_tokens_per_rank": 8, "backend": BACKEND, **kw}
    return lambda x, idx: jax_ep.low_latency_dispatch(x, idx, **kw).recv_count


LL_X, LL_IDX = S((4, 128), bf16), S((4, 2), i32)

LL_DISPATCH_BAD = [
    ((S((4, 128), f32), LL_IDX), {}, TypeError, r"^x\b.*float32.*bfloat16"),
    ((S((4, 128, 1), bf16), LL_IDX), {}, ValueError, r"^x\b.*rank-2"),
    ((S((9, 128), bf16), S((9, 2), i32)), {}, ValueError, r"T=9.*max_tokens_per_rank=8"),
    ((S((4, 96), bf16), LL_IDX), {}, ValueError, r"^x\b.*H=96.*128"),
    ((LL_X, S((4,), i32)), {}, ValueError, r"^topk_idx\b.*rank-2"),
    ((LL_X, S((4, 2), f32)), {}, TypeError, r"^topk_idx\b.*float32"),
    ((LL_X, S((3, 2), i32)), {}, ValueError, r"^topk_idx\b.*3 rows.*T=4"),
    ((LL_X, LL_IDX), {"num_experts": 10}, ValueError, r"num_experts=10.*divisible"),
    ((LL_X, LL_IDX), {"max_tokens_per_rank": 8.0}, TypeError, r"max_tokens_per_rank.*int"),
    ((LL_X, LL_IDX), {"max_tokens_per_rank": 0}, ValueError, r"max_tokens_per_rank"),
    ((LL_X, LL_IDX), {"axis_name": "tp"}, ValueError, r"axis_name='tp'"),
    ((LL_X, LL_IDX), {"backend": "x"}, ValueError, r"backend='x'"),
]


@pytest.mark.parametrize("args,kw,exc,match", LL_DISPATCH_BAD,
                         ids=[str(i) for i in range(len(LL_DISPATCH_BAD))])
def test_ll_dispatch_bad_input(mesh4, args, kw, exc, match):
    with pytest.raises(exc, match=match):
        trace(mesh4, ll(**kw), *args)


def test_ll_dispatch_good_input_traces(mesh4):
    assert trace(mesh4, ll(), LL_X, LL_IDX).shape == (4, 2)
    # H % 128 only matters with FP8
    assert trace(mesh4, ll(use_fp8=False), S((4, 96), bf16), LL_IDX).shape == (4, 2)


def ll_combine_with(y, idx=None, w=None, handle_fn=None, **kw):
    def f(x, i):
        res = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=8,
                                          backend=BACKEND)
        handle = res.handle if handle_fn is None else handle_fn(res.handle)
        ii = i if idx is None else jnp.zeros(idx.shape, idx.dtype)
        ww = jnp.ones(i.shape, f32) if w is None else jnp.zeros(w.shape, w.dtype)
        return jax_ep.low_latency_combine(jnp.zeros(y.shape, y.dtype), ii, ww, handle,
                                          **{"backend": BACKEND, **kw})

    return f


GOOD_Y = S((2, 32, 128), bf16)
LL_COMBINE_BAD = [
    ((S((2, 32, 128), f32),), {}, TypeError, r"^y\b.*float32.*bfloat16"),
    ((S((2, 32), bf16),), {}, ValueError, r"^y\b.*rank-3"),
    ((S((2, 16, 128), bf16),), {}, ValueError, r"^y\b.*\(2, 16, 128\).*\(2, 32, H\)"),
    ((GOOD_Y, S((4, 2), f32)), {}, TypeError, r"^topk_idx\b.*float32"),
    ((GOOD_Y, S((9, 2), i32), S((9, 2), f32)), {}, ValueError, r"^topk_idx\b.*T=9.*=8"),
    ((GOOD_Y, None, S((4, 3), f32)), {}, ValueError, r"^topk_weights\b.*\(4, 3\)"),
    ((GOOD_Y, None, S((4, 2), i32)), {}, TypeError, r"^topk_weights\b.*int32"),
    ((GOOD_Y, None, None, tuple), {}, TypeError, r"^handle\b.*LowLatencyHandle"),
    ((GOOD_Y, None, None, lambda h: h._replace(src_rows=h.src_rows[:, :1])), {}, ValueError,
     r"^handle\b.*src_rows.*\(32, 1\).*\(32, 2\)"),
    ((GOOD_Y, None, None, lambda h: h._replace(topk_idx=None)), {}, TypeError,
     r"^handle\b.*topk_idx is None"),
    ((GOOD_Y, S((3, 2), i32), S((3, 2), f32)), {}, ValueError,
     r"^topk_idx\b.*\(3, 2\).*dispatch's was \(4, 2\)"),
    ((GOOD_Y,), {"axis_name": "zz"}, ValueError, r"axis_name='zz'"),
    ((GOOD_Y,), {"backend": "?"}, ValueError, r"backend='\?'"),
]


@pytest.mark.parametrize("args,kw,exc,match", LL_COMBINE_BAD,
                         ids=[str(i) for i in range(len(LL_COMBINE_BAD))])
def test_ll_combine_bad_input(mesh4, args, kw, exc, match):
    with pytest.raises(exc, match=match):
        trace(mesh4, ll_combine_with(*args, **kw), LL_X, LL_IDX)


def test_ll_combine_good_input_traces(mesh4):
    out = trace(mesh4, ll_combine_with(GOOD_Y), LL_X, LL_IDX)
    assert out.shape == (4, 4, 128) and out.dtype == bf16


# --------------------------------------------------------------------------------------------
# moe_ffn: a wrong dtype is reported on the argument that has it
# --------------------------------------------------------------------------------------------

f64 = jnp.float64


def moe(**kw):
    kw = {"num_experts": E, "backend": BACKEND, **kw}
    return lambda x, i, w, a, b: jax_ep.moe_ffn(x, i, w, a, b, **kw)


def moe_args(x_dtype, w_dtype, T=4, H=128, I=64):
    L = E // 4
    return (S((T, H), x_dtype), S((T, 2), i32), S((T, 2), f32), S((L, H, 2 * I), w_dtype),
            S((L, I, H), w_dtype))


MOE_BAD = [
    # (x dtype, weights' dtype, kwargs, exception, regex the message must match)
    (f64, f32, {}, TypeError,
     r"^x: dtype float64 is not supported; expected one of float32, bfloat16, float16"),
    (f64, f64, {}, TypeError, r"^x: dtype float64 is not supported"),
    (f32, bf16, {"mode": "low_latency"}, TypeError,
     r"^x: dtype float32; mode='low_latency' takes bfloat16"),
    (f32, f32, {"mode": "low_latency"}, TypeError,
     r"^x: dtype float32; mode='low_latency' takes bfloat16"),
    (f32, f32, {"mode": "low_latency", "max_tokens_per_rank": 8}, TypeError,
     r"^x: dtype float32; mode='low_latency' takes bfloat16"),
]


@pytest.mark.parametrize("x_dtype,w_dtype,kw,exc,match", MOE_BAD,
                         ids=[str(i) for i in range(len(MOE_BAD))])
def test_moe_ffn_bad_dtype_names_the_argument(mesh4, x_dtype, w_dtype, kw, exc, match):
    with jax.enable_x64(True):     # else float64 becomes float32 before moe_ffn sees it
        with pytest.raises(exc, match=match):
            trace(mesh4, moe(**kw), *moe_args(x_dtype, w_dtype))


def test_moe_ffn_good_input_traces(mesh4):
    """The baseline of the table above; low-latency mode needs no max_tokens_per_rank (T)."""
    assert trace(mesh4, moe(), *moe_args(f32, f32)).shape == (4, 4, 128)
    out = trace(mesh4, moe(mode="low_latency"), *moe_args(bf16, bf16))
    assert out.shape == (4, 4, 128) and out.dtype == bf16


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("idx,kw,exc,match", [
    (S((5,), i32), {}, ValueError, r"^topk_idx\b.*rank-2"),
    (S((5, 2), f32), {}, TypeError, r"^topk_idx\b.*float32"),
    (S((5, 2), i32), {"num_ranks": 3}, ValueError, r"num_experts=8.*divisible.*3"),
    (S((5, 2), i32), {"num_ranks": 0}, ValueError, r"num_ranks.*>= 1"),
    (S((5, 2), i32), {"num_ranks": 2.0}, TypeError, r"num_ranks.*int"),
    (S((5, 2), i32), {"backend": "gpu"}, ValueError, r"backend='gpu'"),
])
def test_layout_bad_input(idx, kw, exc, match):
    kw = {"num_experts": E, "num_ranks": 4, "backend": BACKEND, **kw}
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda i: jax_ep.get_dispatch_layout(i, **kw), idx)


# --------------------------------------------------------------------------------------------
# check=True / JAX_EP_CHECK=1: run-time errors on invalid ids and dropped tokens
# --------------------------------------------------------------------------------------------

def expect_runtime_error(thunk, match):
    with pytest.raises(RuntimeError, match=match):
        jax.block_until_ready(thunk())
    try:  # drain the failed effect so that later code (and interpreter exit) does not see it
        jax.effects_barrier()
    except Exception:  # noqa: BLE001
        try:
            from jax._src import dispatch as _dispatch  # private: clear the failed token
            _dispatch.runtime_tokens.clear()
        except (ImportError, AttributeError):
            pass


def ht_inputs(idxs, T=5, H=16, C=None):
    n = len(idxs)
    C = n * T if C is None else C
    return (jnp.ones((n, T, H)), stack(idxs), jnp.ones((n, T, idxs[0].shape[1])),
            jnp.ones((n, C, H)))


def test_check_dispatch(mesh2):
    rng = np.random.default_rng(0)
    clean = routing(rng, 2, 5, 2, E, "masked")
    fn = ht_fn(mesh2, E, None, True, True)
    jax.block_until_ready(fn(*ht_inputs(clean)))  # clean input: no error
    bad = [clean[0], clean[1].copy()]
    bad[1][2, 1] = E + 3
    expect_runtime_error(lambda: fn(*ht_inputs(bad)),
                         r"expert ids outside.*\(1 and 0 over all shards\)")
    # capacity overflow
    fnc = ht_fn(mesh2, E, 2, True, True)
    skew = routing(rng, 2, 5, 2, E, "skewed")
    expect_runtime_error(lambda: fnc(*ht_inputs(skew, C=2)),
                         r"tokens dropped.*\(0 and 8 over all shards\)")
    jax.block_until_ready(fnc(*ht_inputs([-np.ones((5, 2), np.int32)] * 2, C=2)))
    # check=False (and the default) never raise
    jax.block_until_ready(ht_fn(mesh2, E, 2, True, False)(*ht_inputs(skew, C=2)))
    jax.block_until_ready(ht_fn(mesh2, E, None, True, None)(*ht_inputs(bad)))


def test_check_low_latency(mesh2):
    rng = np.random.default_rng(1)
    T, K, H, M = 3, 2, 128, 4
    idxs = routing(rng, 2, T, K, E, "random")
    args = lambda ix: (jnp.ones((2, T, H), bf16), stack(ix), jnp.ones((2, T, K)),  # noqa: E731
                       jnp.ones((2, E // 2, 2 * M, H), bf16))
    fn = ll_fn(mesh2, E, M, True, False, True)
    jax.block_until_ready(fn(*args(idxs)))
    bad = [idxs[0].copy(), idxs[1]]
    bad[0][0, 0] = -5
    expect_runtime_error(lambda: fn(*args(bad)), r"expert ids outside.*\(1 over all shards\)")


def test_check_env_var(mesh2, monkeypatch):
    """JAX_EP_CHECK=1 turns the check on for functions traced while it is set."""
    monkeypatch.setenv("JAX_EP_CHECK", "1")
    f = smap(mesh2, lambda x, i: jax_ep.dispatch(x, i, num_experts=E, backend=BACKEND)
             .recv_count)
    idx = np.zeros((2, 5, 2), np.int32)
    jax.block_until_ready(f(jnp.ones((2, 5, 16)), jnp.asarray(idx)))
    idx[0, 0, 0] = 99
    expect_runtime_error(lambda: f(jnp.ones((2, 5, 16)), jnp.asarray(idx)),
                         r"expert ids outside.*\(1 and 0 over all shards\)")


def test_check_one_bad_shard_raises_everywhere(mesh_dp_ep):
    """Only one shard of a (dp, ep) mesh sees a bad id: an error, not a hang in the combine."""
    idx = np.zeros((4, 5, 2), np.int32)
    idx[3, 4, 1] = -3
    fn = ht_fn(mesh_dp_ep, E, None, True, True)
    expect_runtime_error(lambda: fn(jnp.ones((4, 5, 16)), jnp.asarray(idx), jnp.ones((4, 5, 2)),
                                    jnp.ones((4, 10, 16))), r"\(1 and 0 over all shards\)")


# --------------------------------------------------------------------------------------------
# The kernels' size limits, checked at trace time on every backend
# --------------------------------------------------------------------------------------------

def test_kernel_limits_are_checked_on_every_backend(mesh4, monkeypatch):
    """Limits the CUDA kernels have (runtime.limits(), from the extension) fail at trace time
    with the argument named, on the reference too: a program that traces on CPU runs on GPUs.
    Small limits are planted so that the test needs no large mesh."""
    from jax_ep import runtime
    monkeypatch.setattr(runtime, "limits", lambda: dict(max_ranks=2, max_local_experts=1,
                                                        max_layout_ranks=3))
    x = jnp.zeros((4 * 4, 128), jnp.bfloat16)
    idx = jnp.zeros((4 * 4, 2), jnp.int32)

    def run(fn):
        return jax.eval_shape(jax.shard_map(fn, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"),
                                            check_vma=False), x, idx)

    with pytest.raises(ValueError, match=r"axis_name='ep': the EP group has 4 ranks; .* at most 2"):
        run(lambda x, i: jax_ep.dispatch(x, i, num_experts=8, backend="reference").recv_x)
    with pytest.raises(ValueError, match=r"axis_name='ep': the EP group has 4 ranks"):
        run(lambda x, i: jax_ep.low_latency_dispatch(
            x, i, num_experts=8, max_tokens_per_rank=4, backend="reference").recv_count)
    with pytest.raises(ValueError, match=r"num_ranks=4: get_dispatch_layout counts at most 3"):
        jax_ep.get_dispatch_layout(idx, num_experts=8, num_ranks=4, backend="reference")
    monkeypatch.setattr(runtime, "limits", lambda: dict(max_ranks=8, max_local_experts=1,
                                                        max_layout_ranks=64))
    with pytest.raises(ValueError, match=r"num_experts=8: 2 experts per rank .* at most 1"):
        run(lambda x, i: jax_ep.low_latency_dispatch(
            x, i, num_experts=8, max_tokens_per_rank=4, backend="reference").recv_count)


def test_kernel_limits_come_from_the_extension():
    from jax_ep import runtime
    ext = runtime.extension()
    lim = runtime.limits()
    if ext is None:
        assert lim == {}
    else:
        assert lim == dict(max_ranks=ext.max_ranks, max_local_experts=ext.max_local_experts,
                           max_layout_ranks=ext.max_layout_ranks,
                           max_num_blocks=ext.max_num_blocks)


def test_check_error_is_one_typed_exception(mesh2):
    """jax_ep.checked turns a failed check into one jax_ep.CheckError carrying the op and its
    counts (this rank's and over all shards)."""
    rng = np.random.default_rng(0)
    idxs = routing(rng, 2, 5, 2, E, "masked")
    idxs[1][2, 1] = E + 3
    fn = jax_ep.checked(ht_fn(mesh2, E, None, True, True))
    with pytest.raises(jax_ep.CheckError, match=r"expert ids outside") as ei:
        fn(*ht_inputs(idxs))
    assert ei.value.op == "dispatch"
    assert ei.value.totals == {"num_invalid": 1, "num_dropped": 0}
    assert ei.value.counts["num_invalid"] in (0, 1)
    assert isinstance(ei.value.__cause__, jax.errors.JaxRuntimeError)
    # a clean step through the same wrapper returns its results
    out = fn(*ht_inputs(routing(rng, 2, 5, 2, E, "masked")))
    assert out is not None


_CHECK_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import warnings
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np, jax_ep
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
f = jax.jit(jax.shard_map(lambda x, i: jax_ep.dispatch(x, i, num_experts=8, check=True).recv_x,
                          mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
try:
    jax.block_until_ready(f(jnp.ones((16, 8)), jnp.full((16, 2), 99, jnp.int32)))
except jax.errors.JaxRuntimeError as e:
    print("CAUGHT", "jax_ep.dispatch(check=True): " in str(e))
"""


def test_check_failure_is_reported_once():
    """A failed check on 4 shards: one exception, whose message holds the check's, and no
    traceback logged per shard nor again at interpreter exit."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(jax_ep.__file__)))] +
        os.environ.get("PYTHONPATH", "").split(os.pathsep)), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "CAUGHT True" in p.stdout, out[-3000:]
    assert "Exception ignored" not in out, out[-3000:]
    assert out.count("Traceback") <= 1, out[-3000:]   # the one inside the caught message


def test_check_under_vmap():
    """check=True under jax.vmap over the EP axis (the one-GPU multi-rank mode's form) and over
    a batch axis: clean input runs, invalid ids raise."""
    R, T, K = 2, 5, 2
    rng = np.random.default_rng(4)
    idx = np.stack(routing(rng, R, T, K, E, "masked"))

    def one(x, i):
        return jax_ep.dispatch(x, i, num_experts=E, check=True, backend=BACKEND).recv_count

    f = jax.jit(jax.vmap(one, axis_name="ep"))
    x = jnp.ones((R, T, 16))
    jax.block_until_ready(f(x, jnp.asarray(idx)))
    bad = idx.copy()
    bad[1, 0, 0] = E + 1
    with pytest.raises(jax_ep.CheckError, match=r"expert ids outside.*\(1 and 0 over"):
        jax_ep.checked(f)(x, jnp.asarray(bad))
    g = jax.jit(jax.vmap(jax.vmap(one, axis_name="ep")))  # a batch axis outside
    jax.block_until_ready(g(x[None], jnp.asarray(idx)[None]))


def _fake_timeout():
    rec = {"rank": 1, "peer": 3, "num_ranks": 4, "epoch": 7, "seen": 6, "timeout_ns": 600 * 10**9,
           "phase": "ll_dispatch: wait for the peers' rows"}
    return jax_ep.PeerTimeoutError("jax_ep: ll_dispatch timed out: rank 1 of 4 ...", [rec])


def test_peer_timeout_error_fields():
    e = _fake_timeout()
    assert isinstance(e, RuntimeError)
    assert (e.op, e.rank, e.num_ranks, e.peer, e.timeout_s) == ("ll_dispatch", 1, 4, 3, 600.0)
    assert e.phase.startswith("ll_dispatch: ") and e.setting == "JAX_EP_TIMEOUT_S"
    if jax_ep.runtime.extension() is None or jax.default_backend() != "gpu":
        assert jax_ep.raise_if_timed_out() is None  # nothing gave up here


def test_checked_raises_a_timeout_recorded_during_the_step(monkeypatch):
    """checked(step) waits for the step, then raises the recorded timeout: in place of the
    step's results, and in place of the JaxRuntimeError of a later op."""
    from jax_ep import _faults
    step = jax.jit(lambda x: x + 1)
    assert int(jax_ep.checked(step)(1)) == 2
    monkeypatch.setattr(_faults, "timeout_error", _fake_timeout)
    with pytest.raises(jax_ep.PeerTimeoutError) as info:
        jax_ep.checked(step)(1)
    assert info.value.op == "ll_dispatch" and info.value.peer == 3

    def failing():
        raise RuntimeError("DEADLINE_EXCEEDED: jax_ep: ll_dispatch timed out")
    with pytest.raises(jax_ep.PeerTimeoutError) as info:
        jax_ep.checked(failing)()
    assert isinstance(info.value.__cause__, RuntimeError)

    def unrelated():  # an error of the step's own stays what it is
        raise ValueError("a shape mismatch of the model")
    with pytest.raises(ValueError, match="shape mismatch"):
        jax_ep.checked(unrelated)()


def test_a_check_of_poisoned_counts_raises_the_timeout(monkeypatch):
    """An op whose wait gave up leaves the sentinel in its counts (docs/API.md#timeouts): its
    check=True raises the recorded PeerTimeoutError, not a CheckError about -1 invalid ids,
    and checked(step) hands it on (the JaxRuntimeError of the callback as its cause)."""
    from jax_ep import _checks, _faults
    sentinel = poison_values()[1]

    def one(x, n):
        return _checks.checked_result(x, "dispatch", {"num_invalid": n, "num_dropped": n}, "ep",
                                      lambda v, t: f"{v} {t}")
    f = jax.jit(jax.vmap(one, axis_name="ep"))
    x = jnp.ones((2, 3))
    jax.block_until_ready(f(x, jnp.zeros((2,), jnp.int32)))
    monkeypatch.setattr(_faults, "timeout_error", _fake_timeout)
    with pytest.raises(jax_ep.PeerTimeoutError) as info:
        jax_ep.checked(f)(x, jnp.asarray([sentinel, 0], jnp.int32))
    assert info.value.op == "ll_dispatch" and info.value.__cause__ is not None


def poison_values():
    """(byte, int32 sentinel) of the results of an op whose wait gave up: their one definition,
    csrc/transport/poison.h."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parent.parent / "csrc" / "transport" /
            "poison.h").read_text()
    byte = int(re.search(r"kByte = (0x[0-9A-Fa-f]+|\d+);", text).group(1), 0)
    return byte, int(re.search(r"kInt = (-?\d+);", text).group(1))


def test_the_poison_is_nan_in_every_result_dtype_and_the_sentinel_in_int32():
    """Every byte of a poisoned result is one value: NaN in every floating dtype the ops return
    (they move rows as bytes), the sentinel in int32; the extension exports both and docs/API.md
    names them."""
    import pathlib
    byte, sentinel = poison_values()
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn):
        a = np.frombuffer(bytes([byte]) * 8, dtype=jnp.dtype(dt))
        assert np.isnan(a.astype(np.float32)).all(), dt
    assert int(np.frombuffer(bytes([byte]) * 4, np.int32)[0]) == sentinel
    ext = jax_ep.runtime.extension()
    if ext is not None:
        assert (int(ext.poison_byte), int(ext.poison_int)) == (byte, sentinel)
        assert jax_ep.runtime.poison_int() == sentinel
    else:
        assert jax_ep.runtime.poison_int() is None
    api = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "API.md").read_text()
    bullet = api[api.index('<a id="timeouts"></a>'):][:4000]
    assert "NaN" in bullet and f"is {sentinel} (" in bullet and "poison_int" in bullet


def test_absent_ranks_checks_its_ranks():
    for bad in (-1, True, 1.0) + ((99,) if jax_ep.runtime.max_ranks() else ()):
        with pytest.raises(ValueError, match="absent_ranks"):
            with jax_ep.testing.absent_ranks([bad]):
                pass
