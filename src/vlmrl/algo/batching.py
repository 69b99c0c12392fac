"""Cutting rows into micro-batches: a fixed row count, or a token budget (like verl's dynamic batch size)."""

from __future__ import annotations


def split_by_rows(rows: list[int], size: int) -> list[list[int]]:
    """Consecutive chunks of `size` rows."""
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def pack_by_tokens(rows: list[int], lengths: list[int], budget: int, prompt_len: int = 0) -> list[list[int]]:
    """Micro-batches whose padded size, rows x (prompt_len + longest completion), stays within `budget` tokens.

    rows: row ids; lengths: their completion lengths (same order). Rows are taken longest first, so similar
    lengths share a micro-batch and little padding is computed. A row that alone exceeds the budget gets a
    micro-batch of its own. Every row appears exactly once.
    """
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        if current and (len(current) + 1) * (prompt_len + max(longest, lengths[i])) > budget:
            out.append(current)
            current, longest = [], 0
        current.append(rows[i])
        longest = max(longest, lengths[i])
    if current:
        out.append(current)
    return out
