"""Shape buckets for CUDA-graph replays: calls are padded up to a few sizes, so a handful of graphs serves any
batch (padded rows and frames are masked, hence exact on the real ones)."""

from __future__ import annotations


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, then multiples of 8."""
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
