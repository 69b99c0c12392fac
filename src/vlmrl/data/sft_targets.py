"""The text SFT trains the model to produce for a row (also the answer evaluation samples show)."""

from __future__ import annotations


def sft_target(row: dict) -> str:
    """The text the model learns to produce (SFT's target, the answer evaluation samples show next to the model's):
    the row's `response`, else `<answer>solution</answer>` (the solution itself when it already has answer tags, as
    VLM-R1's and ms-swift's do)."""
    if row.get("response"):
        return row["response"]
    solution = str(row["solution"])
    return solution if "<answer>" in solution else f"<answer>{solution}</answer>"
