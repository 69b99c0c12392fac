"""`vlmrl convert` on each peer's published example config: a vlmrl YAML the config loader and `check` accept, and
every key without an equivalent listed with why."""

from pathlib import Path

import pytest
import yaml

import peer_files
from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.run.convert import convert, parse_arguments, script_arguments

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).parent / "peers" / "configs"
EXAMPLES = {
    "trl": "trl_grpo_vlm.sh",
    "easyr1": "easyr1_config.yaml",
    "ms-swift": "ms_swift_grpo_multimodal.sh",
    "vlm-r1": "vlm_r1_run_grpo_rec.sh",
}


def test_script_arguments_fill_variables_and_lists():
    words = script_arguments('name="m"\nX=1 cmd \\\n  --model $name --funcs a b --flag --dtype "bf16"\n')
    assert parse_arguments(words) == {"model": "m", "funcs": ["a", "b"], "flag": True, "dtype": "bf16"}


def test_trl_example():
    result = convert("trl", [str(CONFIGS / EXAMPLES["trl"])])
    s = result.settings
    assert s["model.name_or_path"] == "Qwen/Qwen2.5-VL-3B-Instruct" and s["model.use_lora"] is True and s["model.dtype"] == "bfloat16"
    assert s["model.lora_target_modules"] == ["q_proj", "v_proj"] and s["data.max_prompt_length"] == 2048
    assert s["logging.log_completions"] is True and s["optim.learning_rate"] == 1e-5
    assert "vLLM" in result.unmapped["use_vllm"] and "vLLM" in result.unmapped["vllm_mode"] and "accelerate" in result.unmapped["config_file"]


def test_easyr1_example():
    result = convert("easyr1", [str(CONFIGS / EXAMPLES["easyr1"])])
    s = result.settings
    assert s["data.train_path"] == "hiyouga/math12k::train" and s["data.prompt_template"] == "./examples/format_prompt/math.jinja"
    assert s["algorithm.reward_funcs"] == ["./examples/reward_function/math.py:compute_score"]
    assert s["algorithm.beta"] == 0.01 and s["rollout.num_generations"] == 5 and s["rollout.generation_batch_size"] == 2560
    assert s["training.num_train_epochs"] == 15 and s["logging.report_to"] == ["wandb"] and "training.max_steps" not in s
    assert "vLLM" in result.unmapped["worker.rollout.gpu_memory_utilization"]
    assert "accelerate" in result.unmapped["worker.actor.fsdp.enable_full_shard"]


def test_ms_swift_example():
    result = convert("ms-swift", [str(CONFIGS / EXAMPLES["ms-swift"])])
    s = result.settings
    assert s["algorithm.reward_funcs"] == ["examples/train/grpo/plugin/plugin.py:external_r1v_acc", "format"]
    assert s["model.use_lora"] is False and s["algorithm.num_iterations"] == 2 and s["rollout.num_generations"] == 8
    assert "prompt.txt is not here" in result.unmapped["system"] and "ZeRO" in result.unmapped["deepspeed"]


def test_vlm_r1_example():
    result = convert("vlm-r1", [str(CONFIGS / EXAMPLES["vlm-r1"])])
    s = result.settings
    assert s["data.train_path"] == "/data/vlm-r1/refcoco_train.jsonl" and s["data.image_root"] == "/data/coco"
    assert s["training.bf16"] is True and s["algorithm.beta"] == 0.04 and s["training.num_train_epochs"] == 2
    assert "concatenate" in result.unmapped["data_file_paths"] and "accuracy_reward" in result.unmapped["reward_funcs"]
    assert result.unmapped["nproc_per_node"].startswith("processes and nodes")


@pytest.mark.parametrize("peer", list(EXAMPLES))
def test_cli_writes_yaml_that_loads_and_lists_unmapped(peer, tmp_path, capsys):
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", peer, "-o", str(out), str(CONFIGS / EXAMPLES[peer])]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and "keys have no vlmrl equivalent" in err
    assert isinstance(yaml.safe_load(out.read_text()), dict)
    load_config(out)  # a valid vlmrl config as written
    assert main(["convert", "--from", peer, "-o", str(out), str(CONFIGS / EXAMPLES[peer])]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


@pytest.mark.integration
def test_converted_easyr1_config_passes_check(tiny_qwen25vl, tmp_path, capsys):
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "easyr1", "-o", str(out), str(CONFIGS / EXAMPLES["easyr1"])]) == 0
    template = tmp_path / "math.jinja"
    template.write_text("{{ content | trim }} Put the answer in <answer></answer>.")
    local = [  # what lives on the hub or in EasyR1's checkout, given here as local files
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={peer_files.easyr1(tmp_path / 'data')}",
        "data.eval_path=''",
        f"data.prompt_template={template}",
        f"algorithm.reward_funcs=['{CONFIGS.parent / 'easyr1_math.py'}:compute_score']",
        "logging.report_to=none",
        f"training.output_dir={tmp_path / 'run'}",
        "training.device=cpu",
    ]
    assert main(["check", str(out), *local]) in (0, 1), capsys.readouterr().err  # 1: the planner says a 2560-completion step does not fit
    err = capsys.readouterr().err
    assert "format easyr1" in err and "reward compute_score (EasyR1 compute_score)" in err
