"""The CUDA lowering, checked on a CPU machine: lower for platform 'cuda' and read the HLO.

The CUDA extension is not needed to lower: the availability check, the peer-runtime set-up and
the FFI target registration are patched out; nothing is compiled or run. The buffer sizes the
extension owns come from it when it is built, else from a stand-in that only has to be positive
(what lowers is checked here, not the sizes: the GPU suites run the real ones).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
import jax_ep._ffi
import jax_ep.runtime
from helpers import eqns_by_loop, smap

E = 8
PULL_TARGETS = ("jax_ep_ht_dispatch", "jax_ep_ht_combine", "jax_ep_ht_gather")
PUSH_TARGETS = ("jax_ep_ll_dispatch", "jax_ep_ll_combine", "jax_ep_ll_dispatch_send",
                "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")
COMM_TARGETS = PULL_TARGETS + PUSH_TARGETS


@pytest.fixture
def cuda_lowering(monkeypatch):
    monkeypatch.setattr(jax_ep.runtime, "cuda_backend_available", lambda: True)
    monkeypatch.setattr(jax_ep.runtime, "ensure_peer_runtime", lambda *a, **k: None)
    monkeypatch.setattr(jax_ep._ffi, "_register_targets", lambda: None)
    if jax_ep.runtime.extension() is None:
        class SizesOnly:
            ht_scratch_words = staticmethod(lambda R, T: R * T + 64)
            ll_dispatch_buffer_bytes = staticmethod(lambda R, M, K, H, L, fp8: 1 << 20)
            ll_combine_buffer_bytes = staticmethod(lambda R, M, K, H: 1 << 20)
            ht_staged_operands = {t: 1 for t in PULL_TARGETS}
        monkeypatch.setattr(jax_ep.runtime, "extension", lambda: SizesOnly)


def expected_groups(mesh, axis="ep"):
    """Rows: each EP group's device ids in ep-axis order (read straight off mesh.devices)."""
    devs = np.asarray(mesh.devices)
    ax = list(mesh.axis_names).index(axis)
    rows = []
    other = [range(s) for i, s in enumerate(devs.shape) if i != ax]
    for pos in np.ndindex(*[len(r) for r in other]):
        row = []
        for k in range(devs.shape[ax]):
            full = list(pos)
            full.insert(ax, k)
            row.append(devs[tuple(full)].id)
        rows.append(tuple(row))
    return rows


CALL_RE = re.compile(r"stablehlo\.custom_call @(\w+)\((.*)$", re.M)


def custom_calls(text):
    """[(target, attribute text)] in program order."""
    return [(m.group(1), m.group(2)) for m in CALL_RE.finditer(text)]


def operand_types(call):
    """The operand types of a custom call's text (from `custom_calls`), in order."""
    sig = call[call.rindex(" : (") + 4:].split(") -> ")[0]
    return re.findall(r"tensor<[^>]*>", sig)


def attr(text, name):
    m = re.search(rf"\b{name} = ([^,}}]*(?:<[^>]*>[^,}}]*)?)", text)
    return None if m is None else m.group(1).strip()


def int_attr(text, name):
    v = attr(text, name)
    assert v is not None, f"no {name} in {text[:300]}"
    return int(re.match(r"(-?\d+)", v).group(1))


def groups_attr(text):
    m = re.search(r"groups = (?:dense<\[?([-\d, ]+)\]?>|array<i64: ([-\d, ]+)>)", text)
    assert m, f"no groups attribute in {text[:300]}"
    return [int(v) for v in (m.group(1) or m.group(2)).split(",")]


def all_ops(x, idx, w, xl, il, wl):
    """Every op once (plus the backward of a dispatch and of a combine), backend='cuda'."""
    res = jax_ep.dispatch(x, idx, w, num_experts=E, backend="cuda")
    out = jax_ep.combine(res.recv_x, res.handle, backend="cuda")
    q, s = jax_ep.quantize_fp8(x.astype(jnp.bfloat16))
    res8 = jax_ep.dispatch((q, s), idx, num_experts=E, capacity=7, backend="cuda")

    def loss(x, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=E, backend="cuda")
        y = r.recv_x * r.recv_topk_weights.sum(1, keepdims=True)
        return jnp.sum(jax_ep.combine(y, r.handle, backend="cuda") ** 2)

    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    ll = jax_ep.low_latency_dispatch(xl, il, num_experts=E, max_tokens_per_rank=6,
                                     backend="cuda")
    ll16 = jax_ep.low_latency_dispatch(xl, il, num_experts=E, max_tokens_per_rank=6,
                                       use_fp8=False, backend="cuda")
    outl = jax_ep.low_latency_combine(ll16.recv_x, il, wl, ll16.handle, backend="cuda")
    pend = jax_ep.low_latency_dispatch_send(xl, il, num_experts=E, max_tokens_per_rank=6,
                                            backend="cuda")
    lls = jax_ep.low_latency_dispatch_recv(pend)
    cpend = jax_ep.low_latency_combine_send(ll16.recv_x, il, wl, ll16.handle, backend="cuda")
    outs = jax_ep.low_latency_combine_recv(cpend)
    lay = jax_ep.get_dispatch_layout(idx, num_experts=E, num_ranks=2, backend="cuda")
    return (out, res8.recv_x[1], gx, gw, ll.recv_x[1], outl, lay[0], lls.recv_x[0], outs)


def lower_all(mesh):
    T, H, K = 5, 128, 2
    n = int(np.prod(list(mesh.shape.values())))
    args = (jnp.ones((n, T, H)), jnp.zeros((n, T, K), jnp.int32), jnp.ones((n, T, K)),
            jnp.ones((n, 4, H), jnp.bfloat16), jnp.zeros((n, 4, K), jnp.int32),
            jnp.ones((n, 4, K)))
    f = smap(mesh, all_ops)
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mesh_name", ["dp_ep_perm", "ep_dp", "ep4_perm"])
def test_cuda_lowering(cuda_lowering, meshes, mesh_name):
    if mesh_name == "ep_dp":  # ep is the leading mesh axis
        mesh = Mesh(np.array([jax.devices()[i] for i in (2, 0, 3, 1)]).reshape(2, 2),
                    ("ep", "dp"))
    else:
        mesh = meshes[mesh_name]
    text = lower_all(mesh)
    calls = custom_calls(text)
    targets = [t for t, _ in calls]
    for t in COMM_TARGETS + ("jax_ep_layout",):
        assert t in targets, f"{t} not lowered; got {sorted(set(targets))}"
    want = expected_groups(mesh)
    R = mesh.shape["ep"]
    sites = []
    for target, a in calls:
        if not target.startswith("jax_ep_"):
            continue
        assert "has_side_effect = true" in a, target
        if target == "jax_ep_layout":
            assert attr(a, "groups") is None and attr(a, "slot") is None
            assert int_attr(a, "num_experts") == E
            continue
        assert target in COMM_TARGETS, target
        flat = groups_attr(a)
        assert len(flat) == len(want) * R
        rows = [tuple(flat[i:i + R]) for i in range(0, len(flat), R)]
        assert sorted(rows) == sorted(want), (target, rows, want)
        assert int_attr(a, "group_size") == R
        assert int_attr(a, "timeout_ns") > 0
        # No slot and no buffer addresses at lowering: the call site's lease holds them, taken
        # when the executable is built (csrc/runtime/lease.h).
        assert attr(a, "slot") is None and attr(a, "bufs") is None and attr(a, "stage") is None
        site = int_attr(a, "site")
        if target in PULL_TARGETS:
            assert int_attr(a, "num_blocks") >= 1
            # one process: no staging buffers (the per-process mode stages operands)
            assert int_attr(a, "stage_bytes") == 0, (target, a[:300])
        else:  # push ops: the size of their call site's receive buffers
            assert int_attr(a, "buffer_bytes") > 0
        sig = re.sub(r"site = \d+ : i64", "", re.sub(r"%[\w#]+", "%", a))
        sites.append((target, sig, site))
    # Call sites get their own site id, hence their own lease. (JAX's lowering cache gives call
    # sites with the same target, attributes and types one lowering, hence one site; the slot's
    # epoch protocol orders such calls, which run one after the other in the same order on
    # every rank.) The two halves of a split op share one site; nothing else does.
    by_sig = {}
    for target, sig, site in sites:
        by_sig.setdefault((target, sig), set()).add(site)
    assert all(len(v) == 1 for v in by_sig.values()), by_sig
    site_of = {t: next(iter(v)) for (t, _), v in by_sig.items()}
    assert site_of["jax_ep_ll_dispatch_send"] == site_of["jax_ep_ll_dispatch_recv"]
    assert site_of["jax_ep_ll_combine_send"] == site_of["jax_ep_ll_combine_recv"]
    distinct = [next(iter(v)) for (t, _), v in by_sig.items() if not t.endswith("_recv")]
    assert len(distinct) >= 9 and len(set(distinct)) == len(distinct), by_sig


def test_cuda_lowering_settings(cuda_lowering, mesh2, monkeypatch):
    """JAX_EP_TIMEOUT_S and set_num_blocks reach the attributes of newly traced calls."""
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "2.5")
    jax_ep.set_num_blocks(7)
    try:
        f = smap(mesh2, lambda x, i: jax_ep.dispatch(x, i, num_experts=E,
                                                     backend="cuda").recv_x)
        text = f.trace(jnp.ones((2, 3, 16)), jnp.zeros((2, 3, 2), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        jax_ep.set_num_blocks(None)
    (a,) = [a for t, a in custom_calls(text) if t == "jax_ep_ht_dispatch"]
    assert int_attr(a, "timeout_ns") == 2_500_000_000
    assert int_attr(a, "num_blocks") == 7
    assert int_attr(a, "num_experts") == E
    assert groups_attr(a) == [0, 1]
    with pytest.raises(ValueError, match="num_blocks"):
        jax_ep.set_num_blocks(0)


@pytest.mark.parametrize("prereduce,diag", [("1", "0"), ("0", "1")])
def test_cuda_lowering_low_latency_settings(cuda_lowering, mesh2, monkeypatch, prereduce, diag):
    """JAX_EP_LL_PREREDUCE / JAX_EP_LL_DIAG become attributes of every low-latency call."""
    monkeypatch.setenv("JAX_EP_LL_PREREDUCE", prereduce)
    monkeypatch.setenv("JAX_EP_LL_DIAG", diag)

    def f(x, i):
        r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=3,
                                        use_fp8=False, backend="cuda")
        return jax_ep.low_latency_combine(r.recv_x, i, jnp.ones(i.shape), r.handle,
                                          backend="cuda")
    text = smap(mesh2, f).trace(jnp.ones((2, 3, 128), jnp.bfloat16),
                                jnp.zeros((2, 3, 2), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [a for t, a in custom_calls(text) if t.startswith("jax_ep_ll_")]
    assert len(calls) == 2
    for a in calls:
        assert re.search(rf"prereduce = {'true' if prereduce == '1' else 'false'}", a), a
        assert re.search(rf"diag = {'true' if diag == '1' else 'false'}", a), a


def test_group_table():
    d = jax.devices()
    m1 = Mesh(np.array([d[i] for i in (3, 1, 2, 0)]), ("ep",))
    np.testing.assert_array_equal(jax_ep._ffi.group_table(m1, "ep"), [[3, 1, 2, 0]])
    m2 = Mesh(np.array([d[i] for i in (3, 1, 2, 0)]).reshape(2, 2), ("dp", "ep"))
    np.testing.assert_array_equal(jax_ep._ffi.group_table(m2, "ep"), [[3, 1], [2, 0]])
    np.testing.assert_array_equal(jax_ep._ffi.group_table(m2, "dp"), [[3, 2], [1, 0]])
    m3 = Mesh(np.array([d[i] for i in (7, 6, 5, 4, 3, 2, 1, 0)]).reshape(2, 2, 2),
              ("pp", "ep", "tp"))
    t = jax_ep._ffi.group_table(m3, "ep")
    assert t.dtype == np.int64 and t.shape == (4, 2)
    assert sorted(map(tuple, t.tolist())) == sorted(expected_groups(m3))
    np.testing.assert_array_equal(t, [[7, 5], [6, 4], [3, 1], [2, 0]])
    with pytest.raises(ValueError, match="axis_name='xx'"):
        jax_ep._ffi.group_table(m2, "xx")


def test_reference_lowering_has_no_custom_call(mesh2):
    """backend='reference' (the CPU default) lowers to plain collectives."""
    f = smap(mesh2, lambda x, i: jax_ep.dispatch(x, i, num_experts=E,
                                                 backend="reference").recv_x)
    text = f.trace(jnp.ones((2, 3, 16)), jnp.zeros((2, 3, 2), jnp.int32)).lower().as_text()
    assert "jax_ep_" not in text.replace("jit(", "")
    assert "all_to_all" in text


def test_cuda_lowering_of_virtual_ranks(cuda_lowering, monkeypatch):
    """vmap over the EP axis on one device: every communication op lowers to its `_vr` twin,
    with operands and results stacked over the ranks and a group of virtual-rank ids."""
    ext = jax_ep.runtime.extension()
    vid = ext.virtual_id if hasattr(ext, "virtual_id") else (lambda d, r: -(1 + d * 8 + r))
    if not hasattr(ext, "virtual_id"):
        monkeypatch.setattr(ext, "virtual_id", staticmethod(vid), raising=False)
    # 64 SMs: each of the 4 ranks' bandwidth kernels defaults to 16 blocks
    monkeypatch.setattr(ext, "device_sm_count", lambda d: 64, raising=False)
    R, T, H, K = 4, 5, 128, 2
    args = (jnp.ones((R, T, H)), jnp.zeros((R, T, K), jnp.int32), jnp.ones((R, T, K)),
            jnp.ones((R, 4, H), jnp.bfloat16), jnp.zeros((R, 4, K), jnp.int32),
            jnp.ones((R, 4, K)))
    f = jax.jit(jax_ep.testing.virtual_ranks(all_ops, R))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [(t, a) for t, a in custom_calls(text) if t.startswith("jax_ep_")]
    targets = {t for t, _ in calls}
    assert targets >= {t + "_vr" for t in COMM_TARGETS}, sorted(targets)
    assert not targets & set(COMM_TARGETS), sorted(targets)
    dev = jax.devices()[0]
    dev = dev.local_hardware_id if dev.local_hardware_id is not None else dev.id
    for target, a in calls:
        if target == "jax_ep_layout":  # no communication: one call per rank (a loop)
            continue
        assert groups_attr(a) == [vid(dev, r) for r in range(R)], target
        assert int_attr(a, "group_size") == R
        if target.startswith("jax_ep_ht_"):
            assert int_attr(a, "num_blocks") == 16, target
    # operands and results of the twins lead with the rank axis
    for m in re.finditer(r"stablehlo\.custom_call @(jax_ep_\w+_vr)\(([^)]*)\).*?: \((.*?)\) -> "
                         r"(.*)$", text, re.M):
        for ty in re.findall(r"tensor<([^>]*)>", m.group(3) + m.group(4)):
            assert ty.startswith(f"{R}x"), (m.group(1), ty)


class _GemmTable:
    """The extension's grouped-GEMM tables, enough of them to lower (nothing runs)."""
    gemm_dtypes = {"bfloat16": 0, "float16": 1, "float8_e4m3fn": 2}
    gemm_modes = {"contiguous": 0, "masked": 1, "transposed": 2}
    grouped_gemm_workspace_bytes = staticmethod(lambda *a, **k: 1024)
    gemm_unsupported = staticmethod(lambda *a: "")
    gemm_built = staticmethod(lambda: True)


def test_accumulating_weight_gradient_writes_in_its_accumulator(cuda_lowering, monkeypatch):
    """matmul_accumulating_grad's weight gradient: one grouped-GEMM call in mode 2 with
    accumulate = true whose result 0 aliases its accumulator operand (so a loop that sums
    weight gradients holds one set); the plain weight gradient has neither."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _GemmTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    from jax_ep import grouped_gemm as gg
    M, K, N, G = 64, 32, 16, 4
    a = jnp.ones((M, K), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)

    def grad_b(b, acc):
        if acc is None:
            f = lambda b: jax_ep.grouped_matmul(a, b, sizes, backend="cuda")  # noqa: E731
        else:
            f = lambda b: gg.matmul_accumulating_grad(a, b, sizes, acc, backend="cuda")  # noqa
        return jax.grad(lambda b: jnp.sum(f(b).astype(jnp.float32)))(b)

    b = jnp.ones((G, K, N), jnp.bfloat16)
    for acc in (jnp.zeros_like(b), None):
        text = jax.jit(grad_b).trace(b, acc).lower(lowering_platforms=("cuda",)).as_text()
        calls = [c for t, c in custom_calls(text) if t == "jax_ep_grouped_gemm"]
        tgrad = [c for c in calls if int_attr(c, "mode") == 2]
        assert len(tgrad) == 1, calls   # (the forward and d lhs are unused: dropped)
        if acc is None:
            assert attr(tgrad[0], "accumulate") == "false"
            assert "output_operand_alias" not in text
        else:
            assert attr(tgrad[0], "accumulate") == "true"
            m = re.search(r"output_operand_alias<output_tuple_indices = \[0\], "
                          r"operand_index = (\d+)", text)
            assert m and int(m.group(1)) == 6, text[-2000:]


class _LayerTable(_GemmTable):
    """The extension's tables for moe_ffn, the fused path's included (nothing runs)."""
    ht_scratch_words = staticmethod(lambda R, T: R * T + 64)
    ht_staged_operands = {t: 1 for t in PULL_TARGETS + ("jax_ep_ht_gather_gemm",)}
    fused_block_rows = 128
    fused_block_columns = 256
    fused_max_dups = 4
    max_position_experts = 256
    position_slice_pairs = 2048
    fused_counter_words = staticmethod(lambda C: 64)
    fused_combine_counter_words = staticmethod(lambda C, Cr, N: 64 + Cr)
    ll_dispatch_buffer_bytes = staticmethod(lambda R, M, K, H, L, fp8: 1 << 20)
    ll_combine_buffer_bytes = staticmethod(lambda R, M, K, H: 1 << 20)


# the layer's shapes in the lowering tests below: per shard T tokens, 2 ranks of L experts
LT, LH, LI, LK, LL = 8, 128, 64, 2, 2


def _moe_gradients_lowered(monkeypatch, wrap, argnums, rows, experts, **kw):
    """The CUDA lowering (text) of the gradients in `argnums` of sum(moe_ffn(..., **kw)) per
    shard, under wrap (a jit of a shard_map), on bf16 inputs with leading shapes `rows` (x,
    topk_idx, topk_weights) and `experts` (the weights); E = 2 * LL experts."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)

    def loss(x, idx, w, wgu, wd):
        y = jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, backend="cuda", **kw)
        return jnp.sum(y.astype(jnp.float32))

    def step(x, idx, w, wgu, wd):
        return jax.grad(loss, argnums=argnums)(x, idx, w, wgu, wd)
    args = (jnp.ones(rows + (LH,), jnp.bfloat16), jnp.zeros(rows + (LK,), jnp.int32),
            jnp.ones(rows + (LK,), jnp.bfloat16), jnp.ones(experts + (LH, 2 * LI), jnp.bfloat16),
            jnp.ones(experts + (LI, LH), jnp.bfloat16))
    return wrap(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kw, fused", [
    (dict(), True), (dict(x_dtype=jnp.float16), False), (dict(use_fp8=True), False),
    (dict(mode="low_latency"), False), (dict(fused=False), False)],
    ids=["bf16", "f16", "fp8", "low_latency", "fused=False"])
def test_moe_ffn_default_is_fused_where_it_applies(cuda_lowering, monkeypatch, mesh2, kw, fused):
    """moe_ffn's default `fused=None` runs the fused kernels in high-throughput mode on bfloat16
    (the faster layer at R = 1, 2 and 4), and the unfused ops where the fused path does not
    apply (float16, FP8, low-latency mode) instead of raising; fused=False keeps them unfused."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    kw = dict(kw)
    dt = kw.pop("x_dtype", jnp.bfloat16)
    wgu = jnp.ones((LL, LH, 2 * LI), dt)
    if kw.get("use_fp8"):
        wgu = jax_ep.quantize_fp8_weights(wgu.astype(jnp.bfloat16))

    def layer(x, idx, w, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, backend="cuda", **kw)
    args = (jnp.ones((2, LT, LH), dt), jnp.zeros((2, LT, LK), jnp.int32),
            jnp.ones((2, LT, LK), jnp.float32),
            jnp.ones((2, LL, LI, LH), jnp.bfloat16 if kw.get("use_fp8") else dt))
    text = smap(mesh2, layer).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = {t for t, _ in custom_calls(text)}
    assert ("jax_ep_ht_gather_gemm" in targets) == fused, targets
    assert ("jax_ep_ht_gemm_combine" in targets) == fused, targets


@pytest.mark.parametrize("inter, epilogue", [(128, True), (LI, False)])
def test_fused_activation_rides_in_the_first_gemm_epilogue(cuda_lowering, monkeypatch, mesh2,
                                                           inter, epilogue):
    """With 2I a multiple of the kernel's tile columns, the fused dispatch + GEMM computes
    silu(gate) * up in its epilogue (activation=1, a [C, I] result that the GEMM + combine
    reads): no float32 pass over the rows between the two kernels. Otherwise activation=0 and
    the layer applies it after the kernel."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    wgu = jnp.ones((LL, LH, 2 * inter), jnp.bfloat16)

    def layer(x, idx, w, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, backend="cuda")
    args = (jnp.ones((2, LT, LH), jnp.bfloat16), jnp.zeros((2, LT, LK), jnp.int32),
            jnp.ones((2, LT, LK), jnp.float32), jnp.ones((2, LL, inter, LH), jnp.bfloat16))
    text = smap(mesh2, layer).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    (gg,) = [a for t, a in custom_calls(text) if t == "jax_ep_ht_gather_gemm"]
    assert int_attr(gg, "activation") == int(epilogue)
    results = re.findall(r"tensor<[^>]*>", gg[gg.rindex(") -> "):])
    C = int(re.match(r"tensor<(\d+)x", results[0]).group(1))
    assert results[2] == f"tensor<{C if epilogue else 0}x{inter}xbf16>", results
    # the XLA activation's float32 rows
    assert (f"tensor<{C}x{inter}xf32>" in text) != epilogue


@pytest.mark.parametrize("experts", [1024, LL - 1])
def test_layout_places_pairs_in_kernels_where_they_serve_the_experts(cuda_lowering, monkeypatch,
                                                                     experts):
    """On the CUDA backend the expert-major layout places its pairs with
    jax_ep_expert_positions (no sort) when its kernels serve the rank's experts
    (`max_position_experts`), and with XLA's sort by expert when not; the call's scratch holds
    one row of counts per slice of `position_slice_pairs` pairs."""
    monkeypatch.setattr(_LayerTable, "max_position_experts", experts)
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    wgu = jnp.ones((LL, LH, 4 * LI), jnp.bfloat16)

    def layer(x, idx, w, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=LL, backend="cuda")
    args = (jnp.ones((1, LT, LH), jnp.bfloat16), jnp.zeros((1, LT, LK), jnp.int32),
            jnp.ones((1, LT, LK), jnp.float32), jnp.ones((1, LL, 2 * LI, LH), jnp.bfloat16))
    text = smap(mesh, layer).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [a for t, a in custom_calls(text) if t == "jax_ep_expert_positions"]
    served = LL <= experts
    assert len(calls) == int(served), calls
    assert ("stablehlo.sort" in text) != served
    if served:
        assert int_attr(calls[0], "num_experts") == LL
        assert int_attr(calls[0], "alignment") == 128
        blocks = -(-LT * LK // _LayerTable.position_slice_pairs)
        results = re.findall(r"tensor<[^>]*>", calls[0][calls[0].rindex(") -> "):])
        assert results[-1] == f"tensor<{blocks}x{LL}xi32>", results


@pytest.mark.parametrize("ranks, grad", [(1, False), (1, True), (2, False), (2, True)])
def test_fused_forward_alone_leaves_h_unwritten(cuda_lowering, monkeypatch, mesh2, ranks, grad):
    """The layer's forward alone does not write the first GEMM's h (write_h=0, h [0, 2I]): only
    its backward reads h, and the activation epilogue writes what the second half reads. With a
    gradient the kernel writes h for the backward (write_h=1, [C, 2I])."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    mesh = mesh2 if ranks == 2 else Mesh(np.array(jax.devices()[:1]), ("ep",))
    wgu = jnp.ones((LL, LH, 4 * LI), jnp.bfloat16)    # 2I = 256: the epilogue's activation

    def layer(x, idx, w, wd):
        def f(x):
            y = jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=ranks * LL, backend="cuda")
            return jnp.sum(y.astype(jnp.float32))
        return jax.grad(f)(x) if grad else f(x)
    args = (jnp.ones((ranks, LT, LH), jnp.bfloat16), jnp.zeros((ranks, LT, LK), jnp.int32),
            jnp.ones((ranks, LT, LK), jnp.float32),
            jnp.ones((ranks, LL, 2 * LI, LH), jnp.bfloat16))
    text = smap(mesh, layer).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = {t for t, _ in custom_calls(text)}
    # one rank routes in XLA ops: no dispatch launch
    assert ("jax_ep_ht_dispatch" in targets) == (ranks > 1), targets
    calls = [a for t, a in custom_calls(text) if t == "jax_ep_ht_gather_gemm"]
    (gg,) = [c for c in calls if int_attr(c, "w_k_major") == 0]   # (the backward's is 1)
    assert int_attr(gg, "activation") == 1
    assert int_attr(gg, "write_h") == int(grad)
    results = re.findall(r"tensor<[^>]*>", gg[gg.rindex(") -> "):])
    C = int(re.match(r"tensor<(\d+)x", results[0]).group(1))
    assert results[1] == f"tensor<{C if grad else 0}x{4 * LI}xbf16>", results
    assert results[2] == f"tensor<{C}x{2 * LI}xbf16>", results


def test_extra_passes_take_the_fewest_rows(cuda_lowering, monkeypatch, mesh2):
    """A first pass of `capacity` rows that a routing can overflow: the loop's passes take a
    quarter of a rank's expected pairs plus the alignment, fewer rows than R * T tokens (each
    sends only the pairs it keeps), not `capacity`, forward and backward (the buffers XLA
    plans for the loop stay small)."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    T, cap = 256, 900
    extra = T * LK // 4 + LL * 127      # (T * K / 4 is a multiple of 8 here)
    assert extra < 2 * T
    wgu = jnp.ones((LL, LH, 2 * LI), jnp.bfloat16)

    def loss(x, w, wd):
        idx = jnp.zeros((T, LK), jnp.int32).at[:, 1].set(1)
        y = jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, capacity=cap,
                           backend="cuda")
        return jnp.sum(y.astype(jnp.float32))

    def step(x, w, wd):
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, wd)
    args = (jnp.ones((2, T, LH), jnp.bfloat16), jnp.ones((2, T, LK), jnp.float32),
            jnp.ones((2, LL, LI, LH), jnp.bfloat16))
    text = smap(mesh2, step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in text
    rows = [int(re.match(r"tensor<(\d+)x", operand_types(a)[1]).group(1))
            for t, a in custom_calls(text) if t == "jax_ep_ht_gather_gemm"]
    assert set(rows) == {cap, extra}, rows


def _float32_converts(jaxpr, shape):
    """[(inside a while loop, source dtype)] of every float32 conversion of a `shape` array in
    `jaxpr` and the jaxprs it calls (custom rules and shard_map bodies included)."""
    def wanted(eqn):
        return (eqn.primitive.name == "convert_element_type"
                and eqn.invars[0].aval.shape == shape
                and eqn.outvars[0].aval.dtype == jnp.float32)
    return [(inside, eqn.invars[0].aval.dtype) for inside, eqn in eqns_by_loop(jaxpr, wanted)]


_PASSES_T = 256


def _layer_with_passes_jaxpr(monkeypatch, mesh2, fused):
    """The jaxpr of moe_ffn's forward (CUDA backend, over 2 ranks of _PASSES_T tokens) at a
    capacity under the worst case, so that a routing could overflow its first pass."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    T, cap = _PASSES_T, 900
    wgu = jnp.ones((LL, LH, 2 * LI), jnp.bfloat16)

    def layer(x, idx, w, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, capacity=cap,
                              fused=fused, backend="cuda")
    args = (jnp.ones((2, T, LH), jnp.bfloat16), jnp.zeros((2, T, LK), jnp.int32),
            jnp.ones((2, T, LK), jnp.float32), jnp.ones((2, LL, LI, LH), jnp.bfloat16))
    return jax.make_jaxpr(smap(mesh2, layer))(*args).jaxpr


@pytest.mark.parametrize("fused", [False, True])
def test_extra_passes_sum_in_float32_only_inside_their_loop(cuda_lowering, monkeypatch, mesh2,
                                                            fused):
    """Where a routing can overflow the first pass, the layer's output goes to float32 (the sum
    of the passes) only inside a loop that runs when a pair is left: a routing that fits the
    first pass passes no [T, H] array over to float32 and back."""
    jaxpr = _layer_with_passes_jaxpr(monkeypatch, mesh2, fused)
    found = _float32_converts(jaxpr, (_PASSES_T, LH))
    assert (True, jnp.bfloat16) in found, found          # the sum, inside the loop
    assert not [f for f in found if not f[0]], found


def test_fused_extra_passes_run_between_the_halves_into_the_output(cuda_lowering, monkeypatch,
                                                                   mesh2):
    """Where a routing can overflow the first pass, the fused layer runs the passes after it in
    a loop between the first pass's gather + GEMM and its GEMM + combine, which adds their sum
    in its output's buffer (an operand-output alias): XLA's host read of the loop's predicate
    then drains the stream before a long kernel, not before the next call's short ones. The
    loop's first value is written by no kernel (no fill when it runs no pass;
    docs/design.md#layer-passes-early)."""
    jaxpr = _layer_with_passes_jaxpr(monkeypatch, mesh2, True)
    kinds = ("jax_ep_ht_gather_gemm", "jax_ep_unwritten", "jax_ep_ht_gemm_combine")

    def wanted(eqn):
        return eqn.primitive.name == "while" or (eqn.primitive.name == "jax_ep_call"
                                                  and eqn.params["target"] in kinds)
    first = [eqn for inside, eqn in eqns_by_loop(jaxpr, wanted) if not inside]
    assert [e.params.get("target", "while") for e in first] == [
        "jax_ep_ht_gather_gemm", "jax_ep_unwritten", "while", "jax_ep_ht_gemm_combine"], first
    assert first[-1].params["aliases"] == ((6, 1),)          # the sum, into the output


@pytest.mark.parametrize("capacity", [None, 16 + 127], ids=["one_pass", "extra_passes"])
def test_fused_moe_gradients_trace_under_check_vma(cuda_lowering, monkeypatch, mesh2,
                                                   capacity):
    """moe_ffn(fused=True)'s gradients in x, the routing weights and both expert matrices
    trace inside shard_map with its default check_vma, in one pass and with extra passes (the
    routing dispatch's zero-width rows carry the varying type its backward gives them)."""
    text = _moe_gradients_lowered(monkeypatch, lambda f: smap(mesh2, f), (0, 2, 3, 4),
                                  (2, LT), (2, LL), capacity=capacity, fused=True)
    assert ("stablehlo.while" in text) == (capacity is not None)
    assert any(t == "jax_ep_ht_gather_gemm" for t, _ in custom_calls(text))


@pytest.mark.parametrize("fused", [False, True])
def test_moe_extra_passes_backward_adds_weight_gradients_in_place(cuda_lowering, monkeypatch,
                                                                   mesh2, fused):
    """moe_ffn with a capacity that may need extra passes: the backward's loop over them adds
    the weight gradients in place, fused or not (aliased accumulating weight-gradient calls,
    one per weight; on the fused path each also reduces over the segments' rows only)."""
    # R * T = 16 rows, the fused alignment's padding before the last segment included: below
    # the worst case's 32 pairs, so the layer has a loop of extra passes
    text = _moe_gradients_lowered(monkeypatch, lambda f: smap(mesh2, f), (3, 4), (2, LT),
                                  (2, LL), capacity=16 + (LL - 1) * 127 * fused, fused=fused)
    assert "stablehlo.while" in text
    acc = [c for t, c in custom_calls(text)
           if t == "jax_ep_grouped_gemm" and attr(c, "accumulate") == "true"]
    assert len(acc) == 2, acc                           # d w_gate_up and d w_down
    assert text.count("output_operand_alias<output_tuple_indices = [0], "
                      "operand_index = 6") == 2
    # the fused path's weight gradients skip the alignment padding: a [L] row_counts operand
    row_counts = [operand_types(c)[5] for c in acc]
    assert row_counts == [f"tensor<{LL if fused else 0}xi32>"] * 2, row_counts


@pytest.mark.parametrize("kw", [dict(capacity=16, fused=False), dict(fused=True, capacity=16 + 127),
                                dict(mode="low_latency")],
                         ids=["unfused", "fused", "low_latency"])
def test_moe_gradients_with_weights_replicated_over_data_parallel(cuda_lowering, monkeypatch,
                                                                 mesh_dp_ep, kw):
    """A (dp, ep) mesh with the experts sharded over ep and replicated over dp (the usual
    layout): the gradients of moe_ffn on the CUDA backend trace under shard_map's default
    check_vma (the weights' summed over dp), the extra passes' loop included."""
    R, S = mesh_dp_ep.shape["ep"], 4
    assert R == 2
    sp, ep = P(("dp", "ep")), P("ep")
    wrap = lambda f: jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh_dp_ep, in_specs=(sp, sp, sp, ep, ep), out_specs=(sp, sp, ep, ep)))
    text = _moe_gradients_lowered(monkeypatch, wrap, (0, 2, 3, 4), (S * LT,), (R * LL,), **kw)
    if kw.get("mode") != "low_latency":
        assert "stablehlo.while" in text      # R * T rows a pass: a loop of extra passes


@pytest.mark.parametrize("setting", ["", "0"], ids=["default", "JAX_EP_FUSED_BACKWARD=0"])
@pytest.mark.parametrize("inter", [LI, 128], ids=["activation_after", "activation_epilogue"])
def test_fused_halves_backward_lowers_to_the_fused_kernels(cuda_lowering, monkeypatch,
                                                           mesh_dp_ep, inter, setting):
    """A training step of the fused halves (dispatch_matmul_swiglu, matmul_combine) lowers to
    each fused kernel twice, the backward's reading the weights transposed (w_k_major = 1,
    docs/kernels.md#fused-backward), with no gather of the output's cotangent and one combine
    (the routing weights' cotangent); with JAX_EP_FUSED_BACKWARD=0, to each once and the
    unfused backward's gather and combines. On a (dp, ep) mesh with the weights replicated over
    dp, the halves' gradients trace under shard_map's check_vma (the weights' summed over dp)."""
    from jax_ep import fused
    monkeypatch.setenv("JAX_EP_FUSED_BACKWARD", setting)
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)
    R, S = mesh_dp_ep.shape["ep"], 4

    def step(x, idx, w, wgu, wd):
        def loss(x, w, wgu, wd):
            res, a = fused.dispatch_matmul_swiglu(x, idx, w, wgu, num_experts=R * LL,
                                                  backend="cuda")
            return jnp.sum(fused.matmul_combine(a, wd, res, backend="cuda").astype(jnp.float32))
        v, g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
        return v[None], g
    sp, ep = P(("dp", "ep")), P("ep")
    f = jax.jit(jax.shard_map(step, mesh=mesh_dp_ep, in_specs=(sp, sp, sp, ep, ep),
                              out_specs=(sp, (sp, sp, ep, ep))))
    args = (jnp.ones((S * LT, LH), jnp.bfloat16), jnp.zeros((S * LT, LK), jnp.int32),
            jnp.ones((S * LT, LK), jnp.bfloat16), jnp.ones((R * LL, LH, 2 * inter), jnp.bfloat16),
            jnp.ones((R * LL, inter, LH), jnp.bfloat16))
    calls = custom_calls(f.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    targets = [t for t, _ in calls]
    fused_bwd = setting != "0"
    for kernel in ("jax_ep_ht_gather_gemm", "jax_ep_ht_gemm_combine"):
        assert ([int_attr(c, "w_k_major") for t, c in calls if t == kernel]
                == ([0, 1] if fused_bwd else [0])), targets
    assert targets.count("jax_ep_ht_gather") == (0 if fused_bwd else 1), targets
    assert targets.count("jax_ep_ht_combine") == (1 if fused_bwd else 2), targets
    epilogue = [int_attr(c, "activation") for t, c in calls if t == "jax_ep_ht_gather_gemm"]
    assert epilogue == [int(inter == 128)] + [0] * fused_bwd, epilogue


@pytest.mark.parametrize("inter", [LI, 128], ids=["activation_after", "activation_epilogue"])
@pytest.mark.parametrize("capacity", [None, 16 + 127], ids=["one_pass", "extra_passes"])
def test_fused_moe_remat_policy_replays_no_kernel(cuda_lowering, monkeypatch, mesh2, capacity,
                                                  inter):
    """jax.checkpoint(moe_ffn(fused=True), policy=jax_ep.remat_policy): a training step lowers
    to the same custom calls as without it (the forward's communicating kernels saved, the
    backward's own), where plain jax.checkpoint replays the forward's."""
    monkeypatch.setattr(jax_ep.runtime, "extension", lambda: _LayerTable)
    monkeypatch.setattr(jax_ep.runtime, "current_cuda_device", lambda: 0)

    def calls(policy):
        def layer(x, idx, w, wgu, wd):
            return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=2 * LL, backend="cuda",
                                  capacity=capacity, fused=True)
        f = layer if policy is False else jax.checkpoint(layer, policy=policy)

        def step(x, idx, w, wgu, wd):
            def loss(x, w, wgu, wd):
                return jnp.sum(f(x, idx, w, wgu, wd).astype(jnp.float32))
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
        args = (jnp.ones((2, LT, LH), jnp.bfloat16), jnp.zeros((2, LT, LK), jnp.int32),
                jnp.ones((2, LT, LK), jnp.bfloat16),
                jnp.ones((2, LL, LH, 2 * inter), jnp.bfloat16),
                jnp.ones((2, LL, inter, LH), jnp.bfloat16))
        text = smap(mesh2, step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # (the kernels that communicate: GEMMs and the layout's positions are computation the
        # policy recomputes)
        return sorted(t for t, _ in custom_calls(text)
                      if t not in ("jax_ep_grouped_gemm", "jax_ep_expert_positions"))
    plain, replayed, saved = calls(False), calls(None), calls(jax_ep.remat_policy)
    assert saved == plain, (saved, plain)
    assert len(replayed) > len(plain), (replayed, plain)
    assert plain.count("jax_ep_ht_gather_gemm") >= 2, plain
