"""`vlmrl check`'s hints when a reward raises, met as an unlucky user meets them: a peer's reward on rows of another
layout, or a function vlmrl does not recognise as a peer's. Each hint points at the real cause, never the wrong way
(issue 24: a VLM-R1 reward with conversational completions was told to set completion_format=text, and an EasyR1
compute_score was told about factories)."""

from pathlib import Path

import pytest

import peer_files
from vlmrl.cli import main

pytestmark = pytest.mark.unit
PEERS = Path(__file__).parent / "peers"


def check(tmp_path, capsys, data, rewards, *extra):
    args = ["model.name_or_path=embedded:tiny-qwen2.5-vl", "training.device=cpu", f"training.output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    rc = main(["check", *args, "logging.report_to=none", f"data.train_path={data}", f"algorithm.reward_funcs={rewards}", *extra])
    return rc, capsys.readouterr().err


def test_vlm_r1_accuracy_on_trl_rows_names_the_columns_it_reads(tmp_path, capsys, monkeypatch):
    """VLM-R1's accuracy reward reads accu_reward_method / image_path, which its loader adds; on TRL conversational rows
    they are absent and the completions are already conversational: the hint names the columns, not completion_format."""
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    rc, err = check(tmp_path, capsys, peer_files.trl_conversational(tmp_path / "d"), f"['{PEERS}/vlmr1_rewards.py:accuracy_reward']")
    assert rc == 2 and "'NoneType' object is not iterable" in err, err
    assert "completions (conversational)" not in err and "completion_format" not in err, err
    assert "reads accu_reward_method, image_path from **kwargs, which these rows do not have" in err, err


def test_vlm_r1_grid_reward_on_swift_rows_names_image_grid_thw(tmp_path, capsys, monkeypatch):
    """VLM-R1's IoU-style reward indexes image_grid_thw per sample; ms-swift messages rows have none."""
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    rc, err = check(tmp_path, capsys, peer_files.ms_swift(tmp_path / "d"), f"['{PEERS}/vlmr1_rewards.py:grid_reward']")
    assert rc == 2 and "'NoneType' object is not subscriptable" in err and "completion_format" not in err, err
    assert "reads image_grid_thw, image_path from **kwargs" in err and "(it gets: messages, images, solution" in err, err


def test_easyr1_compute_score_not_detected_is_told_easyr1_first(tmp_path, capsys, monkeypatch):
    """An EasyR1 batch reward whose parameter is not named reward_inputs is not detected, so it is called TRL's way;
    the hint leads with EasyR1's spec (not factories), and following it passes."""
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    reward = tmp_path / "math_reward.py"
    reward.write_text("def compute_score(inputs, format_weight=0.1):\n    return [{'overall': float('1' in x['response'])} for x in inputs]\n")
    data = peer_files.easyr1(tmp_path / "d")
    rc, err = check(tmp_path, capsys, data, f"['{reward}:compute_score']")
    assert rc == 2 and "unexpected keyword argument 'prompts'" in err, err
    hint = err.split("unexpected keyword argument 'prompts'", 1)[1]
    assert hint.startswith("; an EasyR1 reward? name it file.py:compute_score@easyr1"), hint
    assert check(tmp_path, capsys, data, f"['{reward}:compute_score@easyr1']")[0] == 0


def test_factory_named_without_its_call_is_told_about_factories(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    reward = tmp_path / "length.py"
    reward.write_text("def soft_overlong(max_len=8):\n    return lambda completions, **kw: [0.0 for _ in completions]\n")
    rc, err = check(tmp_path, capsys, peer_files.trl_standard(tmp_path / "d"), f"['{reward}:soft_overlong']")
    assert rc == 2 and "unexpected keyword argument 'prompts'; if this function builds the reward (a factory" in err, err


def test_string_reward_on_conversational_completions_is_told_text(tmp_path, capsys, monkeypatch):
    """The one case completion_format=text is the answer: a reward calling string methods on a list of messages."""
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    reward = tmp_path / "strip.py"
    reward.write_text("def short(completions, **kw):\n    return [1.0 if len(c.strip()) < 99 else 0.0 for c in completions]\n")
    data = peer_files.trl_conversational(tmp_path / "d")
    rc, err = check(tmp_path, capsys, data, f"['{reward}:short']")
    assert rc == 2 and "'list' object has no attribute 'strip'" in err and "needs algorithm.completion_format=text" in err, err
    assert check(tmp_path, capsys, data, f"['{reward}:short']", "algorithm.completion_format=text")[0] == 0
