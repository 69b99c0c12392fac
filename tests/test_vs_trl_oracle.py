"""The in-repo oracle: TRL 1.16's own GRPOTrainer code against vlmrl on injected tensors, for every setting both
support (loss types x reward scalings x KL, clipping variants, GSPO / CISPO / SAPO, several micro-batches, rollouts
feeding two optimizer steps), and GSPO with everything it meets (docs/vs_trl.md, "GSPO": issue 35, findings 8 and 9).
Skipped when TRL is not installed: it is the `bench` extra (pip install -e .[bench]).
The table of the same comparison: `python benchmarks/trl_oracle.py` (benchmarks/results/trl_oracle_cpu_*.md)."""

import re
import sys
from pathlib import Path

import pytest
import torch

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


GSPO = [s for s in SETTINGS if s.gspo]


def _gspo(name: str):
    return next(s for s in GSPO if s.name == f"gspo {name}")


def test_gspo_weights_vary_within_rows():
    """Findings 8 and 9 show only where a row's per-token weights differ: in the GSPO cases' own batches the token
    modes' weights and the entropy masks differ within some row, every mode's bounds act on some token or row, and
    delta caps a row with A < 0."""
    for mode in trl_oracle.ROLLOUT_CORRECTIONS:
        setting = _gspo(f"rollout_correction={mode}")
        batch, algo = trl_oracle.batch_for(setting), trl_oracle.vlmrl_config(setting).algorithm
        mask = batch.mask.bool()
        w = trl_oracle.ROLLOUT_CORRECTIONS[mode](batch.old, batch.sampling, batch.mask, algo.rollout_correction_min, algo.rollout_correction_max)
        log_raw = (batch.old - batch.sampling) * batch.mask
        raw = torch.exp(log_raw if mode.startswith("token") else log_raw.sum(1, keepdim=True).expand_as(w))
        assert (w != raw)[mask].any(), mode  # the bounds act
        if mode.startswith("token"):
            assert any(len(set(w[i][mask[i]].tolist())) > 1 for i in range(len(w))), mode
    for name in ("top_entropy_quantile=0.2", "dapo top_entropy_quantile=0.5 beta=0.04"):
        setting = _gspo(name)
        batch, q = trl_oracle.batch_for(setting), setting.trl["top_entropy_quantile"]
        keep, mask = trl_oracle.entropy_quantile_mask(batch.entropies, batch.mask, q), batch.mask.bool()
        assert any(0 < keep[i][mask[i]].sum() < mask[i].sum() for i in range(len(keep))), name
    for name in ("delta=1.02", "all at once: token_truncate, top_entropy_quantile=0.5, use_bias_correction_kl, dapo, delta=1.02"):
        setting = _gspo(name)
        batch = trl_oracle.batch_for(setting)
        s = torch.exp(((batch.current[0] - batch.old) * batch.mask).sum(1) / batch.mask.sum(1))
        adv = trl_oracle.trl_advantages(batch.rewards, trl_oracle.G, "group")
        assert ((s > setting.trl["delta"]) & (adv < 0)).any(), name


def test_docs_list_every_gspo_interaction():
    """docs/vs_trl.md's GSPO table names every GSPO case of the oracle, and says which ones differ."""
    page = (Path(__file__).parents[1] / "docs" / "vs_trl.md").read_text()
    table = page[page.index("### GSPO") :]
    for setting in GSPO:
        assert f"`{setting.name}`" in table, setting.name
        row = next(line for line in table.splitlines() if f"`{setting.name}`" in line)
        assert bool(re.search(r"\bdiffers\b", row)) != setting.claimed_same, row
