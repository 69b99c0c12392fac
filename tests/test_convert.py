"""`vlmrl convert` on each peer's published example config (tests/peers/configs, each naming its source): a vlmrl YAML
that `check` accepts, and every key without an equivalent listed with why."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import yaml

import peer_files
from vlmrl.cli import main
from vlmrl.config import ConfigError, load_config
from vlmrl.run.convert import convert
from vlmrl.run.convert.source import launch_command, parse_arguments, script_arguments

pytestmark = pytest.mark.unit
PEERS = Path(__file__).parent / "peers"
CONFIGS = PEERS / "configs"
VLLM, ZERO, LAUNCH, NAMES = "vLLM", "accelerate", "processes and nodes", "environment variables"
ENV = "an environment variable of the launch"

# (peer, fixture, extra convert options) -> {unmapped key: a word its reason must hold}: exactly these keys are listed.
EXAMPLES = {
    # grpo_vlm.py trains LoRA (--use_peft) with vLLM: converted (the vLLM backend pushes the merged weights)
    ("trl", "trl_grpo_vlm.sh", ()): {"config_file": "accelerate launch line"},
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
        "worker.rollout.enforce_eager": "eagerly",
        "worker.rollout.disable_tqdm": "does not expose",
        "worker.rollout.val_override_config.temperature": "greedily",
        "worker.rollout.val_override_config.top_p": "greedily",
        "worker.rollout.val_override_config.n": "greedily",
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
        "reward_funcs (format)": "built-ins",  # external_r1v_acc is the plugin's, not a built-in
        "system": "prompt.txt is not here",  # run from this repository; test_ms_swift_system_prompt_file_is_read_when_here
        "rlhf_type": "GRPO",
        "external_plugins": "algorithm.reward_funcs",
        "offload_model": "keeps it on the device",
        "CUDA_VISIBLE_DEVICES": ENV,
        "PYTORCH_CUDA_ALLOC_CONF": ENV,
        "vllm_enable_lora": "does not expose",
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
        "dataloader_num_workers": "threads",
    },
    ("vlm-r1", "vlm_r1_run_grpo_rec.sh", ()): {
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
    # `--key=value` holds one value, and a value's dashes are its own (before: nnodes=[2, 'train.py'], Qwen2.5_VL)
    assert parse_arguments(["--nnodes=2", "train.py", "--model-name=Qwen2.5-VL-3B"]) == {"nnodes": 2, "model_name": "Qwen2.5-VL-3B"}


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
    from vlmrl.rewards.loading import load_reward

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
    assert s["data.train_path"] == [f"/training/shz/dataset/vlm-r1/rec_jsonsl_train/{n}_train.jsonl" for n in ("refcoco", "refcocop", "refcocog")]
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
    if converted.get("rollout", {}).get("backend") == "vllm" and importlib.util.find_spec("vllm") is None:
        local.append("rollout.backend=inprocess")  # vLLM is in .venv-vllm, not here: check refuses it in one line (its own test)
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


# ---------------------------------------------------------------------------------------------------
# Issue 35 #6 / #7: every published file converts to a config; EasyR1's OmegaConf scripts; the loss and the keys the
# converters dropped.

PEER_NAMES = {"TRL": "trl", "EasyR1": "easyr1", "ms-swift": "ms-swift", "VLM-R1": "vlm-r1", "R1-V (`--from vlm-r1`)": "vlm-r1"}


def published_files() -> list[tuple[str, str, tuple[str, ...]]]:
    """(peer, fixture, options) of each row of docs/coming_from.md's table of published files: the list the docs give."""
    rows = []
    for line in (Path(__file__).parents[1] / "docs" / "coming_from.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in PEER_NAMES and re.fullmatch(r"`[\w.-]+\.(sh|yaml)`", cells[1]):
            rows.append((PEER_NAMES[cells[0]], cells[1].strip("`"), tuple(cells[3].strip("`").split())))
    return rows


def easyr1_checkout(root: Path, script: str) -> Path:
    """EasyR1's layout: examples/config.yaml (its published config) beside examples/<script>, run from `root`."""
    (root / "examples").mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIGS / "easyr1_config.yaml", root / "examples" / "config.yaml")
    return Path(shutil.copy(CONFIGS / script, root / "examples" / script.removeprefix("easyr1_")))


def test_the_docs_list_every_published_file_here():
    listed = {fixture for _, fixture, _ in published_files()}
    assert len(listed) >= 13 and listed == {p.name for p in CONFIGS.iterdir()}, listed ^ {p.name for p in CONFIGS.iterdir()}


@pytest.mark.parametrize("case", published_files(), ids=lambda c: c[1])
def test_every_published_file_converts_to_a_config(case, tmp_path, capsys, monkeypatch):
    """`vlmrl convert` on each file docs/coming_from.md lists, run where the peer runs it: exit 0 and a YAML holding
    settings read from the file (before: EasyR1's scripts became `{}` with exit 0)."""
    peer, fixture, options = case
    monkeypatch.chdir(tmp_path)
    source = easyr1_checkout(tmp_path, fixture) if fixture.startswith("easyr1_") and fixture.endswith(".sh") else CONFIGS / fixture
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", peer, *options, "-o", str(out), str(source)]) == 0, capsys.readouterr().err
    written = yaml.safe_load(out.read_text())
    assert isinstance(written, dict) and sum(len(v) for v in written.values()) >= 5, written
    assert written.get("model", {}).get("name_or_path") or written.get("data", {}).get("max_pixels"), written
    load_config(out)


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_easyr1_geo3k_script_reads_its_config_and_overrides(where, tmp_path, monkeypatch):
    """EasyR1's qwen2_5_vl_7b_geo3k_grpo.sh: config=examples/config.yaml (from the checkout, or found above the script
    when run elsewhere) with data.train_files, the model (${MODEL_PATH}) and n_gpus_per_node overridden."""
    script = easyr1_checkout(tmp_path / "EasyR1", "easyr1_qwen2_5_vl_7b_geo3k_grpo.sh")
    monkeypatch.chdir(tmp_path / "EasyR1" if where == "checkout" else tmp_path)
    result = convert("easyr1", [str(script)])
    s = result.settings
    assert s["data.train_path"] == "hiyouga/geometry3k::train" and s["data.eval_path"] == "hiyouga/geometry3k::test"
    assert s["model.name_or_path"] == "Qwen/Qwen2.5-VL-7B-Instruct"  # the script's MODEL_PATH, not config.yaml's text model
    assert s["rollout.num_generations"] == 5 and s["algorithm.beta"] == 0.01  # from config.yaml
    assert s["algorithm.reward_funcs"] == ["./examples/reward_function/math.py:compute_score"]
    assert "trainer.experiment_name" in result.unmapped and "trainer.n_gpus_per_node" in result.unmapped


def test_easyr1_multi_image_and_gspo_scripts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = convert("easyr1", [str(easyr1_checkout(tmp_path, "easyr1_qwen2_5_vl_7b_multi_image.sh"))]).settings
    assert s["data.limit_images"] == 2 and s["rollout.generation_batch_size"] == 256 * 5
    assert s["data.train_path"] == "hiyouga/journeybench-multi-image-vqa::train"
    s = convert("easyr1", [str(easyr1_checkout(tmp_path, "easyr1_qwen2_5_vl_7b_geo3k_gspo.sh"))]).settings
    assert s["algorithm.policy_loss"] == "gspo" and (s["algorithm.epsilon"], s["algorithm.epsilon_high"]) == (3e-4, 4e-4)
    assert s["algorithm.beta"] == 0.0  # algorithm.disable_kl=True


def test_easyr1_json_valued_overrides(tmp_path, monkeypatch):
    """EasyR1's dapo17k script passes reward_function_kwargs='{...}' and val_override_config='{...}': mappings, as
    OmegaConf reads them (before: a string, and convert failed with a traceback)."""
    monkeypatch.chdir(tmp_path)
    result = convert("easyr1", [str(easyr1_checkout(tmp_path, "easyr1_qwen3_14b_dapo17k_dapo.sh"))])
    s = result.settings
    kwargs = "max_response_length=20480, overlong_buffer_length=4096, overlong_penalty_factor=1.0"
    assert s["algorithm.reward_funcs"] == [f"./examples/reward_function/dapo.py:compute_score({kwargs})"]
    assert (s["algorithm.epsilon_high"], s["algorithm.delta"], s["rollout.num_generations"]) == (0.28, 10.0, 16)
    assert "worker.rollout.val_override_config.n" in result.unmapped


def test_easyr1_loss_defaults_are_easyr1s():
    """EasyR1's actor defaults (clip 0.2 / 0.3, dual clip 3.0, token mean, low_var_kl) are written for its config.yaml,
    which leaves them to the dataclass; vlmrl's own (0.2 / 0.2, no dual clip, per-sequence mean, k3) would differ."""
    s = convert("easyr1", [str(CONFIGS / "easyr1_config.yaml")]).settings
    assert (s["algorithm.epsilon"], s["algorithm.epsilon_high"], s["algorithm.delta"]) == (0.2, 0.3, 3.0)
    assert s["algorithm.loss_aggregation"] == "token_mean" and s["algorithm.kl_estimator"] == "low_var_kl"


def test_easyr1_arguments_given_directly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    easyr1_checkout(tmp_path, "easyr1_qwen2_5_vl_7b_geo3k_grpo.sh")
    s = convert("easyr1", ["config=examples/config.yaml", "worker.rollout.n=8", "worker.actor.model.model_path=/m"]).settings
    assert s["rollout.num_generations"] == 8 and s["model.name_or_path"] == "/m" and s["data.train_path"] == "hiyouga/math12k::train"


def test_easyr1_script_without_its_config_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = shutil.copy(CONFIGS / "easyr1_qwen2_5_vl_7b_geo3k_grpo.sh", tmp_path / "geo3k.sh")
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "easyr1", "-o", str(out), str(script)]) == 2
    err = capsys.readouterr().err
    assert "config=examples/config.yaml is not here" in err and len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    "peer, fixture, hint",
    [
        ("easyr1", "trl_grpo_vlm.sh", "--from trl"),
        ("trl", "easyr1_config.yaml", "--from easyr1"),
        ("ms-swift", "easyr1_config.yaml", "--from easyr1"),
    ],
)
def test_nothing_read_is_refused_not_written_empty(peer, fixture, hint, tmp_path, capsys):
    """Another peer's file: no setting can be read, so one line (exit 2) names what was found and nothing is written
    (before: `{}`, or only the peer's defaults, with exit 0). Mutation-checked: without refuse_empty these pass exit 0."""
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", peer, "-o", str(out), str(CONFIGS / fixture)]) == 2
    err = capsys.readouterr().err
    assert "nothing written" in err and hint in err and len(err.strip().splitlines()) == 1 and not out.exists()
    empty = tmp_path / "empty.sh"
    empty.write_text("#!/bin/bash\nset -x\necho hello\n")
    assert main(["convert", "--from", peer, "-o", str(out), str(empty)]) == 2 and not out.exists()
    assert "no --key value arguments" in capsys.readouterr().err


def test_trl_loss_flags_keep_their_meaning():
    """The flags whose conversion changed TRL's math (issue 35 #7); their loss is checked by TRL's own code in
    tests/test_convert_oracle.py (where TRL is installed)."""
    s = convert("trl", ["--use_bias_correction_kl", "false", "--beta", "0.04"]).settings
    assert s["algorithm.use_bias_correction_kl"] is False and s["algorithm.beta"] == 0.04
    s = convert("trl", [str(CONFIGS / "trl_gspo_vlm.sh")]).settings
    assert s["algorithm.policy_loss"] == "gspo" and s["algorithm.loss_type"] == "grpo"
    assert convert("trl", ["--loss_type", "dapo"]).settings["algorithm.loss_aggregation"] == "token_mean_rollout"
    s = convert("trl", ["--loss_type", "cispo", "--epsilon_high", "5.0"]).settings
    assert s["algorithm.policy_loss"] == "cispo" and s["algorithm.epsilon_high"] == 4.0  # TRL's cap 5 = vlmrl's 1 + 4
    s = convert("trl", ["--loss_type", "sapo"]).settings
    assert s["algorithm.policy_loss"] == "sapo" and s["algorithm.loss_type"] == "grpo"


@pytest.mark.parametrize(
    "words, message",
    [
        (["--loss_type", "vespo"], "vespo: vlmrl has no such loss"),
        (["--loss_type", "cispo"], "caps the importance weight at 0.2"),
        (["--importance_sampling_level", "sequence_token"], "sequence_token: choose token or sequence"),  # ms-swift's, not TRL's
    ],
)
def test_a_loss_vlmrl_lacks_is_refused(words, message, tmp_path, capsys):
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "trl", "-o", str(out), *words]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_ms_swift_published_gspo_and_lora_scripts():
    result = convert("ms-swift", [str(CONFIGS / "ms_swift_gspo.sh")])
    s = result.settings
    assert s["algorithm.policy_loss"] == "gspo" and (s["algorithm.epsilon"], s["algorithm.epsilon_high"]) == (3e-4, 4e-4)
    assert "importance_sampling_level" not in result.unmapped
    token_form = convert("ms-swift", ["--model", "m", "--importance_sampling_level", "sequence_token"], processes=1).settings
    assert token_form["algorithm.policy_loss"] == "gspo"  # GSPO-token: vlmrl's gspo is that form
    result = convert("ms-swift", [str(CONFIGS / "ms_swift_grpo_omni_lora.sh")])
    s = result.settings
    assert s["model.use_lora"] is True and s["model.lora_r"] == 8 and s["model.lora_alpha"] == 32
    assert s["algorithm.reward_funcs"] == ["examples/train/grpo/plugin/plugin.py:external_r1v_acc", "format"]
    assert "reward_funcs (format)" in result.unmapped and not any("external_r1v_acc" in k for k in result.unmapped)


def test_ms_swift_image_limit_and_its_own_defaults():
    """A `swift rlhf` line without batch flags ran with ms-swift's: 1 per GPU, accumulation ceil(16 / 1 / 4 GPUs) = 4,
    8 generations, beta 0.04; --vllm_limit_mm_per_prompt's image count is data.limit_images."""
    words = ["--rlhf_type", "grpo", "--model", "m", "--vllm_limit_mm_per_prompt", '{"image": 2, "video": 1}']
    result = convert("ms-swift", words, processes=4)
    s = result.settings
    assert s["data.limit_images"] == 2 and "vllm_limit_mm_per_prompt (video)" in result.unmapped
    assert s["training.per_device_train_batch_size"] == 1 and s["rollout.num_generations"] == 8 and s["algorithm.beta"] == 0.04
    assert s["algorithm.kl_estimator"] == "low_var_kl"  # ms-swift's KL: k3 clamped, never times the ratio
    assert s["training.gradient_accumulation_steps"] == 4 * 4  # ms-swift's 4 per GPU x 4 GPUs: 16 completions a step, as there


def test_r1v_comment_after_a_continuation_keeps_the_process_count():
    """R1-V's run_grpo_clevr.sh has `--dataset_name <...> \\  #https://...`: its torchrun options (--nproc_per_node 8)
    come before that line; the command is read on, so the process count is kept and the line is named."""
    result = convert("vlm-r1", [str(CONFIGS / "r1v_run_grpo_clevr.sh")])
    s = result.settings
    assert s["training.gradient_accumulation_steps"] == 2 * 8 and s["data.max_pixels"] == 401408 and s["training.save_only_model"] is True
    assert "nproc_per_node" in result.unmapped and any("line 14" in n and "comment" in n for n in result.notes)
    assert "placeholder" in result.unmapped["model.name_or_path"]  # <PATH-TO-Qwen2-VL-2B-Instruct> is for the user to fill


def test_easyr1_config_trains_easyr1s_clipped_loss(tmp_path):
    """EasyR1's default policy loss (core_algos.compute_policy_loss: clip to [0.8, 1.3], dual clip 3 for negative
    advantages) on hand-picked ratios, values computed by hand from its definition, against vlmrl's per-token loss
    under the converted config as `vlmrl train` loads it. Before, the conversion left vlmrl's clip 0.2 / 0.2 and no
    dual clip: a ratio of 5 with advantage -1 cost 5, not EasyR1's 3."""
    import torch

    from vlmrl.algo.losses import per_token_loss

    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "easyr1", "-o", str(out), str(CONFIGS / "easyr1_config.yaml")]) == 0
    cfg = load_config(out, ["logging.report_to=none"])
    ratios = torch.tensor([[0.5, 1.0, 1.5, 5.0]], dtype=torch.float64)
    for advantage, easyr1 in ((1.0, [-0.5, -1.0, -1.3, -1.3]), (-1.0, [0.8, 1.0, 1.5, 3.0])):
        advantages = torch.tensor([advantage], dtype=torch.float64)
        loss, _ = per_token_loss(ratios.log(), torch.zeros_like(ratios), advantages, cfg.algorithm, ratios.log())  # ref = policy: KL 0
        assert torch.allclose(loss, torch.tensor([easyr1], dtype=torch.float64)), (advantage, loss)
    # EasyR1's loss_avg_mode=token: the mean over the optimizer step's tokens; its KL: low_var_kl x kl_coef
    assert cfg.loss_aggregation == "token_mean" and cfg.kl_estimator == "low_var_kl" and cfg.algorithm.beta == 0.01


def test_process_count_names_the_launcher_option_that_is_not_a_number():
    """ms-swift's DLC script (examples/train/grpo/multi_node/train_dlc.sh): --nproc_per_node=8 --nnodes=${WORLD_SIZE};
    the conversion blames nnodes, not the 8 (before: "nproc_per_node=8 is not a number")."""
    words = ["--nproc_per_node=8", "--nnodes=${WORLD_SIZE}", "x.py", "--model", "m", "--per_device_train_batch_size", "4"]
    words += ["--gradient_accumulation_steps", "1", "--num_generations", "48"]
    with pytest.raises(ConfigError, match=r"nnodes='\$\{WORLD_SIZE\}' is not a number: give vlmrl convert --processes N"):
        convert("ms-swift", words)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--advantage_estimator", "reinforce_plus_plus"], "reinforce_plus_plus: ms-swift's centres each group"),
        (["--advantage_estimator", "rloo"], "rloo: ms-swift's centres each group"),
        (["--kl_in_reward", "true"], "--kl_in_reward true: vlmrl's KL is a loss term"),
    ],
)
def test_ms_swift_estimators_vlmrl_lacks_are_refused(flags, said, tmp_path, capsys):
    """ms-swift's reinforce_plus_plus (examples/train/grpo/internal/reinforce_plus_plus.sh) centres each group and puts
    the KL in the reward; vlmrl's reinforce_pp centres on the batch (before: mapped to it, or refused for a clash with
    scale_rewards)."""
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "ms-swift", "--processes", "1", "-o", str(out), "--model", "m", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["algorithm.adv_estimator=reinforce_plus_plus"], "adv_estimator=reinforce_plus_plus"),
        (["algorithm.use_kl_loss=false", "algorithm.kl_penalty=kl", "algorithm.kl_coef=1.0e-3"], "use_kl_loss=false"),
        (["worker.actor.loss_type=cispo", "worker.actor.clip_ratio_low=0", "worker.actor.clip_ratio_high=4"], "loss_type=cispo"),
    ],
)
def test_easyr1_algorithms_vlmrl_lacks_are_refused(overrides, said, tmp_path, capsys, monkeypatch):
    """EasyR1's reinforce / cispo example scripts' overrides: its REINFORCE++ (token-weighted whitening, KL in the
    reward) and its CISPO (a lower clamp too) are not vlmrl's, so one line (exit 2), nothing written (before:
    reinforce_pp written, the reward's KL dropped)."""
    monkeypatch.chdir(tmp_path)
    easyr1_checkout(tmp_path, "easyr1_qwen2_5_vl_7b_geo3k_grpo.sh")
    out = tmp_path / "vlmrl.yaml"
    assert main(["convert", "--from", "easyr1", "-o", str(out), "config=examples/config.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_ms_swift_line_without_train_type_trains_lora_as_ms_swift_does(tmp_path):
    """ms-swift's TunerArguments default train_type is lora: a `swift rlhf` line that names no --train_type (nor ms-swift
    4's --tuner_type) trained a LoRA adapter (rank 8, alpha 32, dropout 0.05), so the converted run must too."""
    script = tmp_path / "grpo.sh"
    script.write_text("swift rlhf --rlhf_type grpo --model Qwen/Qwen2.5-VL-3B-Instruct --dataset rows.jsonl --reward_funcs accuracy\n")
    result = convert("ms-swift", [str(script)])
    s = result.settings
    assert (s["model.use_lora"], s["model.lora_r"], s["model.lora_alpha"], s["model.lora_dropout"]) == (True, 8, 32, 0.05)
    assert "model.use_lora=True" in " ".join(result.notes)  # said, as every other ms-swift default it fills
    script.write_text(script.read_text().strip() + " --train_type full\n")
    full = convert("ms-swift", [str(script)]).settings
    assert full["model.use_lora"] is False and "model.lora_r" not in full
