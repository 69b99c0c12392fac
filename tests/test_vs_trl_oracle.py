"""The in-repo oracle: TRL 1.16's own GRPOTrainer code against vlmrl on injected tensors, for every setting both
support (loss types x reward scalings x KL, clipping variants, GSPO / CISPO / SAPO, several micro-batches, rollouts
feeding two optimizer steps). Skipped when TRL is not installed: it is the `bench` extra (pip install -e .[bench]).
The table of the same comparison: `python benchmarks/trl_oracle.py` (benchmarks/results/trl_oracle_cpu_*.md)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed: pip install -e .[bench] (trl==1.16.0)")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import trl_oracle  # noqa: E402 (benchmarks/ on the path first)

pytestmark = pytest.mark.unit
SETTINGS = trl_oracle.settings()


def test_trl_is_the_pinned_version():
    import trl

    assert trl.__version__ == "1.16.0", "the oracle reads TRL 1.16.0's source; pip install trl==1.16.0"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.claimed_same], ids=lambda s: s.name)
def test_vlmrl_equals_trl(setting):
    result = trl_oracle.compare(setting)
    assert max(result["advantages"], result["loss"], result["grad"]) <= 1e-6, result


@pytest.mark.parametrize("setting", [s for s in SETTINGS if not s.claimed_same], ids=lambda s: s.name)
def test_known_differences_are_seen(setting):
    """The oracle is able to fail: the differences docs/vs_trl.md lists show up as such."""
    result = trl_oracle.compare(setting)
    assert result["advantages"] <= 1e-6 and result["grad"] > 1e-3, result


def test_the_batches_leave_the_clip_range():
    """About half of the tokens' ratios are outside [0.8, 1.2]: the clipped branches are exercised."""
    assert 0.3 < trl_oracle.compare(SETTINGS[0])["clipped_tokens"] < 0.8
