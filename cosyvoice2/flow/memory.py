"""The streaming flow's share of a GPU: rows per token2wav call and the live streams' flow-cache budget.

Two settings size what the streaming token2wav holds on its GPU (docs/deploy.md, "Resource needs"): the rows per
call, whose packed graphs share one key buffer of ~504 MiB a row at the released size (fixed at start), and the
budget of the live streams' flow caches (grown by traffic, ~115 MB per second of a stream's audio). The values
measured as best on 80 GB-class GPUs (32 rows, 32 GiB) do not fit a 24 or 48 GB GPU, so a setting the operator
leaves open is sized to the GPU's memory here, and one the operator gives is kept as given:

* rows: the most (a power of two, at most `PACKED_ROWS`) whose key buffer takes at most a quarter of the GPU:
  32 on 80 GB-class GPUs, 16 on 40-48 GB, 8 on 24 GB, 4 on 16 GB;
* flow caches: 55 % of what the key buffer leaves, at most 32 GiB: 32 on 80 GB-class GPUs, ~20 on 48 GB, ~10 on
  24 GB. The rest holds the LLM (weights, KV cache), the other weights, the graphs' pools and the allocator's slack.

A stream past the budget recomputes instead of caching (slower, the same audio); a call of more rows than the
graphs take never forms (the service caps its calls at the rows). CosyVoice3's token2wav sizes its flow-cache budget
by the same rule beside its step graphs' buffers, at most its own 16 GiB (`flow_cache_budget_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packed import PACKED_ROWS

GIB = 2**30
#: The share of the GPU's memory the packed graphs' key buffer may take when the rows are left to the GPU.
KEY_BUFFER_SHARE = 0.25
#: The share of what the key buffer leaves that the live streams' flow caches may take when their budget is left to
#: the GPU, and the most they take then (the budget measured on 80 GB-class GPUs).
FLOW_CACHE_SHARE = 0.55
FLOW_CACHE_MOST_GIB = 32.0


@dataclass(frozen=True)
class FlowMemoryPlan:
    """Rows per call and the flow caches' budget (None: no limit), and what they were sized from."""

    rows: int
    flow_cache_gib: float | None
    key_buffer_gib: float  # the packed graphs' key buffer at `rows`
    device_gib: float | None  # the GPU's memory, where the plan was sized to it

    def describe(self) -> str:
        cache = "no limit" if self.flow_cache_gib is None else f"up to {self.flow_cache_gib:.1f} GiB"
        source = f" (sized to {self.device_gib:.1f} GiB of GPU memory)" if self.device_gib is not None else ""
        return (f"{self.rows} rows per call ({self.key_buffer_gib:.1f} GiB of packed keys), flow caches "
                f"{cache}{source}")


def rows_for(device_bytes: int, row_bytes: int, most: int = PACKED_ROWS) -> int:
    """The most rows, a power of two up to `most`, whose key buffer takes at most `KEY_BUFFER_SHARE` of the GPU
    (at least one)."""
    rows = 1
    while rows * 2 <= most and rows * 2 * row_bytes <= KEY_BUFFER_SHARE * device_bytes:
        rows *= 2
    return rows


def flow_cache_gib_for(device_bytes: int, fixed_bytes: int, most: float = FLOW_CACHE_MOST_GIB) -> float:
    """The flow caches' budget a GPU gives them: `FLOW_CACHE_SHARE` of what the token2wav's fixed buffers (here the
    key buffer) leave, at most `most`."""
    return min(most, FLOW_CACHE_SHARE * max(0, device_bytes - fixed_bytes) / GIB)


def device_bytes(device: torch.device) -> int | None:
    """The GPU's memory as its driver reports it; None off a GPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def flow_cache_budget_bytes(device: torch.device, fixed_bytes: int, given_gib: float | None, most: float) -> int | None:
    """A flow-cache budget in bytes (None: no limit): `given_gib` as given (0: no limit), left open (None) sized to
    the GPU beside `fixed_bytes` of buffers (`flow_cache_gib_for`), `most` off a GPU."""
    return _budget_bytes(device_bytes(device), fixed_bytes, given_gib, most)


def _budget_bytes(total: int | None, fixed_bytes: int, given_gib: float | None, most: float) -> int | None:
    if given_gib is None:
        given_gib = most if total is None else flow_cache_gib_for(total, fixed_bytes, most)
    return int(given_gib * GIB) if given_gib else None


def plan_flow_memory(device: torch.device, row_bytes: int, rows: int | None = None,
                     flow_cache_gib: float | None = None) -> FlowMemoryPlan:
    """The plan for a flow on `device` whose key buffer takes `row_bytes` a row (`packed.key_bytes_per_row`):
    `rows` and `flow_cache_gib` as given (flow caches 0: no limit), what is left open sized to the GPU's memory.
    Off a GPU nothing is sized: `PACKED_ROWS` and `FLOW_CACHE_MOST_GIB`."""
    total = device_bytes(device)
    sized = total is not None and (rows is None or flow_cache_gib is None)
    if rows is None:
        rows = PACKED_ROWS if total is None else rows_for(total, row_bytes)
    key_buffer = rows * row_bytes
    budget = _budget_bytes(total, key_buffer, flow_cache_gib, FLOW_CACHE_MOST_GIB)
    return FlowMemoryPlan(rows, None if budget is None else budget / GIB, key_buffer / GIB,
                          total / GIB if sized else None)
