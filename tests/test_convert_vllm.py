"""The peers' vLLM settings, converted (issue 34 part 1's names): `vlmrl convert` writes rollout.backend=vllm and the
matching fields, and the converted run is checked against what the peer does with those flags, read from the plan
of the converted config: ms-swift's --vllm_gpu_memory_utilization 0.5 reserves half of each GPU for the whole step
(no sleep); --sleep_level 1 gives it back while training and keeps the weight copy in host RAM; TRL's
vllm_enable_sleep_mode sleeps at level 2 (nothing kept); EasyR1's hybrid engine sleeps at level 1 with its cap and
tensor parallelism. The seed-003 command (ms-swift #4311, 4 x 90 GB) is the one that ran out of memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrl.config import ConfigError, load_config
from vlmrl.plan.planner import GiB, plan_for_config
from vlmrl.run.convert import convert

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).parent / "peers" / "configs"

# ms-swift #4311's command line (its model path replaced by the hub id; eval / save / logging flags left out), with the
# vLLM colocation issue 34 reports for the run: use_vllm at half the GPU.
SEED_003 = """nproc_per_node=4

SIZE_FACTOR=8 MAX_PIXELS=602112 CUDA_VISIBLE_DEVICES=0,1,2,3 \\
NPROC_PER_NODE=$nproc_per_node \\
swift rlhf \\
    --rlhf_type grpo \\
    --model_type qwen2_5_vl \\
    --model Qwen/Qwen2.5-VL-3B-Instruct \\
    --train_type full \\
    --freeze_vit False \\
    --torch_dtype bfloat16 \\
    --max_completion_length 1024 \\
    --per_device_train_batch_size 8 \\
    --learning_rate 1e-5 \\
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \\
    --max_length 2048 \\
    --num_generations 8 \\
    --temperature 1 \\
    --deepspeed zero3 \\
    --use_vllm true \\
    --vllm_gpu_memory_utilization 0.5
"""
FIX = ["--sleep_level", "1", "--vllm_tensor_parallel_size", "4", "--vllm_limit_mm_per_prompt", '{"image": 2}']
FIX += ["--offload_model", "true", "--offload_optimizer", "true"]


def _converted(tmp_path: Path, peer: str, source: str | list[str], name: str = "run"):
    if isinstance(source, str):
        script = tmp_path / f"{name}.sh"
        script.write_text(source)
        args = [str(script)]
    else:
        args = source
    result = convert(peer, args)
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(result.tree()))
    return result, out


def _plan(path: Path, world: int, gpu_gib: float, *overrides: str):
    cfg = load_config(path, ["model.name_or_path=qwen2.5-vl-3b", *overrides])
    sharding = {"sharding": "zero3"} if world > 1 else {}
    return cfg, plan_for_config(cfg, world_size=world, gpu_memory_bytes=int(gpu_gib * GiB), **sharding)


def test_seed_003_converts_to_vllm_colocated_at_half_of_each_gpu_and_does_not_fit(tmp_path):
    result, path = _converted(tmp_path, "ms-swift", SEED_003)
    s = result.settings
    assert s["rollout.backend"] == "vllm" and s["rollout.vllm_mode"] == "colocate" and s["rollout.vllm_gpu_memory_utilization"] == 0.5
    assert not {"use_vllm", "vllm_gpu_memory_utilization"} & set(result.unmapped)
    assert s["training.gradient_accumulation_steps"] == 4 * 4  # $(expr 16 / 4) per GPU x 4 GPUs (vlmrl's batches are global)
    cfg, p = _plan(path, 4, 90)
    # ms-swift: every GPU's engine holds 0.5 x that GPU through the whole step (no sleep_level)
    assert p.vllm["reservation"] == int(0.5 * 90 * GiB) and p.vllm["sleep_level"] == 0
    assert p.phases["update"] > p.vllm["reservation"]
    assert not p.fits, p.verdict


def test_seed_003_fix_flags_sleep_level_1_tensor_parallel_4_and_offloads(tmp_path):
    result, path = _converted(tmp_path, "ms-swift", SEED_003.rstrip() + " \\\n    " + " ".join(f"'{w}'" for w in FIX) + "\n")
    s = result.settings
    assert s["rollout.vllm_sleep_level"] == 1 and s["rollout.vllm_tensor_parallel_size"] == 4 and s["data.limit_images"] == 2
    assert s["memory.offload_optimizer_during_rollout"] is True  # ms-swift: optimizer states off the GPU while vLLM samples
    assert "offload_model" in result.unmapped  # vlmrl has no model offload: listed, not pretended
    assert any("vLLM on GPU only" in n for n in result.notes)
    cfg, p = _plan(path, 4, 90)
    # level 1: nothing of vLLM on the device while training; its weight copy (a quarter: TP 4) in host RAM per process
    assert p.vllm["freed_by_sleep"] == p.vllm["reservation"]
    _cfg, awake = _plan(path, 4, 90, "rollout.vllm_sleep_level=0")
    assert awake.phases["update"] - p.phases["update"] == p.vllm["reservation"]
    assert p.host["vllm_sleeping_weights"] == 4 * p.vllm["weights"] == 4 * (3_754_622_976 * 2 // 4)


def test_ms_swift_cap_left_out_is_its_default_0_9(tmp_path):
    result, path = _converted(tmp_path, "ms-swift", ["--rlhf_type", "grpo", "--model", "m", "--train_type", "full", "--use_vllm", "true"])
    assert result.settings["rollout.vllm_gpu_memory_utilization"] == 0.9 and "rollout.vllm_gpu_memory_utilization" in result.filled
    _cfg, p = _plan(path, 1, 80)
    assert p.vllm["reservation"] == int(0.9 * 80 * GiB)


def test_trl_sleep_mode_is_level_2_and_keeps_nothing_in_host_ram(tmp_path):
    words = ["--model_name_or_path", "m", "--use_vllm", "--vllm_mode", "colocate", "--vllm_enable_sleep_mode", "true"]
    words += ["--vllm_gpu_memory_utilization", "0.4", "--vllm_tensor_parallel_size", "1", "--vllm_max_model_length", "4096"]
    result, path = _converted(tmp_path, "trl", words)
    s = result.settings
    assert s["rollout.backend"] == "vllm" and s["rollout.vllm_sleep_level"] == 2 and s["rollout.vllm_max_model_length"] == 4096
    assert not [k for k in result.unmapped if k.startswith(("use_vllm", "vllm_"))]
    cfg, p = _plan(path, 1, 80)
    # TRL's GRPOTrainer calls llm.sleep(level=2) after generating: weights and KV discarded, nothing kept on the host
    assert p.vllm["freed_by_sleep"] == p.vllm["reservation"] == int(0.4 * 80 * GiB)
    assert p.host["vllm_sleeping_weights"] == 0
    b = {"float32": 4, "bfloat16": 2}[cfg.model.dtype]
    assert p.vllm["kv_one_sequence"] == 4096 * 2 * 36 * 2 * 128 * b  # max_model_len 4096 x Qwen2.5-VL-3B's k, v per token


@pytest.mark.parametrize(
    "peer, words",
    [
        ("trl", ["--model_name_or_path", "m", "--use_vllm", "--vllm_mode", "colocate", "--use_peft"]),
        ("ms-swift", ["--rlhf_type", "grpo", "--model", "m", "--train_type", "lora", "--use_vllm", "true"]),
    ],
)
def test_lora_with_vllm_converts_to_the_vllm_backend(tmp_path, peer, words):
    """TRL's --use_peft / ms-swift's --train_type lora with vLLM: a LoRA run with rollout.backend=vllm that the config
    accepts (the sync pushes the merged weights), use_vllm not listed as unconverted."""
    result, path = _converted(tmp_path, peer, words)
    cfg = load_config(str(path), [])
    assert (cfg.rollout.backend, cfg.rollout.vllm_mode, cfg.model.use_lora) == ("vllm", "colocate", True)
    assert not [k for k in result.unmapped if k.startswith(("use_vllm", "vllm_"))]


def test_trl_default_mode_is_server_at_its_host_and_port(tmp_path):
    """TRL's GRPOConfig: vllm_mode defaults to server, its client connects to vllm_server_host at vllm_server_port
    (default 8000) and waits vllm_server_timeout (default 240 s): the converted run is the client of a
    `vlmrl rollout-server` there."""
    result, path = _converted(tmp_path, "trl", ["--model_name_or_path", "m", "--use_vllm", "--vllm_server_host", "10.0.0.1"])
    r = load_config(str(path), []).rollout
    assert (r.backend, r.vllm_mode, r.vllm_server_host, r.vllm_server_port, r.vllm_server_timeout) == ("vllm", "server", "10.0.0.1", 8000, 240.0)
    assert not [k for k in result.unmapped if k.startswith(("use_vllm", "vllm_"))]
    assert any("vlmrl rollout-server MODEL --host 10.0.0.1 --port 8000" in note for note in result.notes)


def test_ms_swift_server_lists_are_servers_in_data_parallel(tmp_path):
    """ms-swift's --vllm_server_host / --vllm_server_port take lists (one rollout server each)."""
    args = ["--rlhf_type", "grpo", "--model", "m", "--train_type", "full", "--use_vllm", "true", "--vllm_mode", "server"]
    args += ["--vllm_server_host", "10.0.0.1", "10.0.0.2", "--vllm_server_port", "8001", "8002", "--vllm_server_timeout", "60"]
    result = convert("ms-swift", args)
    assert result.settings["rollout.vllm_servers"] == ["10.0.0.1:8001", "10.0.0.2:8002"]
    assert result.settings["rollout.vllm_server_timeout"] == 60.0


def test_easyr1_rolls_out_with_its_hybrid_vllm_at_level_1(tmp_path):
    result, path = _converted(tmp_path, "easyr1", [str(CONFIGS / "easyr1_config.yaml")])
    s = result.settings
    assert s["rollout.backend"] == "vllm" and s["rollout.vllm_sleep_level"] == 1
    assert s["rollout.vllm_gpu_memory_utilization"] == 0.6 and s["rollout.vllm_tensor_parallel_size"] == 2
    # its example plans 2560 completions a step; one GPU's share of them is what the plan here is about
    cfg, p = _plan(
        path, 8, 80, "rollout.generation_batch_size=40", "training.gradient_accumulation_steps=1", "training.per_device_train_batch_size=5"
    )
    b = {"float32": 4, "bfloat16": 2}[cfg.model.dtype]
    assert p.vllm["weights"] == 3_754_622_976 * b // 2  # TP 2 halves the copy
    assert p.host["vllm_sleeping_weights"] == 8 * p.vllm["weights"]  # level 1: one copy per process, 8 on the node


def test_the_config_takes_the_peers_vllm_names_directly(tmp_path):
    path = tmp_path / "peer.yaml"
    path.write_text(
        "rollout:\n  backend: vllm\nvllm_enable_sleep_mode: true\nvllm_tensor_parallel_size: 2\nvllm_max_model_length: 2048\n"
        "worker:\n  rollout:\n    gpu_memory_utilization: 0.55\n    n: 8\n"
    )
    r = load_config(path).rollout
    assert (r.vllm_sleep_level, r.vllm_tensor_parallel_size, r.vllm_max_model_length) == (2, 2, 2048)
    assert (r.vllm_gpu_memory_utilization, r.num_generations) == (0.55, 8)
    assert load_config(None, ["sleep_level=1", "vllm_max_model_len=1024"]).rollout.vllm_sleep_level == 1
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode=3"):
        load_config(None, ["vllm_enable_sleep_mode=3"])
    with pytest.raises(ConfigError, match="rollout.vllm_sleep_level=3"):
        load_config(None, ["rollout.vllm_sleep_level=3"])


def test_check_says_the_gpu_only_settings_are_not_applied_on_cpu():
    from vlmrl.rollout.backends import not_applied
    from vlmrl.rollout.vllm_engine import max_model_len

    cfg = load_config(None, ["rollout.backend=vllm", "sleep_level=1", "vllm_tensor_parallel_size=4", "training.device=cpu"])
    said = not_applied(cfg)
    assert "vllm_sleep_level=1" in said and "vllm_tensor_parallel_size=4" in said and "not applied on CPU" in said
    assert not_applied(load_config(None, ["rollout.backend=vllm"])) == ""
    assert max_model_len(load_config(None, ["vllm_max_model_len=3000"])) == 3000  # the engine is built with it


def _weights(path: Path, train: list[list[float]], sampled: list[list[float]]):
    import torch

    from vlmrl.algo.mismatch import ROLLOUT_CORRECTIONS

    a = load_config(path).algorithm
    t, s = torch.tensor(train, dtype=torch.float64), torch.tensor(sampled, dtype=torch.float64)
    return a, ROLLOUT_CORRECTIONS[a.rollout_correction](t, s, torch.ones_like(t), a.rollout_correction_min, a.rollout_correction_max)


def test_trl_importance_sampling_defaults_mask_sequences_whose_ratio_passes_3(tmp_path):
    """TRL with vLLM weights the loss by trainer / vLLM probability, by default per sequence, masking a sequence whose
    ratio (the product of its tokens') is above 3.0: row 0's ratio e^0.5 = 1.65 is kept, row 1's e^1.2 = 3.32 is 0."""
    import math

    result, path = _converted(tmp_path, "trl", ["--model_name_or_path", "m", "--use_vllm", "--vllm_mode", "colocate"])
    assert {"algorithm.rollout_correction", "algorithm.rollout_correction_max"} <= result.filled
    a, w = _weights(path, [[-1.0, -1.0], [-0.4, -0.4]], [[-1.2, -1.3], [-1.0, -1.0]])
    assert a.rollout_correction == "sequence_mask" and a.rollout_correction_max == 3.0
    assert w[0].tolist() == pytest.approx([math.exp(0.5)] * 2) and w[1].tolist() == [0.0, 0.0]


def test_trl_importance_sampling_mode_and_bounds_keep_their_meaning(tmp_path):
    """token_truncate with clip_max 2.0: each token's ratio, min(ratio, 2) (TRL: rho <- min(rho, C)); correction false
    is none; the config takes the mode and bounds under TRL's names too."""
    import math

    words = ["--model_name_or_path", "m", "--use_vllm", "--vllm_mode", "colocate", "--vllm_importance_sampling_mode", "token_truncate"]
    _result, path = _converted(tmp_path, "trl", [*words, "--vllm_importance_sampling_clip_max", "2.0"], "truncate")
    _a, w = _weights(path, [[-1.0, -0.1]], [[-1.2, -1.5]])
    assert w[0].tolist() == pytest.approx([math.exp(0.2), 2.0])
    off = convert("trl", [*words, "--vllm_importance_sampling_correction", "false"])
    assert off.settings["algorithm.rollout_correction"] == "none"
    cfg = load_config(None, ["vllm_importance_sampling_mode=token_mask", "vllm_importance_sampling_cap=2.5"])
    assert (cfg.algorithm.rollout_correction, cfg.algorithm.rollout_correction_max) == ("token_mask", 2.5)


def test_a_batch_size_the_script_computes_otherwise_is_refused_in_one_line(tmp_path):
    """`$(expr 16 / $n)` is evaluated as expr does (seed-003 above); a command substitution it cannot evaluate leaves a
    batch size unknown, which is refused naming the key (it used to end in a TypeError traceback)."""
    script = SEED_003.replace("$(expr 16 / $nproc_per_node)", "$(cat accumulation.txt)")
    with pytest.raises(ConfigError, match=r"training.gradient_accumulation_steps = .* computes when it runs"):
        _converted(tmp_path, "ms-swift", script)
    script = SEED_003.replace("$(expr 16 / $nproc_per_node)", "$(python -c 'print(4)')")  # nested parentheses
    with pytest.raises(ConfigError, match=r"training.gradient_accumulation_steps = .* not a whole number"):
        _converted(tmp_path, "ms-swift", script, "nested")
