"""One typed, frozen config tree: YAML + `a.b=value` overrides, validated once at load.

Names follow TRL / VLM-R1 (num_generations, per_device_train_batch_size, beta, epsilon, ...) so that
users can carry their settings over. Every field carries a one-line doc in its metadata; the README's
config reference is generated from those docs (`python -m vlmrl.config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml

from vlmrl.defaults import EMBEDDED_MODEL  # re-exported: the name other modules import from here
from vlmrl.defaults import apply_model_defaults
import re
import string
from vlmrl.defaults import config_header
import importlib
import glob
import os

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
AUTO_FIT_ALLOW = ("num_generations", "max_pixels", "effective_batch")
LOGPROB_CHUNK_TOKENS = 128  # the one default of memory.logprob_chunk_tokens, also used by direct calls of the log-prob functions


# data.format's layouts (data/formats.py reads them) and the fields data.columns may map a file's column to.
DATA_FORMATS = ("vlmrl", "trl", "conversations", "messages", "easyr1")
MAPPABLE_COLUMNS = ("problem", "solution", "image", "images", "video", "videos", "prompt", "messages", "conversations", "answer")


# algorithm.preset -> {field: (value, fields that choose the same thing)}: each value fills its field when the config
# sets neither it nor any of those fields. Applied before model.defaults, so the preset's values count as set.
ALGORITHM_PRESETS: dict[str, dict[str, tuple[Any, tuple[str, ...]]]] = {
    "vlmrl": {},
    # TRL 1.16's GRPOConfig / TrainingArguments defaults where they differ from vlmrl's (docs/vs_trl.md says why).
    "trl": {
        "algorithm.loss_aggregation": ("token_mean_rollout", ("algorithm.loss_type",)),  # TRL's loss_type=dapo
        "algorithm.use_bias_correction_kl": (True, ("algorithm.kl_estimator",)),
        "optim.adam_beta2": (0.999, ()),
        "optim.lr_scheduler_type": ("linear", ()),
    },
}


def apply_preset(tree: dict[str, dict[str, Any]]) -> list[str]:
    """Fill the fields algorithm.preset gives that the tree leaves unset (in place); returns the keys filled."""
    name = tree.get("algorithm", {}).get("preset", "vlmrl")
    filled = []
    for key, (value, alternatives) in ALGORITHM_PRESETS.get(name, {}).items():
        if any(k.split(".")[1] in tree.get(k.split(".")[0], {}) for k in (key, *alternatives)):
            continue
        section, field_name = key.split(".")
        tree.setdefault(section, {})[field_name] = value
        filled.append(key)
    return filled


class ConfigError(ValueError):
    """A config problem; the message names the field and the fix."""


def _f(default: Any, doc: str, resume_harmless: bool = False, choices: str | None = None, **kw: Any) -> Any:
    """A config field with its one-line doc. resume_harmless: changing it between a checkpoint and its resume does not
    change what is computed (where things live, how often to save / evaluate, logging), so resume does not refuse.
    choices: "module:DICT" whose keys (with each function's first docstring line) replace {choices} in the doc."""
    metadata = {"doc": doc, "resume_harmless": resume_harmless, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = _f(EMBEDDED_MODEL, "Local Hugging Face model folder, or `embedded:tiny-qwen2.5-vl` for the built-in tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "Dtype the weights are loaded in.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = _f(
        "sdpa", "Attention kernel; flash_attention_2 needs the flash-attn package."
    )
    freeze_vision_tower: bool = _f(False, "Freeze the vision encoder (the projector stays trainable).")
    train_projector_only: bool = _f(False, "Train only the vision-language projector (LLaVA-style stage 1).")
    use_lora: bool = _f(False, "Train LoRA adapters through peft instead of full weights.")
    lora_r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA scaling alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that get LoRA adapters (language model only unless lora_vision).",
    )
    lora_vision: bool = _f(False, "Also put LoRA adapters on the vision tower's linear layers.")
    lora_target_parameters: list[str] = _f(
        [],
        "Parameter names (name suffixes) that get LoRA through peft's target_parameters: the fused MoE expert weights, e.g. "
        "[mlp.experts.gate_up_proj, mlp.experts.down_proj] on Qwen3-VL-MoE / Qwen3.5-MoE.",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    trust_remote_code: bool = _f(False, "Allow model code shipped inside the model folder.")
    allow_hub_download: bool = _f(False, "Let transformers download from the hub; off means local files only.")
    defaults: Literal["auto", "tiny", "pretrained"] = _f(
        "auto",
        "Values for the fields you leave unset: tiny = the embedded model's demo-proven learning rates, lengths, batch and "
        "SFT stages (model_defaults.py); pretrained = each field's own default; auto = tiny for the embedded model "
        "(and models trained from it), else pretrained. config.yaml records the choice made.",
        resume_harmless=True,
    )


@dataclass(frozen=True)
class DataConfig:
    train_path: Union[str, list[str]] = _f(
        "",
        "Training data: .jsonl/.json/.parquet file, a pattern (data/train-*.parquet), a datasets folder (path::split), or a list of them read in order; empty = built-in task.",
    )
    eval_path: str = _f("", "Held-out data in the same format; empty = the built-in task's test split (or none).")
    task: Literal["count", "ground"] = _f("count", "Built-in synthetic task generated when train_path is empty.")
    task_train_size: int = _f(512, "Rows generated for the built-in task's train split.")
    task_test_size: int = _f(128, "Rows generated for the built-in task's test split.")
    task_image_size: int = _f(56, "Side in pixels of the built-in task's images.")
    task_distractors: bool = _f(True, "count task: add shapes of other colours that must not be counted.")
    task_colours: list[str] = _f(["red", "green", "blue"], "Colours the built-in tasks draw and ask about.")
    min_pixels: int = _f(28 * 28, "Images smaller than this many pixels are upscaled (aspect kept).")
    max_pixels: int = _f(448 * 448, "Images larger than this many pixels are downscaled (aspect kept).")
    limit_images: int = _f(4, "Most images kept per row; extra images are dropped and counted.")
    max_image_pixels: int = _f(89_478_485, "Images with more pixels (read from the header, before decoding) are bad rows; default PIL's bomb guard.")
    image_cache_mb: float = _f(
        1024.0, "MiB of decoded, resized images kept between steps instead of decoded again; 0 = no cache.", resume_harmless=True
    )
    max_frames: int = _f(16, "Video rows: most frames sampled per video (rounded down to an even count: Qwen-VL's temporal patch is 2 frames).")
    fps: float = _f(
        2.0, "Video rows: frames sampled per second of video (fewer when max_frames caps them); a list of frame files counts as this rate."
    )
    video_max_pixels: int = _f(
        128 * 28 * 28, "Video rows: frames larger than this many pixels are downscaled (aspect kept); bounds the tokens per frame."
    )
    skip_bad_rows: bool = _f(False, "Skip (and count) bad rows instead of stopping with their list.")
    system_prompt: Optional[str] = _f(None, "System message put before every prompt (rows with their own system turn keep theirs).")
    format: str = _f(
        "auto",
        "Layout of the data files: auto (recognised from the columns), vlmrl, trl, conversations (VLM-R1 / LLaVA), messages "
        "(ms-swift), easyr1; `vlmrl check` names the one it read.",
    )
    columns: dict[str, str] = _f(
        {}, "Your column for each field vlmrl reads, e.g. {problem: question, solution: answer} (or data.columns.problem=question)."
    )
    image_root: Union[str, list[str]] = _f(
        "",
        "Folder(s) relative image paths resolve against (EasyR1's image_dir); one per data file of a train_path list, in order (VLM-R1's --image_folders); empty = the data file's folder.",
    )
    prompt_template: Optional[str] = _f(
        None, "Jinja template (or a .jinja file) applied to each prompt's text as `content` (EasyR1's data.format_prompt)."
    )
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded).")
    max_prompt_length: Optional[int] = _f(
        None,
        "Prompt budget in tokens (image tokens included; default: the model's context, max_position_embeddings): a longer row is refused by check and train naming it, or dropped with skip_bad_rows; never cut (that would cut image tokens).",
    )


@dataclass(frozen=True)
class RolloutConfig:
    num_generations: int = _f(4, "Completions sampled per prompt (G).")
    generation_batch_size: Optional[int] = _f(
        None, "Completions per rollout step; default per_device_train_batch_size x gradient_accumulation_steps."
    )
    max_completion_length: int = _f(32, "Most tokens generated per completion.")
    temperature: float = _f(1.0, "Sampling temperature (also used when scoring log-probs).")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    top_k: int = _f(0, "Top-k sampling; 0 disables it.")
    min_completion_length: int = _f(
        0, "EOS is not sampled before this many tokens (= max_completion_length forces equal-length completions, e.g. for benchmarks)."
    )
    sampling_seed: Literal["auto", "step", "prompt"] = _f(
        "auto",
        "Rollout randomness: step = one stream per step; prompt = one stream per prompt from (seed, step, its position in the global batch), so samples do not depend on the number of processes (one generate call per prompt); auto = step on one process, prompt on several (a resume keeps its checkpoint's choice).",
    )
    engine: Literal["loop", "continuous"] = _f(
        "loop",
        "Decode loop (with memory.shared_prefix): loop = all rows of a call decode until the longest ends; continuous = at most decode_batch_size rows in flight in a preallocated KV cache, a row leaves at EOS and a queued prompt's row takes its slot, each row sampled from its own stream (seeded by step, prompt position, generation), so samples do not depend on batch size, order or the number of processes (sampling_seed is not used).",
    )
    decode_batch_size: int = _f(0, "Rows decoded together by rollout.engine=continuous (0 = all of a call's rows).")
    decode_step: Literal["dynamic", "static", "cuda_graph"] = _f(
        "dynamic",
        "Decode step of rollout.engine=continuous: dynamic = shapes follow the active rows; static = fixed batch buckets (powers of two) over every cache column, same tokens; cuda_graph = static, each bucket captured once as a CUDA graph and replayed (CUDA only).",
    )
    steps_per_generation: Optional[int] = _f(
        None,
        "TRL's name for the generation batch: per_device_train_batch_size x this many completions per rollout step (instead of generation_batch_size).",
    )
    backend: Literal["inprocess", "vllm"] = _f(
        "inprocess",
        "Who samples the rollouts: inprocess = vlmrl's own decode loop on the trained model (rollout.engine); vllm = a vLLM engine colocated in the training process (its CPU or GPU build installed: `make test-vllm`), weights pushed to it after every update and every sample's prompt checked against the trainer's (TRL: use_vllm).",
    )
    vllm_mode: Literal["colocate", "server"] = _f(
        "colocate",
        "rollout.backend=vllm: colocate = one vLLM engine inside each training process; server = vLLM in a `vlmrl rollout-server` process (other devices or nodes; rollout.vllm_server_host/port), weights pushed to it over a process group of their own (TRL: vllm_mode).",
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "rollout.backend=vllm: the share of the device's memory vLLM reserves for its weights and KV cache (on CPU: of the host memory of the first NUMA node).",
    )
    # vLLM's other settings under the peers' names (TRL / ms-swift / EasyR1 spell them so; config.VLLM_ALIASES)
    vllm_sleep_level: int = _f(
        0,
        "rollout.backend=vllm on GPU: vLLM sleeps during scoring and the update: 0 = never, 1 = weights to host RAM and KV cache freed, 2 = both discarded (ms-swift: sleep_level; TRL's vllm_enable_sleep_mode is level 2); the planner counts it; not applied on CPU (vLLM refuses sleep there).",
    )
    vllm_tensor_parallel_size: int = _f(
        1,
        "rollout.backend=vllm on GPU: ranks one vLLM engine's weights and KV heads are split over (TRL / ms-swift: vllm_tensor_parallel_size, EasyR1: tensor_parallel_size); the planner counts it; only 1 runs (each training process has one single-rank engine, yet).",
    )
    vllm_max_model_length: Optional[int] = _f(
        None,
        "rollout.backend=vllm: vLLM's max_model_len, prompt + completion tokens (TRL: vllm_max_model_length, ms-swift: vllm_max_model_len, EasyR1: max_model_len); null = data.max_prompt_length + rollout.max_completion_length, or the model's context.",
    )
    vllm_server_host: str = _f(
        "127.0.0.1",
        "rollout.vllm_mode=server: the host of the rollout server (`vlmrl rollout-server --host`; TRL: vllm_server_host).",
        resume_harmless=True,
    )
    vllm_server_port: int = _f(
        8000,
        "rollout.vllm_mode=server: its port (`vlmrl rollout-server --port`; TRL: vllm_server_port); the weights go over its --group-port.",
        resume_harmless=True,
    )
    vllm_server_timeout: float = _f(
        240.0,
        "rollout.vllm_mode=server: seconds to wait for the server to answer at start and for each reply after (a dead or silent server then ends the run in one line; TRL: vllm_server_timeout).",
        resume_harmless=True,
    )
    max_staleness: int = _f(
        0,
        "Rollouts of the next steps are sampled while this step updates, by at most this many policy versions behind (a producer process with its own copy of the policy; step s samples with the weights after step s-1-k); 0 = the synchronous loop (AReaL: max_head_offpolicyness; Tinker: sampling_steps_ahead).",
    )
    vllm_servers: list[str] = _f(
        [],
        "rollout.vllm_mode=server: several rollout servers in data parallel, as host:port each (every rollout's prompts split among them in order, weights pushed to all); empty = the one at vllm_server_host:vllm_server_port.",
        resume_harmless=True,
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    preset: Literal["vlmrl", "trl"] = _f(
        "vlmrl",
        "Defaults for the algorithm and optimizer fields you leave unset: vlmrl = each field's own; trl = TRL 1.16's GRPOConfig "
        "(config.ALGORITHM_PRESETS: loss_type dapo with TRL's normaliser, use_bias_correction_kl, AdamW beta2 0.999, linear schedule), so a migrating run gets TRL's math.",
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = _f(
        "grpo",
        "TRL's name for the token aggregation: grpo (per-sequence mean), dapo (per-token mean), dr_grpo (sum / max length), bnpo (token mean per micro-batch); see loss_aggregation.",
    )
    beta: float = _f(0.0, "Weight of the KL to the reference policy (kl_estimator); 0 loads no reference.")
    kl_estimator: Optional[str] = _f(
        None,
        "Per-token KL estimator added with weight beta: {choices}; default k3, or the one use_bias_correction_kl names.",
        choices="algo.losses:KL_ESTIMATORS",
    )
    use_bias_correction_kl: Optional[bool] = _f(
        None,
        "TRL's name: true = k3 times the importance ratio of the policy loss (TRL 1.16's default): kl_estimator k3_ratio, k3_seq_ratio with policy_loss=gspo; false = k3.",
    )
    epsilon: float = _f(0.2, "Lower clip range of the importance ratio.")
    epsilon_high: Optional[float] = _f(
        None,
        "Upper clip range (DAPO clip-higher); default epsilon. cispo caps its weight at 1 + epsilon_high (TRL's cispo epsilon_high is the cap itself).",
    )
    delta: Optional[float] = _f(
        None, "ppo_clip, gspo: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta (> 1 + epsilon_high); null = off."
    )
    sapo_temperature_pos: float = _f(1.0, "sapo: gate temperature for tokens with a positive advantage.")
    sapo_temperature_neg: float = _f(1.05, "sapo: gate temperature for tokens with a zero or negative advantage.")
    num_iterations: int = _f(
        1, "Updates per rollout (mu); old log-probs are scored once per rollout when > 1 or when the rollout spans several optimizer steps."
    )
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "TRL's name for the advantage scaling: divide by the group std, the batch std, or nothing (Dr.GRPO); see advantage_estimator."
    )
    advantage_estimator: Optional[str] = _f(
        None, "Advantages: {choices}; default follows scale_rewards.", choices="algo.advantages:ADVANTAGE_ESTIMATORS"
    )
    turn_advantage: Literal["trajectory", "per_turn"] = _f(
        "trajectory",
        "Multi-turn rollouts (tools.tools): trajectory = every token gets its rollout's advantage; per_turn = each turn's "
        "discounted return (the environment's step rewards, the rollout's reward on the last turn) normalised over all turns "
        "of the group, each token the advantage of its turn (ROLL step_reinforce; algo/turn_advantages.py).",
    )
    turn_discount: float = _f(1.0, "turn_advantage=per_turn: the discount gamma in G_t = r_t + gamma * G_{t+1}, in [0, 1].")
    policy_loss: str = _f("ppo_clip", "Per-token policy loss: {choices}.", choices="algo.losses:POLICY_LOSSES")
    loss_aggregation: Optional[str] = _f(
        None,
        "How token losses become the step's loss: {choices}; default follows loss_type (cispo: always token_mean).",
        choices="algo.losses:AGGREGATIONS",
    )
    rollout_correction: str = _f(
        "none",
        "Importance-sampling correction for the rollout-training mismatch (trainer / sampler probability per token, "
        "algo/mismatch.py): none, {choices}; scores old log-probs every step.",
        choices="algo.mismatch:ROLLOUT_CORRECTIONS",
    )
    rollout_correction_min: Optional[float] = _f(
        None, "rollout_correction: lower bound of the ratio (truncate: clamp; mask: drop below); null = none."
    )
    rollout_correction_max: Optional[float] = _f(
        3.0, "rollout_correction: upper bound of the ratio (truncate: clamp; mask: drop above); null = none."
    )
    mask_truncated_completions: bool = _f(
        False,
        "Leave completions that hit max_completion_length out of the loss (DAPO's overlong filtering; ms-swift's overlong_filter).",
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO dynamic sampling: drop groups whose dynamic_sampling_metric is equal across the group and sample further prompts until the batch is full (verl filter_groups.enable, EasyR1 online_filtering, ms-swift dynamic_sample).",
    )
    dynamic_sampling_metric: str = _f(
        "reward",
        "dynamic_sampling: the per-completion value whose spread keeps a group: reward (the weighted total) or the name of one of reward_funcs (verl filter_groups.metric: score -> reward, acc -> accuracy).",
    )
    dynamic_sampling_max_batches: int = _f(
        10,
        "dynamic_sampling: most generation batches per step, the first included; when they run out the step trains on the kept groups topped up with filtered ones, and says so (verl max_num_gen_batches, EasyR1 max_try_make_batch).",
    )
    overlong_shaping: bool = _f(
        False,
        "DAPO soft overlong punishment: add the reward term `overlong`, 0 up to max_completion_length - overlong_buffer_len tokens, then falling linearly to -overlong_penalty_factor at max_completion_length (verl reward_model.overlong_buffer.enable).",
    )
    overlong_buffer_len: int = _f(
        0,
        "overlong_shaping: the buffer L_cache, in tokens, before rollout.max_completion_length (L_max) where the penalty grows (verl overlong_buffer.len).",
    )
    overlong_penalty_factor: float = _f(
        1.0, "overlong_shaping: the penalty at max_completion_length, the weight of the `overlong` reward term (verl overlong_buffer.penalty_factor)."
    )
    top_entropy_quantile: float = _f(
        1.0,
        "TRL's name: the policy loss keeps only the top fraction of each optimizer step's loss tokens by policy entropy "
        "(Beyond the 80/20 rule: 0.2); 1.0 = off. Entropies come from the scoring pass, so < 1 scores every rollout.",
    )
    routing_replay: Literal["off", "experts", "experts_and_weights"] = _f(
        "off",
        "MoE models: replay the rollout's expert choices in the scoring and update forwards (Rollout Routing Replay): "
        "experts = its top-k experts, weights recomputed by the current router (it still learns); experts_and_weights = "
        "its weights too. Needs rollout.engine=loop and memory.shared_prefix=true.",
    )
    router_aux_loss_coef: float = _f(
        0.0,
        "MoE models: weight of the router load-balancing loss added to the update's loss (router/aux_loss is logged "
        "whatever it is; 0 adds nothing, as TRL does unless output_router_logits is set; transformers' models use 0.001).",
    )
    teacher_path: Optional[str] = _f(
        None,
        "On-policy distillation: a frozen teacher model folder (any family, the policy's tokenizer) that scores the policy's "
        "sampled tokens; each token's advantage gets -distill_coef x (log pi - log pi_teacher) (reverse KL); null = off.",
    )
    distill_coef: float = _f(
        1.0, "teacher_path: weight of the per-token reverse KL in the advantage (slime's --opd-kl-coef, Tinker's kl_penalty_coef)."
    )
    distill_with_rewards: bool = _f(
        True,
        "teacher_path: add the distillation term to the rewards' advantages (slime); false = the teacher's signal alone "
        "(Thinking Machines' on-policy distillation; TRL GKD with lmbda=1, beta=1). Rewards are still computed and logged.",
    )
    reward_funcs: list[str] = _f(["accuracy", "answer_format"], "Rewards: built-in names or path/to/file.py:function.")
    reward_weights: Optional[list[float]] = _f(None, "One weight per reward function; default all 1.")
    reward_timeout_s: float = _f(
        600.0,
        "Seconds one reward function may take on one batch before the run stops with an error naming it (0: no limit); "
        "SIGALRM in the main thread, so a reward that sets its own alarm (math_verify) suspends this one during it.",
        resume_harmless=True,
    )
    completion_format: Literal["auto", "text", "conversational"] = _f(
        "auto",
        "Completions and prompts handed to rewards: text (strings) or conversational (TRL's chat messages, as VLM-R1 rewards "
        "read them: completion[0]['content']); auto = conversational when the data's prompts are chat messages or data.system_prompt is set, as TRL does; built-in rewards take both.",
    )


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = _f(1e-6, "Peak learning rate of AdamW.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.99, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = _f("constant", "Schedule after warmup.")
    warmup_ratio: float = _f(0.0, "Fraction of optimizer steps spent in linear warmup.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm; 0 disables clipping.")


@dataclass(frozen=True)
class TrainingConfig:
    output_dir: str = _f("outputs/run", "Folder for metrics, samples, report and the final model.", resume_harmless=True)
    max_steps: int = _f(100, "Rollout steps to train for.", resume_harmless=True)
    num_train_epochs: Optional[float] = _f(
        None,
        "Passes over the training rows (TRL's num_train_epochs); when set it decides max_steps = ceil(epochs x rows / prompts per step), logged at the start.",
        resume_harmless=True,
    )
    per_device_train_batch_size: int = _f(4, "Sequences (completions) per forward/backward micro-batch.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches accumulated per optimizer step.")
    seed: int = _f(0, "Seed for data order, sampling and initialisation.")
    bf16: bool = _f(False, "bfloat16 autocast for forward passes (CPU and GPU).")
    device: str = _f("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N.", resume_harmless=True)
    eval_steps: int = _f(0, "Evaluate every this many steps; 0 = only at the end.", resume_harmless=True)
    val_before_train: bool = _f(False, "Evaluate once before the first step.", resume_harmless=True)
    eval_batch_size: int = _f(16, "Prompts per greedy-decoding batch in evaluation.", resume_harmless=True)
    eval_max_samples: Optional[int] = _f(None, "Cap on held-out rows evaluated; default all.", resume_harmless=True)
    save_final_model: bool = _f(True, "Save the trained model as a plain HF folder in output_dir/final.", resume_harmless=True)
    max_nonfinite_steps: int = _f(
        5,
        "Stop (with a checkpoint of the last good state) after this many optimizer steps in a row skipped for a non-finite reward, loss or gradient; 0 = never stop.",
        resume_harmless=True,
    )
    save_steps: int = _f(0, "Write a full-state checkpoint every this many steps; 0 = only at a graceful stop.", resume_harmless=True)
    save_minutes: float = _f(
        30.0,
        "Also write a checkpoint when this many minutes have passed since the last one, so a fault or kill loses at most that much; 0 = off.",
        resume_harmless=True,
    )
    save_total_limit: Optional[int] = _f(None, "Keep at most this many checkpoints (never the newest valid nor the best).", resume_harmless=True)
    save_only_model: bool = _f(False, "Checkpoints hold weights only (no optimizer/RNG); such a run cannot be resumed exactly.", resume_harmless=True)
    resume: str = _f("auto", "auto (newest valid checkpoint in output_dir), never, or a checkpoint path.", resume_harmless=True)
    overwrite_output_dir: bool = _f(
        False,
        "Delete an earlier vlmrl run in output_dir and start over (refused when the folder holds files vlmrl did not "
        "write); off: a complete run is reported complete (exit 0), an unfinished one resumes.",
        resume_harmless=True,
    )
    resume_force: bool = _f(False, "Resume even when the config changed in ways that break equivalence.", resume_harmless=True)
    resume_weights_only: bool = _f(False, "Start a new schedule from a weights-only checkpoint's weights.", resume_harmless=True)
    on_save_error: Literal["stop", "continue"] = _f("stop", "After a failed checkpoint write: stop the run, or warn and go on.", resume_harmless=True)
    metric_for_best: str = _f("eval/accuracy", "Eval metric (higher is better) that marks the best checkpoint.", resume_harmless=True)
    auto_fit: bool = _f(
        False,
        "Before the run, let the memory planner pick the fastest config predicted to fit (every change is logged; see docs/planner.md).",
        resume_harmless=True,
    )
    auto_fit_allow: list[str] = _f(
        [],
        "What auto_fit may change beyond memory switches: any of num_generations, max_pixels, effective_batch (default none).",
        resume_harmless=True,
    )
    auto_fit_gpu_memory_gib: Optional[float] = _f(
        None, "Device memory auto_fit plans for, GiB; null = the CUDA device's capacity (required on CPU).", resume_harmless=True
    )
    auto_fit_host_memory_gib: Optional[float] = _f(
        None, "Host RAM per node, GiB: auto_fit keeps configs that fit it; null = no host check.", resume_harmless=True
    )
    sequence_parallel_size: int = _f(
        1,
        "Ulysses sequence parallelism: processes that split one row's sequence (verl/EasyR1 ulysses_sequence_parallel_size, ms-swift sequence_parallel_size); `vlmrl train` runs it with the value = the number of processes (DDP; Qwen2.5-VL, Qwen2-VL, Qwen3-VL); 1 = off (docs/scaling_out.md).",
    )


@dataclass(frozen=True)
class SFTConfig:
    projector_steps: int = _f(0, "Stage 1 steps: train the projector only (0 skips the stage).")
    projector_learning_rate: float = _f(1e-3, "Learning rate of stage 1.")
    steps: int = _f(100, "Stage 2 steps: train the language model (and projector).")
    learning_rate: float = _f(2e-5, "Learning rate of stage 2.")
    train_vision_tower: bool = _f(False, "Also train the vision tower in stage 2.")
    batch_size: int = _f(8, "Rows per SFT optimizer step, over every process (the effective batch).")
    micro_batch_size: Optional[int] = _f(
        None,
        "Rows per forward/backward on each process; gradients accumulate over batch_size / (processes x this) micro-batches (null: a process's whole share at once).",
        resume_harmless=True,
    )
    epochs: Optional[float] = _f(None, "Stage 2 length in passes over the training data (ceil(epochs x rows / batch_size) steps); null: sft.steps.")


@dataclass(frozen=True)
class MemoryConfig:
    ref_placement: Literal["device", "cpu"] = _f(
        "device",
        "Full fine-tuning with beta > 0: keep the reference copy on the device, or on the CPU and move it in only for scoring (LoRA always uses the adapter-disabled model).",
        resume_harmless=True,
    )
    oom_recovery: bool = _f(True, "On out-of-memory, halve the micro-batch (or generation batch) and redo the same work.", resume_harmless=True)
    generation_prompts_per_call: Optional[int] = _f(
        None, "Prompts per generate() call in rollout; default all prompts of the step.", resume_harmless=True
    )
    scoring_micro_batch_size: Optional[int] = _f(
        None,
        "Rows (or tokens with max_tokens_per_micro_batch) per no-grad scoring micro-batch (old / reference log-probs); default the update's size.",
        resume_harmless=True,
    )
    max_tokens_per_micro_batch: Optional[int] = _f(
        None, "Pack scoring/update micro-batches by tokens (rows x padded length) instead of per_device_train_batch_size rows."
    )
    logprob_chunk_tokens: int = _f(
        LOGPROB_CHUNK_TOKENS,
        "Tokens per LM-head chunk when computing log-probs (bounds the logits block); 0 = one full block kept for backward (off).",
        resume_harmless=True,
    )
    group_vision: bool = _f(
        True, "Scoring and update encode each unique prompt's images once per forward (off: once per completion row).", resume_harmless=True
    )
    shared_prefix: bool = _f(
        True,
        "Process each prompt once per group: prefill once and share its KV cache across the G samples in rollout and scoring (and in the update when gradient checkpointing is off).",
        resume_harmless=True,
    )
    warn_fraction: float = _f(0.9, "Warn when a step's GPU peak passes this fraction of the device memory.", resume_harmless=True)
    offload_optimizer_during_rollout: bool = _f(
        False,
        "Park the optimizer states in host memory during rollout and scoring (back before the update; bit-exact): more room for generation, two copies per step.",
        resume_harmless=True,
    )
    generation_gather: Literal["full", "layers"] = _f(
        "full",
        "FSDP2 full shard / ZeRO-3 rollout: full = gather all parameters once for the rollout (holds the whole model per process, fast); layers = one layer per forward (holds one layer, an all-gather per layer per token).",
        resume_harmless=True,
    )


@dataclass(frozen=True)
class LoggingConfig:
    logging_steps: int = _f(1, "Write TensorBoard scalars every this many steps (metrics.jsonl gets every step).")
    tensorboard: bool = _f(True, "Write TensorBoard event files under output_dir/tb.")
    report_to: Union[list[str], str] = _f(
        ["tensorboard"], "Trackers (TRL's report_to): tensorboard, wandb (WANDB_MODE=offline honoured), mlflow, all, none."
    )
    progress_bar: bool = _f(True, "Show a live progress bar.")
    log_completions: int = _f(4, "Completions per step written to samples.jsonl.")
    report: bool = _f(True, "Draw output_dir/report.png at the end.")
    no_signal_warn_steps: int = _f(5, "Warn when every group's rewards are equal (no gradient) for this many steps in a row; 0 = never.")


@dataclass(frozen=True)
class ToolsConfig:
    tools: list[str] = _f(
        [],
        "Tools the model may call (multi-turn rollouts, rollout.engine=continuous): built-in crop, zoom, rotate, path/to/file.py:function or module:function; empty = single-turn.",
    )
    max_turns: int = _f(4, "Most assistant turns per rollout; the calls of the last allowed turn still run, then the rollout ends (max_turns).")
    max_turn_tokens: int = _f(
        0, "Most tokens generated per assistant turn (a longer turn ends the rollout: turn_tokens); 0 = rollout.max_completion_length."
    )
    max_total_tokens: int = _f(
        1024,
        "Most tokens after the prompt: every turn, the template's glue and every tool turn, image tokens included (a row that would pass it ends: total_tokens).",
    )
    max_images: int = _f(8, "Most images per rollout, the row's included; a tool call that would pass it ends the rollout (image_budget).")
    timeout_s: float = _f(10.0, "Seconds one tool call may run; then the model is shown a timeout error (the call's thread cannot be killed).")
    workers: int = _f(4, "Threads running tool calls, while the other rows keep decoding.")
    max_calls_per_turn: int = _f(8, "Most tool calls run per assistant turn; later calls of the turn are not run and the model is told so.")
    max_image_pixels: int = _f(16_777_216, "A tool image with more pixels is scaled down to this many before any tool or the model sees it.")
    environment: str = _f(
        "",
        "Environment class per rollout: path/to/file.py:Class or module:Class, a ToolEnvironment subclass or a TRL "
        "environment_factory class (its public methods are the tools); empty = ToolEnvironment over tools.tools.",
    )


JUDGE_TEMPLATE = (
    "Grade the answer to a question about the image(s).\nQuestion: {question}\nReference solution: {solution}\n"
    "Answer to grade: {completion}\nReply with one line 'Score: N', N an integer from 0 (wrong) to 10 (fully correct)."
)
JUDGE_FIELDS = ("question", "completion", "solution")


@dataclass(frozen=True)
class JudgeConfig:
    model_path: Optional[str] = _f(
        None,
        "The reward `judge` (algorithm.reward_funcs) in-process: a model folder of any family vlmrl loads, frozen, greedy; set this or url.",
    )
    url: Optional[str] = _f(
        None,
        "The reward `judge` served: an OpenAI-compatible base URL (vllm serve's http://host:8000/v1); POST {url}/chat/completions, images as base64 data URLs.",
    )
    served_model: Optional[str] = _f(None, "url: the `model` sent with each request; null = the first id GET {url}/models lists.")
    api_key_env: Optional[str] = _f(None, "url: the environment variable holding the server's API key (sent as a Bearer token); null = none.")
    template: str = _f(
        JUDGE_TEMPLATE,
        "The judge's user message after the row's images; {question}, {completion} and {solution} are filled in (write {{ }} for a brace).",
    )
    score_pattern: str = _f(
        r"(?i)score\W{0,5}?([+-]?\d+(?:\.\d+)?)",
        "Regex whose first group is the score in the judge's reply (the last match counts); a reply without one is unparseable.",
    )
    score_min: float = _f(0.0, "The score the template asks for that means worst; maps to reward 0.")
    score_max: float = _f(10.0, "The score that means best; maps to reward 1 (a score outside [score_min, score_max] is unparseable).")
    fallback_score: float = _f(
        0.0, "The reward of a completion whose judgement is unparseable, timed out or failed (counted in judge/fallbacks, one log line each)."
    )
    max_new_tokens: int = _f(64, "Most tokens of one judgement.")
    batch_size: int = _f(8, "Judgements per generate call (model_path) or requests in flight at once (url).")
    timeout_s: float = _f(60.0, "Seconds one judgement may take: a generate call (model_path, transformers' max_time) or one request (url).")
    retries: int = _f(2, "url: further tries of a request that failed or timed out before the fallback score is used.")
    cache_size: int = _f(
        4096, "Judgements kept per process, keyed by (prompt, completion, solution, image fingerprints), least recently used dropped; 0 = no cache."
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    # Derived values, so the loop never recomputes defaults itself.
    @property
    def generation_batch_size(self) -> int:
        r, t = self.rollout, self.training
        if r.steps_per_generation is not None:
            return t.per_device_train_batch_size * r.steps_per_generation
        return r.generation_batch_size or t.per_device_train_batch_size * t.gradient_accumulation_steps

    @property
    def multiturn(self) -> bool:
        """Rollouts are multi-turn with tools (tools.tools or tools.environment is set)."""
        return bool(self.tools.tools or self.tools.environment)

    @property
    def max_turn_tokens(self) -> int:
        return self.tools.max_turn_tokens or self.rollout.max_completion_length

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.rollout.num_generations

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps one pass over a rollout takes (rollout.generation_batch_size / rows of one optimizer step)."""
        t = self.training
        return self.generation_batch_size // (t.per_device_train_batch_size * t.gradient_accumulation_steps)

    @property
    def reuses_rollout(self) -> bool:
        """Some optimizer step uses rows sampled before the policy last changed (a rollout spanning several optimizer
        steps, num_iterations > 1, or both): the update then needs the sampling policy's (old) log-probs."""
        return self.algorithm.num_iterations * self.optimizer_steps_per_rollout > 1

    @property
    def scores_old_logps(self) -> bool:
        """The scoring pass computes old log-probs: the rollout is reused, or the rollout correction compares them with
        the sampler's."""
        a = self.algorithm
        # distillation compares the sampling policy's log-probs with the teacher's
        return self.reuses_rollout or a.rollout_correction != "none" or a.top_entropy_quantile < 1.0 or a.teacher_path is not None

    @property
    def advantage_estimator(self) -> str:
        """algorithm.advantage_estimator, or the one TRL's scale_rewards names."""
        from vlmrl.algo.advantages import SCALE_REWARDS_ESTIMATOR

        return self.algorithm.advantage_estimator or SCALE_REWARDS_ESTIMATOR[self.algorithm.scale_rewards]

    @property
    def loss_aggregation(self) -> str:
        """The one the policy loss fixes (cispo: token_mean), else algorithm.loss_aggregation, else the one TRL's
        loss_type names."""
        from vlmrl.algo.losses import LOSS_TYPE_AGGREGATION, POLICY_LOSS_AGGREGATION

        a = self.algorithm
        fixed = POLICY_LOSS_AGGREGATION.get(a.policy_loss)
        if fixed:
            return a.loss_aggregation if a.loss_aggregation in fixed else fixed[0]
        return a.loss_aggregation or LOSS_TYPE_AGGREGATION[a.loss_type]

    @property
    def kl_estimator(self) -> str:
        """algorithm.kl_estimator (aliases resolved), or the one TRL's use_bias_correction_kl names (default k3)."""
        from vlmrl.algo.losses import kl_estimator_name

        return kl_estimator_name(self.algorithm)

    @property
    def epsilon_high(self) -> float:
        a = self.algorithm
        return a.epsilon if a.epsilon_high is None else a.epsilon_high


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "optim": OptimConfig,
    "training": TrainingConfig,
    "sft": SFTConfig,
    "memory": MemoryConfig,
    "logging": LoggingConfig,
    "tools": ToolsConfig,
    "judge": JudgeConfig,
}


# ---------------------------------------------------------------- type checking
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return f"dict[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _float(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return _NO


_NO = object()  # "does not fit this type"
# Scalar annotation -> the value as that type, or _NO. bool is not an int here, ints are floats.
_SCALARS: dict[Any, Callable[[Any], Any]] = {
    bool: lambda v: v if isinstance(v, bool) else _NO,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _NO,
    float: _float,
    str: lambda v: v if isinstance(v, str) else _NO,
    type(None): lambda v: None if v is None else _NO,
}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats. Returns the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: {value!r} is not one of {_type_name(tp)}{hint}")
    elif origin is dict:
        if isinstance(value, dict):
            key_tp, value_tp = typing.get_args(tp)
            return {_coerce(k, key_tp, where): _coerce(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item_tp,) = typing.get_args(tp)
            return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    elif tp in _SCALARS:
        result = _SCALARS[tp](value)
        if result is not _NO:
            return result
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _closest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(candidates))}"


def _all_field_names() -> dict[str, list[str]]:
    """Flat field name -> sections that define it (for TRL-style un-sectioned keys)."""
    out: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            out.setdefault(f.name, []).append(section)
    return out


# Names TRL (and VLM-R1 / ms-swift, which take TRL's arguments) gives settings that vlmrl names otherwise.
TRL_ALIASES = {
    "model_name_or_path": "model.name_or_path",
    "use_peft": "model.use_lora",
    "num_train_epochs": "training.num_train_epochs",
    "max_prompt_length": "data.max_prompt_length",
    "steps_per_generation": "rollout.steps_per_generation",
    "eval_strategy": "training.eval_steps",
    "save_strategy": "training.save_steps",
    "use_vllm": "rollout.backend",
}
# Peers' names for DAPO's settings (dotted as in their YAML / command line) -> vlmrl key (None: nothing to set).
PEER_ALIASES: dict[str, str | None] = {
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling",  # verl
    "algorithm.filter_groups.metric": "algorithm.dynamic_sampling_metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.dynamic_sampling_max_batches",
    "algorithm.online_filtering": "algorithm.dynamic_sampling",  # EasyR1
    "trainer.max_try_make_batch": "algorithm.dynamic_sampling_max_batches",
    "dynamic_sample": "algorithm.dynamic_sampling",  # ms-swift
    "max_resample_times": "algorithm.dynamic_sampling_max_batches",
    "overlong_filter": "algorithm.mask_truncated_completions",
    "reward_model.overlong_buffer.enable": "algorithm.overlong_shaping",  # verl
    "reward_model.overlong_buffer.len": "algorithm.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_penalty_factor",
    "reward_model.overlong_buffer.log": None,  # vlmrl always logs the term (rewards/overlong)
    # Ulysses sequence parallelism (ms-swift's flat sequence_parallel_size is vlmrl's own field name).
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "training.sequence_parallel_size",  # verl
    "worker.actor.ulysses_size": "training.sequence_parallel_size",  # EasyR1
    "worker.actor.ulysses_sequence_parallel_size": "training.sequence_parallel_size",  # EasyR1 before ulysses_size
    "ulysses_sequence_parallel_size": "training.sequence_parallel_size",  # the flat name of both
    "rollout.max_head_offpolicyness": "rollout.max_staleness",  # AReaL
}
# The peers' names for vLLM's settings that vlmrl's fields do not already carry (TRL's vllm_mode,
# vllm_gpu_memory_utilization and vllm_tensor_parallel_size are the fields' own names): TRL, ms-swift, EasyR1.
VLLM_ALIASES: dict[str, str | None] = {
    "vllm_enable_sleep_mode": "rollout.vllm_sleep_level",  # TRL: true sleeps at level 2 (its GRPOTrainer calls sleep(level=2))
    "sleep_level": "rollout.vllm_sleep_level",  # ms-swift
    "vllm_max_model_len": "rollout.vllm_max_model_length",  # ms-swift
    "worker.rollout.gpu_memory_utilization": "rollout.vllm_gpu_memory_utilization",  # EasyR1
    "worker.rollout.tensor_parallel_size": "rollout.vllm_tensor_parallel_size",
    "worker.rollout.max_model_len": "rollout.vllm_max_model_length",
    "worker.rollout.n": "rollout.num_generations",
    "worker.rollout.temperature": "rollout.temperature",
    "worker.rollout.top_p": "rollout.top_p",
    "worker.rollout.limit_images": "data.limit_images",
    # TRL's correction of the vLLM / trainer mismatch: vlmrl's rollout_correction takes its mode names; the ratio's
    # bounds are clip_min / clip_max (cap: TRL's earlier name of clip_max). Its on/off switch is vlmrl convert's.
    "vllm_importance_sampling_mode": "algorithm.rollout_correction",
    "vllm_importance_sampling_cap": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_max": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_min": "algorithm.rollout_correction_min",
}
PEER_ALIASES.update(VLLM_ALIASES)


def _vllm_value(name: str, value: Any, source: str) -> Any:
    """A vLLM alias's value as vlmrl's field takes it: TRL's sleep switch as a level; EasyR1's limit 0 (no limit)."""
    if name == "vllm_enable_sleep_mode":
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: vllm_enable_sleep_mode={value!r}: expected true or false (or set rollout.vllm_sleep_level 0, 1 or 2)")
        return 2 if value else 0
    if name == "worker.rollout.limit_images" and value == 0:
        raise ConfigError(
            f"{source}: worker.rollout.limit_images=0 means no limit in EasyR1; vlmrl keeps data.limit_images images a row: give it (e.g. 4)"
        )
    return value


# verl's filter_groups.metric names for the values vlmrl's rewards have.
VERL_METRICS = {"acc": "accuracy", "score": "reward", "seq_reward": "reward", "seq_final_reward": "reward"}


def _peer_value(name: str, value: Any, source: str) -> Any:
    """A peer alias's value as vlmrl's field takes it; an unbounded count of generation batches is refused."""
    if name in VLLM_ALIASES:
        return _vllm_value(name, value, source)
    if name == "algorithm.filter_groups.metric" and value in VERL_METRICS:
        return VERL_METRICS[value]
    if name == "max_resample_times" and isinstance(value, int) and value <= 0:
        raise ConfigError(f"{source}: max_resample_times={value} filters no group in ms-swift; set dynamic_sample=false instead")
    if PEER_ALIASES[name] == "algorithm.dynamic_sampling_max_batches" and isinstance(value, int) and value <= 0:
        raise ConfigError(
            f"{source}: {name}={value} means no limit there; vlmrl bounds the generation batches per step: give "
            "algorithm.dynamic_sampling_max_batches (e.g. 10)"
        )
    return value


# Count fields that TRL spells as booleans: true keeps vlmrl's default count, false is 0.
BOOLEAN_COUNTS = ("logging.log_completions",)


def _trl_value(name: str, value: Any, source: str) -> tuple[bool, Any]:
    """(whether to set it, the value) for a TRL alias; strategies map to vlmrl's step counts, use_vllm to a backend."""
    if name == "use_vllm":
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: use_vllm={value!r}: expected true or false (or set rollout.backend to inprocess or vllm)")
        return True, "vllm" if value else "inprocess"
    if name not in ("eval_strategy", "save_strategy"):
        return True, value
    field_name = TRL_ALIASES[name]
    if value == "no" or value is False:  # YAML reads a bare `no` as false
        return True, 0
    if value == "steps":
        return False, None  # the step count (eval_steps / save_steps) decides, as in TRL
    raise ConfigError(f"{source}: {name}={value!r}: vlmrl evaluates / saves every {field_name} steps; use 'steps' (and set {field_name}) or 'no'")


def merge_key(tree: dict, dotted: str, value: Any, source: str) -> None:
    if dotted in PEER_ALIASES:
        if PEER_ALIASES[dotted] is None:
            return
        dotted, value = PEER_ALIASES[dotted], _peer_value(dotted, value, source)
    if dotted in TRL_ALIASES:
        keep, value = _trl_value(dotted, value, source)
        if not keep:
            return
        dotted = TRL_ALIASES[dotted]
    parts = dotted.split(".")
    if len(parts) == 1 and f"logging.{dotted}" in BOOLEAN_COUNTS:
        parts = ["logging", dotted]
    if ".".join(parts) in BOOLEAN_COUNTS and isinstance(value, bool):
        if value:
            return  # true: the default count
        value = 0
    if len(parts) == 3 and parts[0] in SECTIONS and typing.get_origin(typing.get_type_hints(SECTIONS[parts[0]]).get(parts[1])) is dict:
        # `data.columns.problem=question`: one entry of a mapping field
        section, name, key = parts
        current = tree.setdefault(section, {}).get(name)
        tree[section][name] = {**(current if isinstance(current, dict) else {}), key: value}
        return
    section, name = _known_key(parts if len(parts) != 1 else _owner_section(parts[0], source), dotted, source)
    tree.setdefault(section, {})[name] = value


def _owner_section(name: str, source: str) -> list[str]:
    """TRL users write `num_generations: 8` without a section: a unique field name gets its section."""
    owners = _all_field_names().get(name, [])
    if len(owners) > 1 and "sft" in owners:  # TRL's names mean the RL run: learning_rate -> optim.learning_rate
        owners = [o for o in owners if o != "sft"]
    if len(owners) > 1:
        raise ConfigError(f"{source}: {name!r} is ambiguous; write one of {', '.join(o + '.' + name for o in owners)}")
    return [owners[0], name] if owners else [name]


def _known_key(parts: list[str], dotted: str, source: str) -> tuple[str, str]:
    """(section, field) of a key, or ConfigError naming the closest valid key."""
    if len(parts) != 2:
        flat = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in fields(c)]
        raise ConfigError(f"{source}: unknown key {dotted!r}{_closest(dotted, flat + list(SECTIONS))}")
    section, name = parts
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section {section!r}{_closest(section, list(SECTIONS))}")
    valid = [f.name for f in fields(SECTIONS[section])]
    if name not in valid:
        raise ConfigError(f"{source}: unknown key {section}.{name}{_closest(name, valid)}")
    return section, name


def _flatten_yaml(data: Any, source: str) -> list[tuple[str, Any]]:
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    items = []
    for key, value in data.items():
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: section {key!r} must be a mapping, got {type(value).__name__}")
            items += [item for k, v in value.items() for item in _alias_items(f"{key}.{k}", v)]
        else:
            items += _alias_items(str(key), value)
    return items


def _alias_items(dotted: str, value: Any) -> list[tuple[str, Any]]:
    """(key, value) of a YAML entry, a peer's nested group (verl's algorithm.filter_groups, reward_model.overlong_buffer)
    spread into its dotted PEER_ALIASES keys."""
    if isinstance(value, dict) and any(alias.startswith(dotted + ".") for alias in PEER_ALIASES):
        return [item for k, v in value.items() for item in _alias_items(f"{dotted}.{k}", v)]
    return [(dotted, value)]


def parse_override(text: str) -> tuple[str, Any]:
    """`training.max_steps=10` -> ("training.max_steps", 10); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. rollout.num_generations=8")
    key, raw = text.split("=", 1)
    key = key.strip()
    # A Jinja template or free text given inline ({{ content }}, "Q: ...: answer") is not YAML: a text field takes it
    # as written, as a .yaml file's quoted string would.
    if _is_text_field(key) and ("{{" in raw or "{%" in raw or not _parses_as_scalar(raw)):
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse the value: {_one_line_yaml(e)}") from None
    return key, value


def _parses_as_scalar(raw: str) -> bool:
    try:
        return not isinstance(yaml.safe_load(raw), (dict, list))
    except yaml.YAMLError:
        return False


def _one_line_yaml(error: yaml.YAMLError) -> str:
    return " ".join(str(error).split())


def _is_text_field(key: str) -> bool:
    """`section.field` is annotated str or Optional[str] (not a list, dict or literal)."""
    section, _, name = key.partition(".")
    cls = SECTIONS.get(section)
    if cls is None:
        return False
    tp = typing.get_type_hints(cls).get(name)
    return tp is str or tp == Optional[str]


def build_config(tree: dict[str, dict[str, Any]]) -> Config:
    """Build and validate a Config from a {section: {field: value}} tree."""
    sections = {}
    for section, cls in SECTIONS.items():
        values = dict(tree.get(section, {}))
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            values[name] = _coerce(value, hints[name], f"{section}.{name}")
        sections[section] = cls(**values)
    cfg = anchor_paths(Config(**sections))
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load YAML (optional) then apply `a.b=value` overrides; resolve model.defaults (the embedded model's values for
    the fields left unset, model_defaults.py); validate once; return the frozen tree."""
    tree: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        for key, value in _flatten_yaml(data, str(path)):
            merge_key(tree, key, value, str(path))
    for text in overrides:
        key, value = parse_override(text)
        merge_key(tree, key, value, f"override {text!r}")

    apply_preset(tree)  # algorithm.preset: TRL's defaults for the fields left unset
    filled = apply_model_defaults(tree)  # model.defaults resolved once, here: unset fields of the embedded model
    try:
        return build_config(tree)
    except ConfigError as e:
        if not filled:
            raise
        raise ConfigError(f"{e}\n  (model.defaults=tiny filled {', '.join(filled)}; set them yourself, or model.defaults=pretrained)") from None


def validate(cfg: Config) -> None:
    """Cross-field rules; each message names the field and how to fix it."""
    rules = [*_rollout_rules(cfg), *_algorithm_rules(cfg), *_training_rules(cfg), *_data_rules(cfg), *_other_rules(cfg), *_tools_rules(cfg)]
    problems = [msg for ok, msg in rules if not ok] + _algorithm_problems(cfg.algorithm) + _data_layout_problems(cfg.data) + _judge_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _judge_problems(cfg: Config) -> list[str]:
    """judge.*: one source for the reward `judge` (a folder or a URL), a pattern with a group, a template with known
    fields; a judge configured but not listed in algorithm.reward_funcs is refused rather than ignored."""

    j = cfg.judge
    if "judge" not in cfg.algorithm.reward_funcs:
        set_ = [f"judge.{k}" for k in ("model_path", "url") if getattr(j, k)]
        return [f"{set_[0]} is set but algorithm.reward_funcs does not list judge; add judge to it or unset {set_[0]}"] if set_ else []
    problems = []
    if (j.model_path is None) == (j.url is None):
        problems.append("algorithm.reward_funcs lists judge: set exactly one of judge.model_path (in-process) and judge.url (served)")
    if j.url is not None and not j.url.startswith(("http://", "https://")):
        problems.append(f"judge.url={j.url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000/v1)")
    try:
        if re.compile(j.score_pattern).groups < 1:
            problems.append(f"judge.score_pattern={j.score_pattern!r} has no group; put the score in ( )")
    except re.error as e:
        problems.append(f"judge.score_pattern={j.score_pattern!r} is not a regex: {e}")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(j.template) if name is not None}
    except ValueError as e:
        names = {f"<{e}>"}
    unknown = sorted(names - set(JUDGE_FIELDS))
    fields_hint = "it may use {question}, {completion}, {solution}; write {{ }} for a brace"
    if unknown:
        problems.append(f"judge.template: unknown field(s) {', '.join(unknown)} ({fields_hint})")
    elif "completion" not in names:
        problems.append(f"judge.template has no {{completion}}: the judge would not see the answer ({fields_hint})")
    problems += [
        msg
        for ok, msg in (
            (j.score_max > j.score_min, f"judge.score_max={j.score_max} must be > judge.score_min={j.score_min}"),
            (j.max_new_tokens >= 1, f"judge.max_new_tokens={j.max_new_tokens} must be >= 1"),
            (j.batch_size >= 1, f"judge.batch_size={j.batch_size} must be >= 1"),
            (j.timeout_s > 0, f"judge.timeout_s={j.timeout_s} must be > 0"),
            (j.retries >= 0, f"judge.retries={j.retries} must be >= 0"),
            (j.cache_size >= 0, f"judge.cache_size={j.cache_size} must be >= 0 (0 = no cache)"),
        )
        if not ok
    ]
    return problems


def _pipeline_refusals(cfg: Config) -> list[str]:
    """What rollout.max_staleness > 0 does not run with yet (rollout/pipeline.py), as field=value."""
    a, r = cfg.algorithm, cfg.rollout
    checks = [
        (r.backend != "inprocess", f"rollout.backend={r.backend}"),
        (cfg.multiturn, "tools.tools / tools.environment"),
        (a.dynamic_sampling, "algorithm.dynamic_sampling=true"),
        (a.routing_replay != "off", f"algorithm.routing_replay={a.routing_replay}"),
        (not cfg.memory.shared_prefix, "memory.shared_prefix=false (its decode path reports no behaviour log-probs)"),
    ]
    return [what for refused, what in checks if refused]


def _rollout_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for rollout.* and the generation batch."""
    r, t = cfg.rollout, cfg.training
    return [
        (
            r.num_generations >= 2,
            f"rollout.num_generations={r.num_generations}: GRPO needs at least 2 completions per prompt to compare; set it to 2 or more",
        ),
        (r.generation_batch_size is None or r.generation_batch_size >= 1, "rollout.generation_batch_size must be >= 1 (or null for the default)"),
        (r.steps_per_generation is None or r.steps_per_generation >= 1, "rollout.steps_per_generation must be >= 1 (or null)"),
        (
            r.vllm_server_timeout > 0 and 0 < r.vllm_server_port < 65535,
            "rollout.vllm_server_timeout must be > 0 and rollout.vllm_server_port below 65535",
        ),
        (
            all(isinstance(a, str) and a.rpartition(":")[0] and a.rpartition(":")[2].isdigit() for a in r.vllm_servers),
            f"rollout.vllm_servers={list(r.vllm_servers)}: each entry is host:port, e.g. ['10.0.0.2:8000', '10.0.0.3:8000']",
        ),
        (
            r.backend != "vllm" or r.vllm_mode == "colocate" or not cfg.multiturn,
            "rollout.vllm_mode=server with tools.tools / tools.environment: tool rollouts send vLLM token ids, which the rollout "
            "server's protocol does not carry (yet); use rollout.vllm_mode=colocate, or rollout.backend=inprocess",
        ),
        (
            r.backend != "vllm" or not (cfg.model.use_lora and cfg.model.lora_target_parameters),
            "rollout.backend=vllm pushes LoRA merged from adapted Linear layers only: unset model.lora_target_parameters, "
            "or use rollout.backend=inprocess",
        ),
        (
            0.0 < r.vllm_gpu_memory_utilization <= 1.0,
            f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization}: a share of the device memory, in (0, 1]",
        ),
        (r.vllm_sleep_level in (0, 1, 2), f"rollout.vllm_sleep_level={r.vllm_sleep_level}: use 0 (no sleep), 1 or 2"),
        (r.vllm_tensor_parallel_size >= 1, f"rollout.vllm_tensor_parallel_size={r.vllm_tensor_parallel_size} must be >= 1"),
        (
            r.vllm_max_model_length is None or r.vllm_max_model_length >= 2,
            f"rollout.vllm_max_model_length={r.vllm_max_model_length} must be >= 2 (or null)",
        ),
        (r.max_staleness >= 0, f"rollout.max_staleness={r.max_staleness}: versions behind, 0 (synchronous) or more"),
        (
            r.max_staleness == 0 or not _pipeline_refusals(cfg),
            f"rollout.max_staleness={r.max_staleness} (the rollout pipeline) does not run with {', '.join(_pipeline_refusals(cfg))} yet; set rollout.max_staleness=0 or unset those",
        ),
        (
            r.steps_per_generation is None or r.generation_batch_size is None,
            "rollout.steps_per_generation and rollout.generation_batch_size both set the generation batch; set only one",
        ),
        (
            cfg.generation_batch_size % r.num_generations == 0,
            f"generation batch {cfg.generation_batch_size} (rollout.generation_batch_size, default per_device_train_batch_size x gradient_accumulation_steps) "
            f"is not divisible by rollout.num_generations={r.num_generations}; make it a multiple",
        ),
        (
            cfg.generation_batch_size % (t.per_device_train_batch_size * t.gradient_accumulation_steps) == 0,
            f"generation batch {cfg.generation_batch_size} is not divisible by per_device_train_batch_size x gradient_accumulation_steps = "
            f"{t.per_device_train_batch_size * t.gradient_accumulation_steps}; every optimizer step must see full micro-batches",
        ),
        (r.max_completion_length >= 1, "rollout.max_completion_length must be >= 1"),
        (r.decode_batch_size >= 0, f"rollout.decode_batch_size={r.decode_batch_size} must be >= 0 (0 = all rows of a generate call)"),
        (
            r.decode_step == "dynamic" or r.engine == "continuous",
            f"rollout.decode_step={r.decode_step} is a step of the continuous decoder: set rollout.engine=continuous, or decode_step=dynamic",
        ),
        (
            r.decode_step != "cuda_graph" or t.device != "cpu",
            "rollout.decode_step=cuda_graph needs a CUDA device (training.device=cpu): use rollout.decode_step=static",
        ),
        (r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0"),
        (0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]"),
        (r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0 (0 disables it)"),
        (
            0 <= r.min_completion_length <= r.max_completion_length,
            f"rollout.min_completion_length={r.min_completion_length} must be in [0, max_completion_length={r.max_completion_length}]",
        ),
    ]


def _algorithm_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for algorithm.*."""
    from vlmrl.algo.turn_advantages import TURN_SCALES

    a = cfg.algorithm
    return [
        (a.beta >= 0, f"algorithm.beta={a.beta} must be >= 0"),
        (a.router_aux_loss_coef >= 0, f"algorithm.router_aux_loss_coef={a.router_aux_loss_coef} must be >= 0"),
        (a.distill_coef >= 0, f"algorithm.distill_coef={a.distill_coef} must be >= 0"),
        (
            a.turn_advantage == "trajectory" or (cfg.multiturn and cfg.advantage_estimator in TURN_SCALES),
            "algorithm.turn_advantage=per_turn gives each turn of a multi-turn rollout its own advantage: it needs tools.tools "
            f"and a group estimator ({', '.join(TURN_SCALES)}; advantage_estimator is {cfg.advantage_estimator}), or set turn_advantage=trajectory",
        ),
        (
            a.turn_advantage == "trajectory" or a.policy_loss != "gspo",
            "algorithm.turn_advantage=per_turn with algorithm.policy_loss=gspo: GSPO's sequence-level ratio takes one advantage per "
            "rollout (the turns' would be averaged away); use ppo_clip, cispo or sapo, or turn_advantage=trajectory",
        ),
        (0.0 <= a.turn_discount <= 1.0, f"algorithm.turn_discount={a.turn_discount} must be in [0, 1]"),
        (
            a.teacher_path is None or not cfg.multiturn,
            "algorithm.teacher_path: distillation is not built for multi-turn rollouts (tools.tools); drop one of them",
        ),
        (
            a.routing_replay == "off" or (cfg.rollout.engine == "loop" and cfg.memory.shared_prefix),
            f"algorithm.routing_replay={a.routing_replay} records expert choices in the shared-prefix decode loop: set "
            f"rollout.engine=loop (is {cfg.rollout.engine}) and memory.shared_prefix=true (is {str(cfg.memory.shared_prefix).lower()}), or routing_replay=off",
        ),
        (a.epsilon >= 0, f"algorithm.epsilon={a.epsilon} must be >= 0"),
        (cfg.epsilon_high >= a.epsilon, f"algorithm.epsilon_high={a.epsilon_high} must be >= algorithm.epsilon={a.epsilon}"),
        (a.num_iterations >= 1, f"algorithm.num_iterations={a.num_iterations} must be >= 1"),
        (len(a.reward_funcs) >= 1, "algorithm.reward_funcs is empty; name at least one reward, e.g. [accuracy]"),
        (
            a.dynamic_sampling_max_batches >= 1,
            f"algorithm.dynamic_sampling_max_batches={a.dynamic_sampling_max_batches} must be >= 1 (the first batch counts)",
        ),
        (
            not a.dynamic_sampling or (not cfg.multiturn and a.routing_replay == "off"),
            "algorithm.dynamic_sampling assembles the batch from single-turn rollouts without recorded routes: drop tools.tools and "
            "set algorithm.routing_replay=off, or set algorithm.dynamic_sampling=false",
        ),
        (
            not a.overlong_shaping or 1 <= a.overlong_buffer_len <= cfg.rollout.max_completion_length,
            f"algorithm.overlong_shaping needs 1 <= algorithm.overlong_buffer_len <= rollout.max_completion_length={cfg.rollout.max_completion_length} "
            f"(it is {a.overlong_buffer_len}): the tokens before the limit where the penalty grows",
        ),
        (
            a.reward_weights is None or len(a.reward_weights) == len(a.reward_funcs),
            f"algorithm.reward_weights has {len(a.reward_weights or [])} entries but reward_funcs has {len(a.reward_funcs)}; give one weight per reward",
        ),
    ]


def _training_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for training.* and optim.*."""
    t, o, s = cfg.training, cfg.optim, cfg.sft
    return [
        (t.num_train_epochs is None or t.num_train_epochs > 0, f"training.num_train_epochs={t.num_train_epochs} must be > 0 (or null)"),
        (o.learning_rate >= 0, "optim.learning_rate must be >= 0"),
        (0 <= o.warmup_ratio < 1, f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1)"),
        (o.max_grad_norm >= 0, "optim.max_grad_norm must be >= 0 (0 disables clipping)"),
        (t.max_steps >= 1, "training.max_steps must be >= 1"),
        (
            t.sequence_parallel_size >= 1,
            f"training.sequence_parallel_size={t.sequence_parallel_size} must be >= 1 (1 = no sequence parallelism)",
        ),
        (t.per_device_train_batch_size >= 1, "training.per_device_train_batch_size must be >= 1"),
        (t.gradient_accumulation_steps >= 1, "training.gradient_accumulation_steps must be >= 1"),
        (t.eval_steps >= 0, "training.eval_steps must be >= 0"),
        (t.eval_batch_size >= 1, "training.eval_batch_size must be >= 1"),
        (t.save_steps >= 0, "training.save_steps must be >= 0"),
        (t.max_nonfinite_steps >= 0, "training.max_nonfinite_steps must be >= 0 (0 = never stop)"),
        (t.save_total_limit is None or t.save_total_limit >= 1, "training.save_total_limit must be >= 1 (or null for no limit)"),
        (t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"), f"training.device={t.device!r}: use auto, cpu, cuda or cuda:N"),
        (s.projector_steps >= 0 and s.steps >= 0, "sft.projector_steps and sft.steps must be >= 0"),
        (s.batch_size >= 1, "sft.batch_size must be >= 1"),
        (t.save_minutes >= 0, f"training.save_minutes={t.save_minutes} must be >= 0 (0 = no time-based checkpoints)"),
        (s.micro_batch_size is None or s.micro_batch_size >= 1, "sft.micro_batch_size must be >= 1 (or null for a process's whole share)"),
        (s.epochs is None or s.epochs > 0, f"sft.epochs={s.epochs} must be > 0 (or null to use sft.steps)"),
        (
            all(k in AUTO_FIT_ALLOW for k in t.auto_fit_allow),
            f"training.auto_fit_allow={t.auto_fit_allow}: entries must be among {', '.join(AUTO_FIT_ALLOW)}",
        ),
        (
            t.auto_fit_gpu_memory_gib is None or t.auto_fit_gpu_memory_gib > 0,
            f"training.auto_fit_gpu_memory_gib={t.auto_fit_gpu_memory_gib} must be > 0 (GiB), or null for the CUDA device's capacity",
        ),
        (
            t.auto_fit_host_memory_gib is None or t.auto_fit_host_memory_gib > 0,
            f"training.auto_fit_host_memory_gib={t.auto_fit_host_memory_gib} must be > 0 (GiB), or null for no host check",
        ),
        (
            not (t.auto_fit and t.auto_fit_gpu_memory_gib is None and t.device == "cpu"),
            "training.auto_fit=true on training.device=cpu needs training.auto_fit_gpu_memory_gib (there is no CUDA device to read the size from)",
        ),
    ]


def _data_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for data.*."""
    d = cfg.data
    return [
        (d.max_prompt_length is None or d.max_prompt_length >= 1, "data.max_prompt_length must be >= 1 (or null for no limit)"),
        (d.max_frames >= 1, f"data.max_frames={d.max_frames} must be >= 1"),
        (d.fps > 0, f"data.fps={d.fps} must be > 0"),
        (d.video_max_pixels >= 28 * 28, f"data.video_max_pixels={d.video_max_pixels} must be >= 784 (one 28x28 patch)"),
        (d.min_pixels >= 1, "data.min_pixels must be >= 1"),
        (
            d.min_pixels <= d.max_pixels,
            f"data.min_pixels={d.min_pixels} is larger than data.max_pixels={d.max_pixels}; lower min_pixels or raise max_pixels",
        ),
        (d.limit_images >= 1, "data.limit_images must be >= 1"),
        (d.max_image_pixels >= 1, f"data.max_image_pixels={d.max_image_pixels} must be >= 1 (pixels; default {89_478_485:,})"),
        (d.image_cache_mb >= 0, f"data.image_cache_mb={d.image_cache_mb} must be >= 0 (MiB; 0 = no cache)"),
        (d.task_train_size >= 1 and d.task_test_size >= 0, "data.task_train_size must be >= 1 and data.task_test_size >= 0"),
        (d.task_image_size >= 28, "data.task_image_size must be >= 28"),
    ]


def _other_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for model.*, sft.*, memory.* and logging.*."""
    m = cfg.model
    return [
        (
            cfg.memory.scoring_micro_batch_size is None or cfg.memory.scoring_micro_batch_size >= 1,
            "memory.scoring_micro_batch_size must be >= 1 (or null for the update's size)",
        ),
        (m.lora_r >= 1, "model.lora_r must be >= 1"),
        (
            not (m.use_lora and m.train_projector_only),
            "model.use_lora and model.train_projector_only exclude each other; the projector is trained in full",
        ),
        (cfg.logging.logging_steps >= 1, "logging.logging_steps must be >= 1"),
        (
            cfg.memory.generation_prompts_per_call is None or cfg.memory.generation_prompts_per_call >= 1,
            "memory.generation_prompts_per_call must be >= 1 (or null for all prompts at once)",
        ),
        (cfg.memory.logprob_chunk_tokens >= 0, "memory.logprob_chunk_tokens must be >= 0 (0 = no chunking)"),
        (
            cfg.memory.max_tokens_per_micro_batch is None or cfg.memory.max_tokens_per_micro_batch >= 1,
            "memory.max_tokens_per_micro_batch must be >= 1 (or null to cut by per_device_train_batch_size rows)",
        ),
        (0 < cfg.memory.warn_fraction <= 1, "memory.warn_fraction must be in (0, 1]"),
        (cfg.logging.log_completions >= 0, "logging.log_completions must be >= 0"),
        (_report_to_problem(cfg.logging.report_to) is None, f"{_report_to_problem(cfg.logging.report_to)}"),
        (cfg.logging.no_signal_warn_steps >= 0, "logging.no_signal_warn_steps must be >= 0 (0 = never warn)"),
    ]


def _tools_rules(cfg: Config) -> list[tuple[bool, str]]:
    """(holds, message) for tools.*."""
    t, r = cfg.tools, cfg.rollout
    on = cfg.multiturn
    return [
        (t.max_turns >= 1, f"tools.max_turns={t.max_turns} must be >= 1"),
        (t.max_turn_tokens >= 0, f"tools.max_turn_tokens={t.max_turn_tokens} must be >= 0 (0 = rollout.max_completion_length)"),
        (
            not on or t.max_total_tokens >= cfg.max_turn_tokens,  # single-turn runs never read the tools budgets
            f"tools.max_total_tokens={t.max_total_tokens} must be >= the tokens of one turn ({cfg.max_turn_tokens}: tools.max_turn_tokens, "
            "or rollout.max_completion_length when it is 0)",
        ),
        (t.max_images >= 1, f"tools.max_images={t.max_images} must be >= 1 (the row's own images count)"),
        (t.timeout_s > 0, f"tools.timeout_s={t.timeout_s} must be > 0"),
        (t.workers >= 1, f"tools.workers={t.workers} must be >= 1"),
        (t.max_calls_per_turn >= 1, f"tools.max_calls_per_turn={t.max_calls_per_turn} must be >= 1"),
        (t.max_image_pixels >= 1, f"tools.max_image_pixels={t.max_image_pixels} must be >= 1 (pixels)"),
        (not t.environment or ":" in t.environment, f"tools.environment={t.environment!r}: give path/to/file.py:Class or module:Class"),
        (
            not on or r.engine == "continuous",
            f"tools.tools is set (multi-turn rollouts), which run in the continuous decoder: set rollout.engine=continuous (it is {r.engine})",
        ),
        (not on or r.decode_step == "dynamic", f"tools.tools: multi-turn rollouts use rollout.decode_step=dynamic (it is {r.decode_step})"),
        (not on or cfg.memory.shared_prefix, "tools.tools: multi-turn rollouts need memory.shared_prefix=true (the continuous decoder)"),
        (
            # Multi-turn scoring (models.multiturn.sequence_logps*) does not collect the LM head's entropies.
            not on or cfg.algorithm.top_entropy_quantile == 1.0,
            f"tools.tools: entropy-quantile masking is not built for multi-turn rollouts: set algorithm.top_entropy_quantile=1.0 "
            f"(it is {cfg.algorithm.top_entropy_quantile}) or drop tools.tools",
        ),
    ]


def _algorithm_problems(a: "AlgorithmConfig") -> list[str]:
    """Algorithm names checked against the dicts of functions that implement them (imported here only: torch)."""
    from vlmrl.algo.advantages import ADVANTAGE_ESTIMATORS
    from vlmrl.algo.losses import AGGREGATIONS, KL_ALIASES, KL_ESTIMATORS, POLICY_LOSS_AGGREGATION, POLICY_LOSSES, epsilon_high

    problems = [
        problem
        for name, value, table in (
            ("advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS),
            ("policy_loss", a.policy_loss, POLICY_LOSSES),
            ("loss_aggregation", a.loss_aggregation, AGGREGATIONS),
            ("kl_estimator", a.kl_estimator, {**KL_ESTIMATORS, **KL_ALIASES}),
        )
        if value is not None and (problem := _not_one_of(f"algorithm.{name}", value, list(table)))
    ]
    if a.advantage_estimator is not None and a.scale_rewards != "group":
        problems.append(
            f"algorithm.advantage_estimator={a.advantage_estimator!r} and algorithm.scale_rewards={a.scale_rewards!r} both "
            "choose the advantages; set only one (scale_rewards is TRL's name for the first three estimators)"
        )
    if a.loss_aggregation is not None and a.loss_type != "grpo":
        problems.append(
            f"algorithm.loss_aggregation={a.loss_aggregation!r} and algorithm.loss_type={a.loss_type!r} both choose the "
            "aggregation; set only one (loss_type is TRL's name for it)"
        )
    if a.kl_estimator is not None and a.use_bias_correction_kl is not None:
        problems.append(
            f"algorithm.kl_estimator={a.kl_estimator!r} and algorithm.use_bias_correction_kl={a.use_bias_correction_kl} both choose "
            "the KL estimator; set only one (use_bias_correction_kl is TRL's name for k3_ratio)"
        )
    fixed = POLICY_LOSS_AGGREGATION.get(a.policy_loss)
    if fixed and (a.loss_aggregation not in (None, *fixed) or a.loss_type not in ("grpo", "dapo")):
        problems.append(
            f"algorithm.policy_loss={a.policy_loss} is always aggregated by {' or '.join(fixed)} (its paper's normalisation), but "
            f"{'loss_aggregation=' + repr(a.loss_aggregation) if a.loss_aggregation else 'loss_type=' + repr(a.loss_type)} asks for "
            "another; leave it unset"
        )
    return problems + _algorithm_value_problems(a, epsilon_high(a))


def _algorithm_value_problems(a: "AlgorithmConfig", eps_high: float) -> list[str]:
    """The algorithm's numeric settings and the rollout correction's name."""
    from vlmrl.algo.mismatch import ROLLOUT_CORRECTIONS

    problems = []
    if a.delta is not None and a.delta <= 1 + eps_high:
        problems.append(f"algorithm.delta={a.delta} must be > 1 + epsilon_high = {1 + eps_high} (or null to turn two-sided clipping off)")
    if a.delta is not None and a.policy_loss not in ("ppo_clip", "gspo"):
        problems.append(f"algorithm.delta applies to policy_loss=ppo_clip or gspo only, not {a.policy_loss}; set delta to null")
    if a.rollout_correction != "none" and (
        problem := _not_one_of("algorithm.rollout_correction", a.rollout_correction, ["none", *ROLLOUT_CORRECTIONS])
    ):
        problems.append(problem)
    lo, hi = a.rollout_correction_min, a.rollout_correction_max
    if (lo is not None and lo < 0) or (lo is not None and hi is not None and hi < lo):
        problems.append(f"algorithm.rollout_correction_min={lo} / rollout_correction_max={hi}: need 0 <= min <= max (or null)")
    if min(a.sapo_temperature_pos, a.sapo_temperature_neg) <= 0:
        problems.append("algorithm.sapo_temperature_pos and sapo_temperature_neg must be > 0")
    if not 0.0 < a.top_entropy_quantile <= 1.0:
        problems.append(f"algorithm.top_entropy_quantile={a.top_entropy_quantile} must be in (0, 1] (1.0 = every token)")
    return problems


def _not_one_of(field_name: str, value: str, choices: list[str]) -> str | None:
    """The problem line of a name that is not among `choices`, with the closest one as a hint (None: it is)."""
    if value in choices:
        return None
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{field_name}={value!r} is not one of {', '.join(choices)}{hint}"


def _data_layout_problems(d: "DataConfig") -> list[str]:
    problems = []
    if d.format != "auto" and (problem := _not_one_of("data.format", d.format, ["auto", *DATA_FORMATS])):
        problems.append(problem)
    for key in d.columns:
        if key not in MAPPABLE_COLUMNS:
            close = difflib.get_close_matches(key, list(MAPPABLE_COLUMNS), n=1, cutoff=0.5)
            hint = f"; did you mean data.columns.{close[0]}?" if close else ""
            problems.append(f"data.columns.{key}: vlmrl reads no field {key!r} (it maps {', '.join(MAPPABLE_COLUMNS)}){hint}")
    return problems


TRACKERS = ("tensorboard", "wandb", "mlflow")
REPORT_TO_CHOICES = (*TRACKERS, "all", "none")


def report_to_names(report_to: list[str] | str) -> list[str]:
    """logging.report_to as a list of names, each one of REPORT_TO_CHOICES; ValueError names the field and the fix."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    unknown = [n for n in names if n not in REPORT_TO_CHOICES]
    if unknown:
        close = difflib.get_close_matches(unknown[0], REPORT_TO_CHOICES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"logging.report_to: unknown tracker {unknown[0]!r}{hint} (choose from {', '.join(REPORT_TO_CHOICES)})")
    if "none" in names and len(names) > 1:
        raise ValueError(f"logging.report_to={names}: 'none' cannot be combined with trackers")
    return names


def _report_to_problem(report_to: list[str] | str) -> str | None:
    try:
        report_to_names(report_to)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- output
def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    path.write_text(config_header(cfg) + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def resume_harmless(key: str) -> bool:
    """`section.field` may change between a checkpoint and its resume (every logging field, and those marked so)."""
    section, _, name = key.partition(".")
    if section == "logging":
        return True
    cls = SECTIONS.get(section)
    match = [f for f in fields(cls) if f.name == name] if cls else []
    return bool(match and match[0].metadata.get("resume_harmless"))


def config_hash(cfg: Config | dict) -> str:
    """16 hex digits of the config tree (a Config, or the nested dict of `to_dict`)."""
    tree = cfg if isinstance(cfg, dict) else to_dict(cfg)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def replace(cfg: Config, **dotted: Any) -> Config:
    """Copy with `section__field=value` changes, validated again (used by auto-fit and OOM recovery)."""
    tree = to_dict(cfg)
    for key, value in dotted.items():
        section, name = key.split("__", 1)
        merge_key(tree, f"{section}.{name}", value, "replace()")
    return build_config(tree)


def field_doc(f: dataclasses.Field) -> str:
    """A field's doc, its {choices} filled with the keys of the dict of functions that implements them (the module
    is imported only here: torch), so the help text cannot miss a new entry."""
    doc, choices = f.metadata["doc"], f.metadata.get("choices")
    if not choices:
        return doc

    module, name = choices.split(":")
    table = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return doc.replace("{choices}", f"{', '.join(table)} ({module}.{name})")


def reference_markdown() -> str:
    """The config reference, generated from the field docs."""
    lines = []
    for section, cls in SECTIONS.items():
        lines += [f"### `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = json.dumps(default) if not isinstance(default, str) else default
            shown = shown.replace("|", "\\|").replace("\n", "\\n")  # a table cell is one line: a newline shows as \n
            lines.append(f"| `{f.name}` | {_type_name(hints[f.name]).replace('|', 'or')} | `{shown}` | {field_doc(f)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())


# ---------------------------------------------------------------- paths, fixed once at load
def _anchored(value):
    """`value` made absolute against today's working directory when it names something there (a file, a folder, or a
    glob that matches; each of a list; a dataset folder with its split, `name::train` / `name@train`); anything else
    (a hub id, an inline template, a name refused later) is kept as written."""

    if isinstance(value, list):
        return [_anchored(v) for v in value]
    if not value or os.path.isabs(value):
        return value
    for sep in ("::", "@"):  # a dataset folder's split (data/locate.py): the folder is the path
        head, found, split = value.rpartition(sep)
        if found and head and os.path.isdir(os.path.expanduser(head)):
            return os.path.abspath(os.path.expanduser(head)) + sep + split
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded) or os.path.exists(expanded) or (glob.has_magic(expanded) and glob.glob(expanded)):
        return os.path.abspath(expanded)
    return value


def _anchored_spec(spec: str) -> str:
    """A reward / tool spec `file.py:function[...]` with its .py file anchored (_anchored); other specs unchanged."""
    target, sep, rest = spec.partition(":")
    return _anchored(target) + sep + rest if sep and target.endswith(".py") else spec


def anchor_paths(cfg: Config) -> Config:
    """Every path of the config made absolute once, at load: user code (a reward, a tool) may change the working
    directory while the run goes on, and a relative path would then follow it (the run's output, checkpoints and lock
    written elsewhere, another data or reward file read). training.output_dir, training.resume (a checkpoint path)
    and data.image_root are always anchored; inputs when they name something that exists (_anchored)."""

    t, d, m = cfg.training, cfg.data, cfg.model
    roots = d.image_root if isinstance(d.image_root, list) else [d.image_root]
    roots = [os.path.abspath(os.path.expanduser(r)) if r else r for r in roots]
    resume = t.resume if t.resume in ("auto", "never") or not t.resume else os.path.abspath(os.path.expanduser(t.resume))
    template = d.prompt_template
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(m, name_or_path=_anchored(m.name_or_path)),
        data=dataclasses.replace(
            d,
            train_path=_anchored(d.train_path),
            eval_path=_anchored(d.eval_path),
            image_root=roots if isinstance(d.image_root, list) else roots[0],
            prompt_template=_anchored(template) if template and "{" not in template and "\n" not in template else template,
        ),
        training=dataclasses.replace(t, output_dir=os.path.abspath(os.path.expanduser(t.output_dir)), resume=resume),
        algorithm=dataclasses.replace(
            cfg.algorithm, reward_funcs=[_anchored_spec(s) for s in cfg.algorithm.reward_funcs], teacher_path=_anchored(cfg.algorithm.teacher_path)
        ),
        tools=dataclasses.replace(cfg.tools, tools=[_anchored_spec(s) for s in cfg.tools.tools], environment=_anchored_spec(cfg.tools.environment)),
        judge=dataclasses.replace(cfg.judge, model_path=_anchored(cfg.judge.model_path)),
    )
