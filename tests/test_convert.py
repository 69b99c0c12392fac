"""`vlmrl convert` on each peer's published example config (tests/peers/configs, each naming its source): a vlmrl YAML
that `check` accepts, and every key without an equivalent listed with why."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import yaml

import peer_files
from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.run.convert import convert, launch_command, parse_arguments, script_arguments

pytestmark = pytest.mark.unit
PEERS = Path(__file__).parent / "peers"
CONFIGS = PEERS / "configs"
VLLM, ZERO, LAUNCH, NAMES = "vLLM", "accelerate", "processes and nodes", "environment variables"
ENV = "an environment variable of the launch"

# (peer, fixture, extra convert options) -> {unmapped key: a word its reason must hold}: exactly these keys are listed.
EXAMPLES = {
    ("trl", "trl_grpo_vlm.sh", ()): {"config_file": "accelerate launch line", "use_vllm": VLLM, "vllm_mode": VLLM},
    ("easyr1", "easyr1_config.yaml", ()): {
        "data.mini_rollout_batch_size": "generation_batch_size",
        "data.val_batch_size": "eval_batch_size",
        "data.override_chat_template": "chat template",
        "algorithm.filter_low": "group mean",
        "algorithm.filter_high": "group mean",
        "worker.actor.padding_free": ZERO,
        "worker.actor.dynamic_batching": ZERO,
        "worker.actor.ulysses_size": ZERO,
        "worker.actor.model.lora.target_modules": "all-linear",
        "worker.actor.model.lora.exclude_modules": "lora_vision",
        "worker.actor.optim.strategy": "AdamW",
        "worker.actor.fsdp.enable_full_shard": ZERO,
        "worker.actor.fsdp.enable_cpu_offload": ZERO,
        "worker.actor.fsdp.enable_rank0_init": ZERO,
        "worker.actor.offload.offload_params": ZERO,
        "worker.actor.offload.offload_optimizer": ZERO,
        "worker.rollout.limit_images": "data.limit_images",
        "worker.rollout.gpu_memory_utilization": VLLM,
        "worker.rollout.enforce_eager": VLLM,
        "worker.rollout.enable_chunked_prefill": VLLM,
        "worker.rollout.tensor_parallel_size": VLLM,
        "worker.rollout.disable_tqdm": VLLM,
        "worker.rollout.val_override_config.temperature": VLLM,
        "worker.rollout.val_override_config.top_p": VLLM,
        "worker.rollout.val_override_config.n": VLLM,
        "worker.ref.fsdp.enable_full_shard": ZERO,
        "worker.ref.fsdp.enable_cpu_offload": ZERO,
        "worker.ref.fsdp.enable_rank0_init": ZERO,
        "worker.ref.offload.offload_params": ZERO,
        "trainer.project_name": NAMES,
        "trainer.experiment_name": NAMES,
        "trainer.nnodes": "global",
        "trainer.n_gpus_per_node": "global",
        "trainer.val_only": "vlmrl eval",
        "trainer.val_generations_to_log": "log_completions",
        "trainer.load_checkpoint_path": "training.resume",
        "trainer.find_last_checkpoint": "training.resume",
    },
    ("ms-swift", "ms_swift_grpo_multimodal.sh", ()): {
        "reward_funcs (accuracy, format)": "built-ins",
        "system": "prompt.txt is not here",  # run from this repository; test_ms_swift_system_prompt_file_is_read_when_here
        "rlhf_type": "GRPO",
        "external_plugins": "algorithm.reward_funcs",
        "importance_sampling_level": "per token",
        "sleep_level": VLLM,
        "offload_model": VLLM,
        "offload_optimizer": VLLM,
        "CUDA_VISIBLE_DEVICES": ENV,
        "PYTORCH_CUDA_ALLOC_CONF": ENV,
        "use_vllm": VLLM,
        "vllm_mode": VLLM,
        "vllm_gpu_memory_utilization": VLLM,
        "vllm_tensor_parallel_size": VLLM,
        "vllm_max_model_len": VLLM,
        "vllm_enable_lora": VLLM,
        "async_generate": VLLM,
        "dataloader_num_workers": "threads",
        "deepspeed": ZERO,
        "report_to (swanlab)": "tensorboard, wandb, mlflow",
    },
    ("ms-swift", "ms_swift_grpo_vl7b.sh", ()): {
        "reward_funcs (accuracy, format)": "built-ins",
        "system": "prompt.txt is not here",  # run from this repository; test_ms_swift_system_prompt_file_is_read_when_here
        "rlhf_type": "GRPO",
        "load_from_cache_file": "read directly",
        "sleep_level": VLLM,
        "use_vllm": VLLM,
        "vllm_mode": VLLM,
        "vllm_gpu_memory_utilization": VLLM,
        "vllm_tensor_parallel_size": VLLM,
        "dataloader_num_workers": "threads",
    },
    ("vlm-r1", "vlm_r1_run_grpo_rec.sh", ()): {
        "data_file_paths": "concatenate the other 2",
        "reward_funcs": "grpo_jsonl.py",
        "task_type": "prompt_template",
        "is_reward_customized_from_vlm_module": "algorithm.reward_funcs",
        "nproc_per_node": LAUNCH,
        "nnodes": LAUNCH,
        "node_rank": LAUNCH,
        "master_addr": LAUNCH,
        "master_port": LAUNCH,
        "use_vllm": VLLM,
        "resume_from_checkpoint": "training.resume",
        "run_name": NAMES,
        "data_seed": "training.seed",
        "dataset_name": "local files",
        "deepspeed": ZERO,
        "training.output_dir": "$PROJECT_ROOT",  # the script computes REPO_HOME when it runs
    },
    ("vlm-r1", "vlm_r1_multinode_args.yaml", ("--processes", "16")): {"dataset_name": "local files", "deepspeed": ZERO, "run_name": NAMES},
}


def case_id(case):
    return case[1]


def test_script_arguments_fill_variables_and_lists():
    words = script_arguments('name="m"\nX=1 cmd \\\n  --model $name --funcs a b --flag --dtype "bf16"\n')
    assert parse_arguments(words) == {"model": "m", "funcs": ["a", "b"], "flag": True, "dtype": "bf16"}


def test_launch_command_ends_at_an_empty_line_and_keeps_the_environment():
    """A trailing backslash before an empty line ends the command (bash), as run_grpo_rec.sh's last option does; the
    `VAR=value` prefixes of the command are its environment."""
    env, words = launch_command("A=1 \\\nB=two cmd \\\n  --deepspeed z3.json \\\n\necho done --not-an-option\n")
    assert env == {"A": "1", "B": "two"} and parse_arguments(words) == {"deepspeed": "z3.json"}
    assert parse_arguments(["--config_file=x.yaml", "--use_vllm"]) == {"config_file": "x.yaml", "use_vllm": True}  # TRL docs' spelling


@pytest.mark.parametrize("case", list(EXAMPLES), ids=case_id)
def test_unmapped_keys_are_exactly_these_with_their_reasons(case):
    peer, fixture, options = case
    processes = int(options[1]) if options else None
    result = convert(peer, [str(CONFIGS / fixture)], processes)
    expected = EXAMPLES[case]
    assert set(result.unmapped) == set(expected), (set(result.unmapped) ^ set(expected), result.unmapped)
    for key, word in expected.items():
        assert word in result.unmapped[key], (key, result.unmapped[key])


def test_trl_example():
    result = convert("trl", [str(CONFIGS / "trl_grpo_vlm.sh")])
    s = result.settings
    assert s["model.name_or_path"] == "Qwen/Qwen2.5-VL-3B-Instruct" and s["model.use_lora"] is True and s["model.dtype"] == "bfloat16"
    assert s["model.lora_target_modules"] == ["q_proj", "v_proj"] and s["rollout.max_completion_length"] == 1024
    assert s["logging.log_completions"] is True and s["optim.learning_rate"] == 1e-5
    # what the command leaves to TRL's defaults: TRL's values, not vlmrl's
    assert s["algorithm.preset"] == "trl" and s["training.per_device_train_batch_size"] == 8 and s["rollout.num_generations"] == 8
    assert any("names no reward" in n for n in result.notes)
    assert any("give --processes N" in n for n in result.notes)  # the accelerate config with its 8 processes is not here


def test_trl_processes_from_the_accelerate_config_when_it_is_here(tmp_path, monkeypatch):
    """TRL's per-GPU batches x the accelerate config's num_processes: the same completions per optimizer step."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples" / "accelerate_configs").mkdir(parents=True)
    (tmp_path / "examples" / "accelerate_configs" / "deepspeed_zero3.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 8\n")
    s = convert("trl", [str(CONFIGS / "trl_grpo_vlm.sh")]).settings
    assert s["training.per_device_train_batch_size"] * s["training.gradient_accumulation_steps"] == 64  # 8 per GPU x 8 GPUs


def test_easyr1_example():
    result = convert("easyr1", [str(CONFIGS / "easyr1_config.yaml")])
    s = result.settings
    assert s["data.train_path"] == "hiyouga/math12k::train" and s["data.prompt_template"] == "./examples/format_prompt/math.jinja"
    assert s["algorithm.reward_funcs"] == ["./examples/reward_function/math.py:compute_score"]
    assert s["algorithm.beta"] == 0.01 and s["rollout.num_generations"] == 5 and s["rollout.generation_batch_size"] == 2560
    # global_batch_size 128 prompts x n=5 per optimizer step in micro-batches of 1: 4 updates per rollout, as in EasyR1
    assert s["training.per_device_train_batch_size"] * s["training.gradient_accumulation_steps"] == 640
    assert s["training.num_train_epochs"] == 15 and s["logging.report_to"] == ["wandb"] and "training.max_steps" not in s


def test_ms_swift_examples():
    s = convert("ms-swift", [str(CONFIGS / "ms_swift_grpo_multimodal.sh")]).settings
    assert s["algorithm.reward_funcs"] == ["examples/train/grpo/plugin/plugin.py:external_r1v_acc", "format"]
    assert s["model.use_lora"] is False and s["algorithm.num_iterations"] == 1 and s["data.max_pixels"] == 602112
    assert s["logging.report_to"] == ["tensorboard"] and s["algorithm.mask_truncated_completions"] is False
    # 4 per GPU x 4 accumulation x 4 GPUs (NPROC_PER_NODE) per optimizer step; 4 per GPU x 4 steps_per_generation x 4 per rollout
    assert s["training.per_device_train_batch_size"] * s["training.gradient_accumulation_steps"] == 64
    assert s["training.per_device_train_batch_size"] * s["rollout.steps_per_generation"] == 64
    lora = convert("ms-swift", [str(CONFIGS / "ms_swift_grpo_vl7b.sh")]).settings
    assert lora["model.use_lora"] is True and lora["algorithm.reward_funcs"] == ["accuracy", "format"]  # tuner_type lora
    assert lora["training.gradient_accumulation_steps"] == 8


def test_easyr1_online_filtering_becomes_dynamic_sampling(tmp_path):
    """EasyR1's DAPO example settings (algorithm.online_filtering with filter_key overall, trainer.max_try_make_batch)."""
    source = yaml.safe_load((CONFIGS / "easyr1_config.yaml").read_text())
    source["algorithm"]["online_filtering"] = True
    source["trainer"]["max_try_make_batch"] = 6
    path = tmp_path / "dapo.yaml"
    path.write_text(yaml.safe_dump(source))
    s = convert("easyr1", [str(path)]).settings
    assert (s["algorithm.dynamic_sampling"], s["algorithm.dynamic_sampling_metric"], s["algorithm.dynamic_sampling_max_batches"]) == (
        True,
        "reward",
        6,
    )
    source["trainer"]["max_try_make_batch"], source["algorithm"]["filter_key"] = -1, "accuracy"
    path.write_text(yaml.safe_dump(source))
    result = convert("easyr1", [str(path)])
    assert "no limit" in result.unmapped["trainer.max_try_make_batch"] and "score dict" in result.unmapped["algorithm.filter_key"]


def test_ms_swift_dapo_arguments():
    """ms-swift's DAPO arguments: --dynamic_sample / --max_resample_times / --overlong_filter, and its soft_overlong
    reward, whose L_max / L_cache become vlmrl's function of the same formula in the reward's place (weights line up)."""
    args = "--dynamic_sample true --max_resample_times 3 --overlong_filter true --reward_funcs accuracy soft_overlong"
    args += " --reward_weights 1.0 0.5 --max_completion_length 64 --soft_cache_length 16"
    s = convert("ms-swift", args.split()).settings
    assert (s["algorithm.dynamic_sampling"], s["algorithm.dynamic_sampling_max_batches"], s["algorithm.mask_truncated_completions"]) == (
        True,
        3,
        True,
    )
    funcs = s["algorithm.reward_funcs"]
    assert funcs[0] == "accuracy" and s["algorithm.reward_weights"] == [1.0, 0.5]
    from vlmrl.rewards.functions import load_reward

    overlong = load_reward(funcs[1])  # ms-swift's formula: min(-(len - (L_max - L_cache)) / L_cache, 0)
    assert overlong(["p"] * 3, ["c"] * 3, completion_ids=[[1] * 48, [1] * 56, [1] * 64]) == [0.0, -0.5, -1.0]


def test_ms_swift_system_prompt_file_is_read_when_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "prompt.txt is not here" in convert("ms-swift", [str(CONFIGS / "ms_swift_grpo_vl7b.sh")]).unmapped["system"]
    (tmp_path / "examples" / "train" / "grpo").mkdir(parents=True)
    (tmp_path / "examples" / "train" / "grpo" / "prompt.txt").write_text("Think first, then answer.\n")
    result = convert("ms-swift", [str(CONFIGS / "ms_swift_grpo_vl7b.sh")])
    assert result.settings["data.system_prompt"] == "Think first, then answer." and "system" not in result.unmapped


def test_vlm_r1_example():
    result = convert("vlm-r1", [str(CONFIGS / "vlm_r1_run_grpo_rec.sh")])
    s = result.settings
    assert s["data.train_path"] == "/training/shz/dataset/vlm-r1/rec_jsonsl_train/refcoco_train.jsonl"
    assert s["data.image_root"] == "/training/shz/dataset/coco" and s["model.name_or_path"] == "/training/models/Qwen2.5-VL-3B-Instruct"
    assert s["training.bf16"] is True and s["algorithm.beta"] == 0.04 and s["training.num_train_epochs"] == 2
    assert s["training.gradient_accumulation_steps"] == 16  # 2 x 8 processes (torchrun --nproc_per_node 8)
    assert "training.output_dir" not in s  # never a path with ${PROJECT_ROOT} in it


def test_per_gpu_batches_without_a_process_count_say_to_give_one(tmp_path, capsys):
    """VLM-R1's multi-node arguments file: 1 x 2 completions per GPU cannot hold a group of 8 on one process; the
    refusal names --processes (mutation-checked: without the hint only the generation-batch line is printed)."""
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "vlm-r1", "-o", str(out), str(CONFIGS / "vlm_r1_multinode_args.yaml")]) == 2
    err = capsys.readouterr().err
    assert "generation batch 2" in err and "give vlmrl convert --processes N" in err and not out.exists()
    assert main(["convert", "--from", "vlm-r1", "--processes", "x", "-o", str(out), str(CONFIGS / "vlm_r1_multinode_args.yaml")]) == 2
    assert "--processes takes the number of GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("case", list(EXAMPLES), ids=case_id)
def test_cli_writes_yaml_that_loads_and_lists_unmapped(case, tmp_path, capsys):
    peer, fixture, options = case
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", peer, *options, "-o", str(out), str(CONFIGS / fixture)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and f"{len(EXAMPLES[case])} keys have no vlmrl equivalent" in err
    assert isinstance(yaml.safe_load(out.read_text()), dict)
    load_config(out)  # a valid vlmrl config as written
    assert main(["convert", "--from", peer, *options, "-o", str(out), str(CONFIGS / fixture)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


def _swift_checkout(root: Path) -> None:
    """The files ms-swift's examples name, relative to the folder the command runs in: a plugin registering
    external_r1v_acc (tests/peers/swift_plugin.py's ORM under that name) and a system prompt of our own words."""
    grpo = root / "examples" / "train" / "grpo"
    (grpo / "plugin").mkdir(parents=True)
    plugin = (PEERS / "swift_plugin.py").read_text() + '\norms["external_r1v_acc"] = CountAccuracy\n'
    (grpo / "plugin" / "plugin.py").write_text(plugin)
    (grpo / "prompt.txt").write_text("Think in <think> </think>, then answer in <answer> </answer>.\n")


def local_overrides(peer: str, fixture: str, tmp: Path) -> tuple[list[str], str]:
    """(what a user points at their own files, the layout `check` must name) for one converted example: the hub model
    and datasets become the local tiny fixtures; rewards the source keeps in Python are named."""
    if peer == "trl":  # grpo_vlm.py scores with trl.rewards' accuracy_reward (needs math-verify, not installed here) and think_format_reward
        rewards = f"algorithm.reward_funcs=['trl.rewards:think_format_reward', '{PEERS}/trl_rewards.py:think_length']"
        return [f"data.train_path={peer_files.trl_conversational(tmp / 'data')}", rewards], "trl conversational"
    if peer == "easyr1":
        template = tmp / "math.jinja"  # the source's ./examples/format_prompt/math.jinja, in our own words
        template.write_text("{{ content | trim }} Put the answer in <answer></answer>.")
        rewards = f"algorithm.reward_funcs=['{PEERS / 'easyr1_math.py'}:compute_score']"
        return [f"data.train_path={peer_files.easyr1(tmp / 'data')}", "data.eval_path=''", f"data.prompt_template={template}", rewards], "easyr1"
    if peer == "ms-swift":  # its plugin and system prompt are the checkout's files (_swift_checkout); nothing else to name
        return [f"data.train_path={peer_files.ms_swift(tmp / 'data')}"], "messages"
    data, images = peer_files.vlm_r1(tmp / "data")  # VLM-R1's rewards live in its grpo_jsonl.py: the user names theirs
    rewards = f"algorithm.reward_funcs=['{PEERS}/vlmr1_rewards.py:accuracy_reward', '{PEERS}/vlmr1_rewards.py:format_reward']"
    # flash-attn is not installed here (check refuses flash_attention_2 without it)
    return [f"data.train_path={data}", f"data.image_root={images}", rewards, "model.attn_implementation=sdpa"], "vlm-r1 conversations"


@pytest.mark.integration
@pytest.mark.parametrize("case", list(EXAMPLES), ids=case_id)
def test_converted_example_passes_check(case, tiny_qwen25vl, tmp_path, capsys, monkeypatch):
    """convert -> the YAML -> `vlmrl check` with the user's local model and data: exit 0, the layout named, each reward
    described. wandb is not installed here, so a config reporting to it gets logging.report_to=none as a user would."""
    peer, fixture, options = case
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    if peer == "ms-swift":
        _swift_checkout(tmp_path)
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", peer, *options, "-o", str(out), str(CONFIGS / fixture)]) == 0, capsys.readouterr().err
    converted = yaml.safe_load(out.read_text())
    capsys.readouterr()
    local, layout = local_overrides(peer, fixture, tmp_path)
    if peer == "trl" and importlib.util.find_spec("trl") is None:  # its rewards are TRL's own (trl.rewards), as grpo_vlm.py names them
        pytest.skip("the converted TRL config names trl.rewards: check needs trl (pip install -e '.[bench]')")
    if "wandb" in converted.get("logging", {}).get("report_to", []):
        local.append("logging.report_to=none")
    local += [f"model.name_or_path={tiny_qwen25vl}", f"training.output_dir={tmp_path / 'run'}", "training.device=cpu"]
    # EasyR1's example rolls out 512 prompts x 5 = 2560 completions of 2048 tokens a step: every check passes and the
    # planner says (exit 1) that this does not fit a CPU's memory; the others fit and pass (exit 0)
    fits = peer != "easyr1"
    assert main(["check", str(out), *local]) == (0 if fits else 1), capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"format {layout}: 4 of 4 rows kept" in err, err
    assert ("vlmrl check: OK" if fits else "vlmrl check: every check passed, but the run is predicted NOT to fit") in err, err
    assert err.count("\nreward ") + err.startswith("reward ") >= 1, err
    if peer == "ms-swift" and fixture == "ms_swift_grpo_multimodal.sh":
        assert "reward external_r1v_acc (ms-swift ORM, one instance)" in err  # the plugin the converted config names


def test_check_refuses_flash_attention_without_flash_attn(tmp_path, capsys):
    """A converted VLM-R1 script asks for flash_attention_2; where flash-attn is missing `check` says so (before, check
    passed and train failed at loading). Mutation-checked: without the preflight call this test fails (exit 0)."""
    shutil.copy(CONFIGS / "vlm_r1_multinode_args.yaml", tmp_path / "args.yaml")
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "vlm-r1", "--processes", "16", "-o", str(out), str(tmp_path / "args.yaml")]) == 0
    data, images = peer_files.vlm_r1(tmp_path / "data")
    local = [f"data.train_path={data}", f"data.image_root={images}", "model.name_or_path=embedded", "logging.report_to=none"]
    local += [f"training.output_dir={tmp_path / 'run'}", "training.device=cpu"]
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    capsys.readouterr()
    assert main(["check", str(out), *local]) == 2
    assert "flash_attention_2 but the flash-attn package is not installed" in capsys.readouterr().err
