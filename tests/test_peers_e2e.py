"""Each peer's data and reward files, as shipped: `vlmrl check` names the layout and passes, then 2 GRPO steps train."""

import json
from pathlib import Path

import pytest

import peer_files
from vlmrl.cli import main

pytestmark = pytest.mark.integration
PEERS = Path(__file__).parent / "peers"


def peer_case(name, tmp):
    """(data path, layout the check must name, extra overrides) of one peer, its rewards written its own way."""
    if name == "trl":
        return peer_files.trl_conversational(tmp), "trl conversational", [f"algorithm.reward_funcs=[accuracy, '{PEERS}/trl_rewards.py:think_length']"]
    if name == "vlm-r1":
        data, images = peer_files.vlm_r1(tmp)
        rewards = f"['{PEERS}/vlmr1_rewards.py:accuracy_reward', '{PEERS}/vlmr1_rewards.py:format_reward', '{PEERS}/vlmr1_rewards.py:grid_reward']"
        return data, "vlm-r1 conversations", [f"data.image_root={images}", f"algorithm.reward_funcs={rewards}"]
    if name == "easyr1":
        template = tmp / "format_prompt.jinja"
        template.write_text("{{ content | trim }} Put the final answer in <answer> </answer>.\n")
        rewards = f"algorithm.reward_funcs=['{PEERS}/easyr1_math.py:compute_score']"
        return peer_files.easyr1(tmp / "data"), "easyr1", [f"data.prompt_template={template}", rewards]
    if name == "ms-swift":
        return peer_files.ms_swift(tmp), "messages", [f"algorithm.reward_funcs=['{PEERS}/swift_plugin.py:external_count_acc', format]"]
    if name == "llava-instruct":
        extra = [f"data.image_root={tmp / 'images'}", "algorithm.reward_funcs=[accuracy]"]
        return peer_files.llava_instruct(tmp), "llava-instruct conversations", extra
    return peer_files.imagefolder(tmp / "imgs"), "imagefolder (vlmrl columns)", ["algorithm.reward_funcs=[accuracy]"]


@pytest.mark.parametrize("peer", ["trl", "vlm-r1", "easyr1", "ms-swift", "llava-instruct", "imagefolder"])
def test_check_then_two_grpo_steps(peer, tiny_qwen25vl, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    data, layout, extra = peer_case(peer, tmp_path)
    out = tmp_path / "run"
    args = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={data}",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=2",
        "rollout.max_completion_length=4",
        "training.device=cpu",
        "training.save_final_model=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        *extra,
    ]
    assert main(["check", *args]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"format {layout}: 4 of 4 rows kept, 4 images" in err, err
    assert "reward " in err
    assert main(["train", *args]) == 0, capsys.readouterr().err
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
