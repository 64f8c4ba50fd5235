"""jax_ep.testing on CPU: virtual ranks (vmap over the EP axis) give what shard_map gives, with
the reference backend; the mode's switch is validated."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep import testing


def _body(E):
    def body(x, idx, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=E, backend="reference")
        out = jax_ep.combine(r.recv_x * 2, r.handle, backend="reference")
        ll = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=x.shape[0],
                                         use_fp8=False, backend="reference")
        o2 = jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, backend="reference")
        return r.recv_x, r.handle.recv_src, out, ll.recv_count, o2
    return body


@pytest.mark.parametrize("R", [2, 4])
def test_virtual_ranks_equal_shard_map(monkeypatch, R):
    T, H, K, E = 7, 16, 2, 2 * R
    rng = np.random.default_rng(R)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R, T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "0")
    real = testing.run_ranks(_body(E), R)(x, idx, w)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "1")
    virtual = testing.run_ranks(_body(E), R)(x, idx, w)
    for a, b in zip(real, virtual):
        assert a.shape == b.shape and a.shape[0] == R
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_virtual_ranks_gradient_inside_equals_global_gradient(monkeypatch, mode):
    """A gradient taken inside the per-rank body is that of the sum over the ranks (what
    jax.grad of the global loss gives through shard_map). The loss is a plain sum: its
    cotangent is the same on every rank, which vmap does not batch."""
    R, T, H, K, E = 4, 5, 128, 2, 8
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R, T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)

    def fwd(x, i, w):
        if mode == "high_throughput":
            r = jax_ep.dispatch(x, i, w, num_experts=E, backend="reference")
            return jax_ep.combine(jnp.sin(r.recv_x), r.handle, backend="reference")
        r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=T,
                                        use_fp8=False, backend="reference")
        return jax_ep.low_latency_combine(jnp.sin(r.recv_x), i, w, r.handle,
                                          backend="reference")

    def loss(out):
        return jnp.sum(out.astype(jnp.float32))

    inside = testing.virtual_ranks(
        lambda x, i, w: jax.grad(lambda x, w: loss(fwd(x, i, w)), argnums=(0, 1))(x, w),
        R)(x, idx, w)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "0")
    sm = testing.run_ranks(fwd, R)
    outside = jax.grad(lambda x, w: loss(sm(x, idx, w)), argnums=(0, 1))(x, w)
    for a, b in zip(inside, outside):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad", ["yes", "2"])
def test_virtual_ranks_switch_is_checked(monkeypatch, bad):
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", bad)
    with pytest.raises(ValueError, match="JAX_EP_VIRTUAL_RANKS"):
        testing.use_virtual_ranks(2)


def test_virtual_ranks_count_is_checked(monkeypatch):
    from jax_ep import runtime
    # the kernels' limit (runtime.limits(), from the extension; planted here for machines
    # without it, where the reference alone has no limit)
    monkeypatch.setattr(runtime, "limits", lambda: {"max_ranks": 8})
    with pytest.raises(ValueError, match="num_ranks=9: the one-GPU multi-rank mode runs 1 to 8"):
        testing.virtual_ranks(lambda x: x, 9)
    with pytest.raises(ValueError, match="num_ranks=0"):
        testing.virtual_ranks(lambda x: x, 0)


def test_cpu_machine_never_picks_virtual_ranks(monkeypatch):
    monkeypatch.delenv("JAX_EP_VIRTUAL_RANKS", raising=False)
    assert testing.use_virtual_ranks(8) is False  # no GPU: shard_map over the CPU devices
