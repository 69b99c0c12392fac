"""Checks that need no model weights, run before `train`, `sft` and `eval` load anything heavy.

On a 7B model a typo found after the weights load costs minutes; everything here takes seconds:
the model folder holds what loading will need (config, weights and every shard an index names, tokenizer
files, a chat template, an image processor config), the reward specs import and run on a few real rows,
every data row is validated (the result is kept for the run, so the rows are not read twice), and
`vlmrl eval` knows which data it scores. Each problem raises the error type cli.py turns into one line
and exit status 2 (ConfigError, DataError, ModelLoadError, RewardError).
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.config import EMBEDDED_MODEL, Config, ConfigError
from vlmrl.data.formats import prompt_messages_of
from vlmrl.data.errors import DataError
from vlmrl.data.sft_targets import sft_target
from vlmrl.data.template_budget import TemplateBudgetError, probe, template_source
from vlmrl.engine.device import env_world
from vlmrl.engine.device import resolve_device
from vlmrl.models.judge import local_judge_on
from vlmrl.models.loading import ModelLoadError, check_attention, require_complete_model_folder
from vlmrl.models.processing import build_row_prompt, load_processor
from vlmrl.models.weight_files import check_expected_weights, check_weight_files
from vlmrl.rewards.functions import BUILTIN_REWARDS
from vlmrl.rewards.protocol import TrainerState, resolve_completion_format, reward_inputs
from vlmrl.rewards.combine import compute_rewards
from vlmrl.rewards.peers import describe_call
from vlmrl.rewards.scoring import load_reward_funcs, name_rows, reward_columns, row_sources
from vlmrl.rollout.backends import describe_backend
from vlmrl.run.datasets import configured_processor, data_layout_options, encode_rows, load_datasets
from vlmrl.run.tool_rollout import tool_schemas
from vlmrl.run.rundir import check_output_dir
from vlmrl.run.tracking import missing_tracker_packages, resolve_report_to
from vlmrl.data.formats import easyr1_prompt_template
from vlmrl.models.processing import render_chat
import yaml

REWARD_PROBE_ROWS = 2


def preflight(cfg: Config, command: str, log=print):
    """Every check for `command` (train, sft, eval or check), cheapest first; raises on the first failing kind.
    Returns the datasets it read (None on a non-main process)."""
    backend = None
    if command == "eval":
        check_eval_data(cfg)
    elif command in ("train", "sft", "check"):
        check_trackers(cfg)
        if command != "sft":  # which sampler will run, and why; rollout.backend=vllm where vLLM is missing fails here
            backend = describe_backend(cfg, env_world()[0])

        check_output_dir(cfg)  # a file, not writable, a user's entries under the run's names, the run's inputs inside
    check_model_folder(cfg)
    if command in ("train", "sft", "check"):
        check_sequence_parallel(cfg, command)

    try:
        # unknown names (RewardError), missing files, import errors; a judge folder that is not a model, a judge URL unreachable
        funcs, weights = load_reward_funcs(cfg, local_judge_on(resolve_device(cfg.training.device)))
    except ValueError as e:  # the same reward listed twice
        raise ConfigError(str(e)) from None
    if env_world()[1] != 0:
        return None  # several processes: the main one reads the data (the built-in task's files are written once)
    processor = probe_templates(cfg)  # a template that hangs or bloats is refused before any row is rendered
    data = load_datasets(cfg, need_train=command != "eval", keep_for_run=command != "check")
    if command == "check":
        for line in data.reports:
            log(line)
    rows = (data.train or data.eval)[:REWARD_PROBE_ROWS]
    if rows:
        check_rewards_on_rows(cfg, funcs, weights, rows)
        if command in ("train", "sft", "check"):
            for line in check_chat_template(cfg, rows[0], processor):
                log(line)
        if command == "check":
            for line in describe_rewards(cfg, funcs, rows):
                log(line)
    check_model_weights(cfg)  # last: the model built on the meta device takes seconds
    if command == "check" and backend:  # reported once every check passed: a refusal stays the only line
        log(backend)
    return data


def check_sequence_parallel(cfg: Config, command: str) -> None:
    """ConfigError for a training.sequence_parallel_size > 1 the run cannot use: a size that does not divide the
    processes or the model's heads, a family Ulysses does not cover, or a setting it does not run with yet
    (engine/ulysses.sequence_parallel_refusal); nothing when `vlmrl train` can run it."""
    sp = cfg.training.sequence_parallel_size
    if sp == 1:
        return
    from transformers import AutoConfig

    from vlmrl.engine.ulysses import sequence_parallel_refusal

    name = cfg.model.name_or_path
    model_config = None if name == EMBEDDED_MODEL else AutoConfig.from_pretrained(name, local_files_only=not cfg.model.allow_hub_download)
    refusal = sequence_parallel_refusal(sp, env_world()[0], model_config, "train" if command == "check" else command, cfg)
    if refusal:
        raise ConfigError(refusal)


def check_model_weights(cfg: Config) -> None:
    """The model folder's weight files hold every tensor config.json's model needs, in its shape
    (weight_files.check_expected_weights); the embedded model and a hub id are not folders to check."""
    name = cfg.model.name_or_path
    if name != EMBEDDED_MODEL and Path(name).expanduser().is_dir():
        check_expected_weights(Path(name).expanduser(), cfg.model.trust_remote_code)


def _template_processor(cfg: Config):
    """The model folder's processor, for checking its chat template (seconds, no weights); None for the embedded
    model (vlmrl's own template), a hub id, or a folder whose processor does not load (the load before step 1
    reports that itself)."""
    name = cfg.model.name_or_path
    if name == EMBEDDED_MODEL or not Path(name).expanduser().is_dir():
        return None
    try:
        return load_processor(name, trust_remote_code=cfg.model.trust_remote_code, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    except Exception:
        return None


def probe_templates(cfg: Config):
    """Render the model's chat template and data.prompt_template once on a short synthetic prompt (a system
    message, an image, a question, an answer) in a forked child under a time and memory budget
    (template_budget.probe): one that loops or bloats is refused in one line naming its file, before the data's
    rows are rendered in this process. Returns the processor it loaded (None: no folder to check)."""

    if cfg.data.prompt_template:
        template = data_layout_options(cfg.data)["prompt_template"]
        named = f"data.prompt_template={cfg.data.prompt_template}" if "{" not in cfg.data.prompt_template else "data.prompt_template"
        # Compiled in the child too: jinja folds constant expressions ('x' * 2000000000) when it compiles.
        probe(lambda: easyr1_prompt_template(template)(content="What is in the image? <image>"), named)
    processor = _template_processor(cfg)
    if processor is None:
        return None
    row = {"problem": "What is in the image?"}
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "<answer>1</answer>"}]}]

    def render_both() -> str:
        prompt = build_row_prompt(processor, row, 1, cfg.data.system_prompt, 0)
        messages = prompt_messages_of(row, 1, 0, cfg.data.system_prompt)
        return prompt + render_chat(processor, messages + answer, add_generation_prompt=False)

    try:
        probe(render_both, template_source(processor))
    except TemplateBudgetError:
        raise
    except Exception:  # the template's own errors are reported on a real row (check_chat_template)
        pass
    return processor


def check_chat_template(cfg: Config, row: dict, processor=None) -> list[str]:
    """Render the model's chat template on a real row (its problem, image count and data.system_prompt), as step
    1 would: a template that raises (jinja's sandbox SecurityError, raise_exception, a missing variable) fails here
    in one line instead of after the weights load. Loads the processor (seconds), never the weights. Returns what
    to tell the user: with tools, whether the template shows them to the model."""

    name = cfg.model.name_or_path
    processor = processor or _template_processor(cfg)
    if processor is None:
        return []
    images = len((row.get("images") or [])[: cfg.data.limit_images])
    tools = tool_schemas(cfg)
    try:
        text = build_row_prompt(processor, row, images, cfg.data.system_prompt, len(row.get("videos") or []), tools)
        plain = build_row_prompt(processor, row, images, cfg.data.system_prompt, len(row.get("videos") or [])) if tools else text
    except TemplateBudgetError:
        raise
    except Exception as e:  # any error from the user's template is the template's
        where = row.get("_source", "the first data row")
        raise ModelLoadError(
            f"the chat template of {name} fails on {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            "fix chat_template.jinja (or chat_template in tokenizer_config.json)"
        ) from None
    return tools_note(name, tools, text, plain)


def tools_note(model: str, tools: list[dict] | None, with_tools: str, without: str) -> list[str]:
    """Whether the chat template shows the model its tools: the prompt rendered with the tools' schemas and without."""
    if not tools:
        return []
    names = ", ".join(t["function"]["name"] for t in tools)
    if with_tools == without:
        return [
            f"tools: the chat template of {model} ignores the tools' schemas (the prompt is the same with and without "
            f"them): the model is not told that {names} exist; describe them in data.system_prompt or use a template that renders tools"
        ]
    return [f"tools: the chat template of {model} describes {names} to the model in every prompt ({len(with_tools) - len(without):,} characters)"]


def describe_rewards(cfg: Config, funcs: dict, rows: list[dict]) -> list[str]:
    """One line per reward: which definition a built-in name is, or how a user reward is called and with what."""

    columns = list(reward_columns(rows, 1))
    form = resolve_completion_format(cfg.algorithm.completion_format, rows, cfg.data.system_prompt)
    return [describe_call(name, fn, columns, form, builtin=BUILTIN_REWARDS.get(name) is fn) for name, fn in funcs.items()]


def check_trackers(cfg: Config) -> None:
    """ConfigError when a tracker in logging.report_to needs a package that is not installed (found without importing it)."""

    missing = missing_tracker_packages(resolve_report_to(cfg.logging.report_to))
    if missing:
        raise ConfigError(missing[0])


# ---------------------------------------------------------------------------------------------------
# Model folder


def check_model_folder(cfg: Config) -> None:
    """ModelLoadError listing everything the model folder lacks (models.check_model_folder). The embedded model is
    built by vlmrl, and a hub id with model.allow_hub_download=true is fetched by transformers: neither is a
    folder to check."""

    check_attention(cfg.model.attn_implementation)  # flash_attention_2 without flash-attn (a converted VLM-R1 script's)
    name = cfg.model.name_or_path
    folder = Path(name).expanduser()
    if name == EMBEDDED_MODEL or (cfg.model.allow_hub_download and not folder.exists()):
        return
    if not folder.is_dir():
        raise ModelLoadError(
            f"model.name_or_path: {folder} {'does not exist' if not folder.exists() else 'is not a folder'} (vlmrl "
            "loads local folders; model.allow_hub_download=true lets transformers download a hub id)"
        )
    require_complete_model_folder(folder)
    check_weight_files(folder)  # every safetensors header against its file (no tensor read)


# ---------------------------------------------------------------------------------------------------
# Rewards


def check_rewards_on_rows(cfg: Config, funcs: dict, weights: dict, rows: list[dict]) -> None:
    """Call every reward on a few real rows, with the completion a correct model would write (the SFT target)
    in algorithm.completion_format, so a reward that cannot take these inputs fails now with its own error
    (RewardError naming the reward and the sample) instead of after the model loads. ``completion_ids`` are
    placeholders (no tokenizer is loaded yet)."""

    if any("image_path" in row for row in rows):  # VLM-R1 rows: their rewards also get image_grid_thw (runtime.note_image_grids)
        encode_rows(configured_processor(cfg), rows, cfg, "cpu")
    texts = [sft_target(row) for row in rows]
    prompts, completions = reward_inputs(rows, texts, 1, cfg.algorithm.completion_format, cfg.data.system_prompt, cfg.data.limit_images)
    when = "the check before training (the row's solution as the completion)"
    name_rows(funcs, when, row_sources(rows, 1), reward_columns(rows, 1))
    try:
        compute_rewards(
            funcs,
            weights,
            prompts,
            completions,
            reward_columns(rows, 1),
            completion_ids=[[0] for _ in rows],
            trainer_state=TrainerState(global_step=0, max_steps=cfg.training.max_steps),
            when=when,
            sources=row_sources(rows, 1),
            timeout_s=cfg.algorithm.reward_timeout_s,
        )
    except ValueError as e:  # the data's columns do not fit the reward call, e.g. a column named completion_ids
        raise DataError(f"{rows[0].get('_source', 'data')}: {e}") from None


# ---------------------------------------------------------------------------------------------------
# What eval scores


def check_eval_data(cfg: Config) -> None:
    """`vlmrl eval` scores data.eval_path. Without it, only a run on the built-in task (the embedded model, or a
    model folder a vlmrl run trained on the built-in task) may fall back to that task's test split; anything
    else would report the built-in task's score as if it were the user's, so it is refused."""
    if cfg.data.eval_path:
        return
    if cfg.data.train_path:
        raise ConfigError(
            f"data.eval_path is empty (data.train_path={cfg.data.train_path} is your data); set "
            "data.eval_path=<held-out file> so eval scores your data, not the built-in task"
        )
    if cfg.model.name_or_path == EMBEDDED_MODEL or trained_on_builtin_task(Path(cfg.model.name_or_path).expanduser()):
        return
    raise ConfigError(
        f"data.eval_path is empty; set data.eval_path=<held-out file> to score "
        f"{cfg.model.name_or_path} (only the embedded model or a run on the built-in task falls back to the "
        f"built-in {cfg.data.task!r} task)"
    )


def trained_on_builtin_task(model_folder: Path) -> bool:
    """Whether `model_folder` is the final model of a vlmrl run (output_dir/final) whose config used the built-in task."""

    run_config = model_folder.parent / "config.yaml"
    try:
        saved = yaml.safe_load(run_config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    data = saved.get("data") if isinstance(saved, dict) else None
    return isinstance(data, dict) and not data.get("train_path") and model_folder.name == "final"


def eval_data_name(cfg: Config) -> str:
    """What `vlmrl eval` scores, for the line it prints."""
    return cfg.data.eval_path or f"the built-in {cfg.data.task!r} task's test split (data.eval_path is empty)"
