"""moe_ffn(check=True) and the Flax module's check: invalid expert ids raise jax_ep.CheckError
naming moe_ffn (through jax_ep.checked), and the first line the user sees says so."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep

R, T, H, I, K = 2, 8, 128, 64, 2
E = 2 * R


def _step(check):
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))

    def body(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, backend="reference",
                              check=check)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def _args(bad):
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    if bad:
        idx[3, 1] = E + 2
        idx[T + 1, 0] = -5
    return (jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32), jnp.asarray(idx),
            jnp.asarray(rng.random((R * T, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((E, H, 2 * I)) / 8, jnp.float32),
            jnp.asarray(rng.standard_normal((E, I, H)) / 8, jnp.float32))


def test_moe_ffn_check_raises_on_invalid_ids(caplog):
    step = jax_ep.checked(_step(True))
    with caplog.at_level(logging.ERROR, logger="jax_ep"):
        with pytest.raises(jax_ep.CheckError, match=r"jax_ep\.moe_ffn\(check=True\): .* "
                           r"outside \[-1, E=4\)") as e:
            step(*_args(bad=True))
    assert e.value.op == "moe_ffn" and e.value.totals == {"num_invalid": 2}
    # the line a user sees first names the op and the way to the typed exception
    lines = [r.getMessage() for r in caplog.records if r.name == "jax_ep"]
    assert len(lines) == 1 and "moe_ffn" in lines[0] and "jax_ep.checked" in lines[0], lines


def test_moe_ffn_check_passes_clean_routing_and_is_off_by_default():
    good = jax_ep.checked(_step(True))(*_args(bad=False))
    np.testing.assert_array_equal(good, _step(None)(*_args(bad=False)))
    _step(None)(*_args(bad=True)).block_until_ready()      # off: invalid ids act as -1


def test_check_must_be_a_bool():
    with pytest.raises(TypeError, match="check"):
        _step("yes")(*_args(bad=False))


def test_flax_module_takes_check():
    nnx = pytest.importorskip("flax.nnx")
    from jax_ep.flax import MoE
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    m = MoE(H, I, E, K, mesh=mesh, check=True, backend="reference", dtype=jnp.float32,
            rngs=nnx.Rngs(0))
    assert m.check is True
    assert m(jnp.ones((R * T, H), jnp.float32)).shape == (R * T, H)
    with pytest.raises(TypeError, match="check"):
        MoE(H, I, E, K, mesh=mesh, check="no", rngs=nnx.Rngs(0))
