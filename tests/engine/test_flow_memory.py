"""The streaming flow's share of a GPU (cosyvoice2/flow/memory.py): rows per call and the flow caches' budget, as
given or sized to the GPU's memory, and the key buffer's size per row that the sizing reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.flow import memory
from cosyvoice2.flow.cached import CachedFlowRunner
from cosyvoice2.flow.memory import (FLOW_CACHE_MOST_GIB, GIB, KEY_BUFFER_SHARE, flow_cache_budget_bytes,
                                     plan_flow_memory, rows_for)
from cosyvoice2.flow.packed import PACKED_ROWS, PackedGraphs, key_bytes_per_row, packed_keys

MIB = 2**20


def test_the_key_buffer_per_row_is_what_the_graphs_allocate(tiny_engine) -> None:
    """`key_bytes_per_row` is the packed graphs' key buffer divided by its rows (less the one trash slot)."""
    runner = CachedFlowRunner(tiny_engine.token2wav_engine.flow, graphs=False)
    estimator = runner.flow.decoder.estimator
    for rows, dtype in ((3, torch.float32), (5, torch.bfloat16)):
        keys, _ = PackedGraphs(runner.solver, frames=(128,), rows=rows)._allocate(torch.device("cpu"), dtype)
        per_slot = keys.numel() * keys.element_size() // packed_keys(rows)
        assert keys.numel() * keys.element_size() == rows * key_bytes_per_row(estimator, dtype) + per_slot


def test_the_released_flow_takes_504_mib_of_keys_a_row_in_bf16() -> None:
    """The figure docs/deploy.md gives per row of --token2wav-rows, from the released configuration."""
    with torch.device("meta"):
        flow = CausalFlow(FlowConfig())
    assert key_bytes_per_row(flow.decoder.estimator, torch.bfloat16) == 504 * MIB


def fake_gpu(monkeypatch: pytest.MonkeyPatch, gib: float) -> torch.device:
    """A CUDA device whose driver reports `gib` of memory (nothing runs on it)."""
    monkeypatch.setattr(memory.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * GIB)))
    return torch.device("cuda", 1)


# the total memory drivers report for common GPUs (GiB), and the rows each gets
GPUS = {"H200": (139.8, 32), "H100 80GB": (79.2, 32), "L40S": (44.4, 16), "A100 40GB": (39.4, 16),
        "L4": (22.0, 8), "RTX 4090": (23.6, 8), "T4": (14.6, 4)}


@pytest.mark.parametrize("gpu", GPUS)
def test_open_settings_are_sized_to_the_gpu(monkeypatch, gpu) -> None:
    gib, rows = GPUS[gpu]
    row_bytes = 504 * MIB
    plan = plan_flow_memory(fake_gpu(monkeypatch, gib), row_bytes)
    assert plan.rows == rows and plan.device_gib == pytest.approx(gib)
    # the rows: the most whose keys take at most the share, doubling them would not
    assert plan.rows * row_bytes <= KEY_BUFFER_SHARE * gib * GIB < 2 * plan.rows * row_bytes or plan.rows == PACKED_ROWS
    assert plan.key_buffer_gib == pytest.approx(rows * row_bytes / GIB)
    # the flow caches: a part of what the keys leave, never more than the measured 32 GiB
    left = gib - plan.key_buffer_gib
    assert 0.4 * min(left, FLOW_CACHE_MOST_GIB) < plan.flow_cache_gib <= min(FLOW_CACHE_MOST_GIB, 0.6 * left)
    assert plan.key_buffer_gib + plan.flow_cache_gib < 0.7 * gib  # room for the LLM, the weights, the pools


def test_a_larger_gpu_never_gets_less(monkeypatch) -> None:
    plans = [plan_flow_memory(fake_gpu(monkeypatch, gib), 504 * MIB) for gib, _ in sorted(GPUS.values())]
    assert all(a.rows <= b.rows and a.flow_cache_gib <= b.flow_cache_gib for a, b in zip(plans, plans[1:]))


def test_80_gb_class_gpus_keep_the_measured_settings(monkeypatch) -> None:
    """Where the defaults were measured (H100 80GB, H200), sizing changes nothing: 32 rows, 32 GiB."""
    for gpu in ("H100 80GB", "H200"):
        plan = plan_flow_memory(fake_gpu(monkeypatch, GPUS[gpu][0]), 504 * MIB)
        assert (plan.rows, plan.flow_cache_gib) == (PACKED_ROWS, FLOW_CACHE_MOST_GIB)


def test_given_settings_are_kept_whatever_the_gpu(monkeypatch) -> None:
    device = fake_gpu(monkeypatch, 22.0)
    plan = plan_flow_memory(device, 504 * MIB, rows=32, flow_cache_gib=40.0)
    assert (plan.rows, plan.flow_cache_gib, plan.device_gib) == (32, 40.0, None)  # nothing sized: too large is theirs
    assert plan_flow_memory(device, 504 * MIB, flow_cache_gib=0.0).flow_cache_gib is None  # 0: no limit
    half = plan_flow_memory(device, 504 * MIB, rows=2)  # the budget sized to what the given rows leave
    assert half.rows == 2 and half.flow_cache_gib > plan_flow_memory(device, 504 * MIB).flow_cache_gib


def test_off_a_gpu_nothing_is_sized() -> None:
    plan = plan_flow_memory(torch.device("cpu"), 504 * MIB)
    assert (plan.rows, plan.flow_cache_gib, plan.device_gib) == (PACKED_ROWS, FLOW_CACHE_MOST_GIB, None)
    assert "sized" not in plan.describe() and f"{PACKED_ROWS} rows" in plan.describe()


def test_rows_are_powers_of_two_within_the_cap() -> None:
    for gib in (0.5, 3, 9, 17, 33, 70, 1000):
        rows = rows_for(int(gib * GIB), 504 * MIB, most=16)
        assert rows & (rows - 1) == 0 and 1 <= rows <= 16


def test_a_budget_beside_other_fixed_buffers(monkeypatch) -> None:
    """`flow_cache_budget_bytes`, as CosyVoice3 uses it beside its step graphs' buffers (~7.8 GiB) with 16 GiB at
    most: 16 on an 80 GB-class GPU, less where the GPU leaves less, given values kept (0: no limit)."""
    fixed = int(7.84 * GIB)
    assert flow_cache_budget_bytes(fake_gpu(monkeypatch, 79.2), fixed, None, 16.0) == 16 * GIB
    small = flow_cache_budget_bytes(fake_gpu(monkeypatch, 22.0), fixed, None, 16.0)
    assert 0.4 * (22.0 * GIB - fixed) < small < 0.6 * (22.0 * GIB - fixed)
    assert flow_cache_budget_bytes(fake_gpu(monkeypatch, 22.0), fixed, 20.0, 16.0) == 20 * GIB
    assert flow_cache_budget_bytes(fake_gpu(monkeypatch, 22.0), fixed, 0.0, 16.0) is None
    assert flow_cache_budget_bytes(torch.device("cpu"), fixed, None, 16.0) == 16 * GIB
