"""Shared fixtures: 8 host CPU devices (set before jax is imported) and the test meshes."""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mesh(ids, shape, names):
    devs = jax.devices()
    if len(devs) < max(ids) + 1:
        pytest.fail(f"need {max(ids) + 1} devices, have {len(devs)} (XLA_FLAGS not applied?)")
    return Mesh(np.array([devs[i] for i in ids]).reshape(shape), names)


@pytest.fixture(scope="session")
def mesh2():
    return _mesh([0, 1], (2,), ("ep",))


@pytest.fixture(scope="session")
def mesh4():
    return _mesh([0, 1, 2, 3], (4,), ("ep",))


@pytest.fixture(scope="session")
def mesh_dp_ep():
    return _mesh([0, 1, 2, 3], (2, 2), ("dp", "ep"))


@pytest.fixture(scope="session")
def mesh_permuted():
    return _mesh([3, 1, 2, 0], (4,), ("ep",))


@pytest.fixture(scope="session")
def mesh_dp_ep_permuted():
    return _mesh([3, 1, 2, 0], (2, 2), ("dp", "ep"))


@pytest.fixture(scope="session")
def meshes(mesh2, mesh4, mesh_dp_ep, mesh_permuted, mesh_dp_ep_permuted):
    return {"ep2": mesh2, "ep4": mesh4, "dp_ep": mesh_dp_ep, "ep4_perm": mesh_permuted,
            "dp_ep_perm": mesh_dp_ep_permuted}


# Mutation check: JAX_EP_GEMM_MUTATION=<name> plants a bug between the op and its kernels; the
# GEMM suites (test_gpu_gemm.py, test_gpu_moe.py) must then fail (scripts/gpu_check.sh
# gemm-mutations runs each and counts the failures). The bugs planted in the native code are
# numbered in csrc/testing/mutations.h (a build's: jax_ep._C.planted_bug()).
_MUTATIONS = {
    # every group's rows shifted to the next group's weights
    "shift_sizes": lambda sizes, kw: (jax.numpy.roll(sizes, 1), kw),
    # the last group's rows never computed (left to the zero fill)
    "drop_last_group": lambda sizes, kw: (sizes.at[-1].set(0), kw),
    # the weight gradient reduces over each segment's padding rows too
    "ignore_row_counts": lambda sizes, kw: (sizes, dict(kw, row_counts=None)),
    # the weight gradient overwrites its accumulator instead of adding to it
    "drop_accumulation": lambda sizes, kw: (sizes, dict(kw, acc=None)),
    # the masked layout's rows past each count never written
    "masked_no_zero_fill": lambda sizes, kw: (
        sizes, dict(kw, zero_padding=False) if kw.get("mode") == "masked" else kw),
}


# JAX_EP_LAYER_MUTATION=<name> plants a bug in moe_ffn's passes (Python, either backend); the
# capacity tests (tests/test_moe_capacity.py) must then fail.
_LAYER_MUTATIONS = {
    # a later pass sends every pair left, not only those it keeps: its transfer cuts tokens
    # where it has fewer rows than the tokens that reach a rank
    "later_passes_send_every_pair": lambda real: (
        lambda topk_idx, done, upto=None, **kw: real(topk_idx, done, **kw)),
}


@pytest.fixture(autouse=True)
def _planted_bug(monkeypatch):
    layer = os.environ.get("JAX_EP_LAYER_MUTATION")
    if layer:
        from jax_ep import expert_layout as el
        monkeypatch.setattr(el, "pass_slots", _LAYER_MUTATIONS[layer](el.pass_slots))
    name = os.environ.get("JAX_EP_GEMM_MUTATION")
    if not name:
        return
    from jax_ep import grouped_gemm as gg
    real, plant = gg.gemm_call, _MUTATIONS[name]

    def planted(lhs, rhs, sizes, *args, **kw):
        sizes, kw = plant(sizes, kw)
        return real(lhs, rhs, sizes, *args, **kw)
    monkeypatch.setattr(gg, "gemm_call", planted)
