"""The settings registry (jax_ep/config.py) is the one place that reads JAX_EP_* settings."""
import pathlib
import re

import pytest

from jax_ep import config

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Variables the launcher passes to the processes it starts: plumbing, not settings.
LAUNCHER = {"JAX_EP_NUM_PROCESSES", "JAX_EP_PROCESS_ID"}


def _names(pattern, files):
    found = {}
    for f in files:
        for m in re.finditer(pattern, f.read_text()):
            found.setdefault(m.group(1), f.relative_to(ROOT))
    return found


def test_python_reads_settings_only_through_the_registry():
    files = [f for f in (ROOT / "jax_ep").glob("*.py") if f.name != "config.py"]
    direct = _names(r"environ(?:\.get\(|\[)\s*[\"'](JAX_EP_[A-Z_]+)", files)
    assert set(direct) <= LAUNCHER, f"read outside jax_ep/config.py: {direct}"
    used = _names(r"config\.\w+\(\s*[\"'](JAX_EP_[A-Z_]+)", files)
    assert set(used) <= set(config.SETTINGS), set(used) - set(config.SETTINGS)


def test_settings_the_extension_reads_are_registered():
    files = [f for f in (ROOT / "csrc").rglob("*") if f.suffix in (".cc", ".cu", ".cuh", ".h")]
    read = _names(r"getenv\(\s*\"(JAX_EP_[A-Z_]+)\"", files)
    assert set(read) <= set(config.SETTINGS), set(read) - set(config.SETTINGS)
    # kernel behaviour is a custom-call attribute, never read at run time
    assert not {"JAX_EP_LL_PREREDUCE", "JAX_EP_LL_DIAG"} & set(read)


def test_every_setting_is_described():
    table = config.describe()
    for s in config.SETTINGS.values():
        assert s.name in table and s.meaning and s.read
        assert config.raw(s.name) is not None


def test_bad_values_name_the_setting(monkeypatch):
    monkeypatch.setenv("JAX_EP_NUM_SMS", "lots")
    with pytest.raises(ValueError, match=r"JAX_EP_NUM_SMS='lots': expected an integer in \[1,"):
        config.int_in("JAX_EP_NUM_SMS", 1, 4096)
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match=r"JAX_EP_TIMEOUT_S='-1': expected a finite number"):
        config.seconds("JAX_EP_TIMEOUT_S")
    with pytest.raises(KeyError):
        config.raw("JAX_EP_NOT_A_SETTING")


def test_the_extension_owns_its_sizes_and_trace_marks():
    """Facts that cross the Python/C++ line come from the extension (one C++ definition)."""
    from jax_ep import runtime
    ext = runtime.extension()
    if ext is None:
        pytest.skip("the CUDA extension is not built")
    assert ext.ht_stage_bytes([]) == 256
    assert ext.ht_stage_bytes([1, 256, 257]) == 256 + 256 + 512
    assert set(ext.ht_staged_operands) == {"jax_ep_ht_dispatch", "jax_ep_ht_gather",
                                           "jax_ep_ht_combine", "jax_ep_ht_gather_gemm",
                                           "jax_ep_ht_gemm_combine"}
    # every pull target is registered and says what it stages in per-process mode (the fused
    # GEMM + combine runs in one process only: nothing)
    assert set(ext.ht_staged_operands) <= set(ext.registrations())
    assert ext.ht_staged_operands["jax_ep_ht_gemm_combine"] == 0
    assert ext.fused_block_rows % 64 == 0    # whole tiles of the fused GEMM
    rows = ext.fused_block_rows      # a counter per row block, then the queues' words
    words = ext.fused_counter_words(1) - 1
    assert words >= 4    # tiles, tasks, tokens done, tiles started
    assert [ext.fused_counter_words(c) for c in (1, rows, rows + 1)] == [words + 1, words + 1,
                                                                         words + 2]
    # the GEMM + combine's: a counter per row block and column chunk, the same words, then per
    # chunk one flag per few received rows (at least one, one per row at most, more rows never
    # fewer flags)
    chunk = ext.fused_chunk_blocks * ext.fused_block_columns   # columns of a chunk
    assert ext.fused_chunk_blocks >= 1 and ext.fused_block_columns % 64 == 0
    for n in (8, chunk, chunk + 8, 3 * chunk):
        chunks = -(-n // chunk)
        flags = [ext.fused_combine_counter_words(rows, cr, n) - ext.fused_counter_words(rows)
                 - (chunks - 1) for cr in (1, 2, 64, 65)]
        assert all(f % chunks == 0 for f in flags), (n, flags)
        flags = [f // chunks for f in flags]
        assert flags[0] == 1 and all(1 <= f <= cr for f, cr in zip(flags, (1, 2, 64, 65)))
        assert flags == sorted(flags) and flags[3] > 1
    assert ext.fused_combine_counter_words(2 * rows, 1, 8) == ext.fused_counter_words(2 * rows) + 1
    assert 1 <= ext.fused_max_dups <= 32     # a first row's copies: one per lane of its warp
    marks = ext.trace_marks
    assert marks[0] == "layout start" and len(marks) >= 20
    assert max(marks) < ext.trace_slots and max(ext.diag_marks) < ext.trace_slots
    # the fused GEMM + combine's own slot: its start, three marks per traced column chunk, the
    # tiles' end and the end barrier, each index once and within the slot
    fm, nc = ext.fused_trace_marks, ext.fused_traced_chunks
    assert len(fm) == 3 * nc + 3 and max(fm) < ext.trace_slots and min(fm) == 0
    assert sum("chunk" in v for v in fm.values()) == 3 * nc


def test_the_fused_combine_keeps_pace_with_its_gemm_at_one_rank():
    """The fused GEMM + combine's automatic combine-only blocks: an eighth of the SMs over
    several ranks; with one rank as many as keep pace with the GEMM, which spends k products
    on each value the combine reads back (k the GEMM's inner dimension): 8 of 132 SMs at the
    layer forward's k = I = 2048, half as many at twice that, an eighth at most, one at least."""
    from jax_ep import runtime
    ext = runtime.extension()
    if ext is None:
        pytest.skip("the CUDA extension is not built")
    blocks = ext.fused_auto_combine_blocks
    assert blocks(132, 2, 2048) == blocks(132, 4, 4096) == 16
    assert [blocks(132, 1, k) for k in (128, 1024, 2048, 4096, 7168, 1 << 20)] == [
        16, 16, 8, 4, 2, 1]
    assert blocks(33, 4, 2048) == 4 and blocks(4, 1, 2048) == 1 and blocks(4, 2, 8) == 1


def test_flags_take_0_or_1_and_name_the_setting(monkeypatch):
    monkeypatch.setenv("JAX_EP_LL_PREREDUCE", "off")
    with pytest.raises(ValueError, match=r"JAX_EP_LL_PREREDUCE='off': expected 0 or 1"):
        config.flag("JAX_EP_LL_PREREDUCE")
    for v, want in (("0", False), ("false", False), ("1", True), ("true", True), ("", True)):
        monkeypatch.setenv("JAX_EP_LL_PREREDUCE", v)   # "": unset, the default (1)
        assert config.flag("JAX_EP_LL_PREREDUCE") is want, v
