"""A run's datasets: the validated train and eval rows (the built-in task written when no path is set), and prompt
batches encoded from rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrl.config import Config, ConfigError, DataConfig, TrainingConfig
from vlmrl.engine.device import env_world
from vlmrl.models.loading import resolve_model_path
from vlmrl.checkpoints.run_manifest import is_owned, record
from vlmrl.config import replace, to_dict
from vlmrl.data.errors import DataError, MissingData
from vlmrl.data.validation import bad_rows_records, merge_reports
from vlmrl.data.rows import data_files, load_dataset_split, roots_per_file
from vlmrl.data.media import load_images, load_video, shared_image_cache
from vlmrl.data.tasks import TASKS
from vlmrl.data.video import VideoError
from vlmrl.run.tool_rollout import tool_schemas
from vlmrl.models.processing import FIXED_FRAME_PROCESSORS, ImageShapeCheck, build_row_prompt, encode_prompts, load_processor, video_support
from vlmrl.run.prompt_budget import PromptLengths, apply_prompt_budget
from vlmrl.run.tracking import read_jsonl
import json
import math


@dataclass
class Datasets:
    train: list[dict]
    eval: list[dict]
    reports: list[str]
    prompts: PromptLengths | None = None  # the training rows' prompt lengths (the longest: the planner's input)


# Datasets validated by the preflight (cli.py), handed once to the run's own load_datasets call with the same settings.
_VALIDATED: dict[str, Datasets] = {}


def _datasets_key(cfg: Config, need_train: bool) -> str:

    return json.dumps(
        [to_dict(cfg)["data"], cfg.training.output_dir, cfg.training.seed, cfg.training.eval_max_samples, need_train], sort_keys=True, default=str
    )


def load_datasets(cfg: Config, need_train: bool = True, keep_for_run: bool = False, processor=None) -> Datasets:
    """Validated train and eval rows; the built-in task is generated under output_dir/data when no path is set.

    ``keep_for_run``: the preflight validated them; the next call with the same settings gets them without
    reading every row again (once: they are not held after that). Images are checked against what the model's
    processor accepts (`image_shape_check`); without `processor` the model folder's processor is loaded for that."""
    key = _datasets_key(cfg, need_train)
    if key in _VALIDATED:
        return _VALIDATED.pop(key)
    data = _load_datasets(cfg, need_train, processor)
    if keep_for_run:
        _VALIDATED.clear()
        _VALIDATED[key] = data
    return data


def _load_datasets(cfg: Config, need_train: bool, processor=None) -> Datasets:

    d = cfg.data
    train_path, eval_path = d.train_path, d.eval_path
    if (need_train and not train_path) or (not eval_path and not train_path):
        task_dir = Path(cfg.training.output_dir) / "data" / d.task

        if task_dir.parent.exists() and not is_owned(task_dir.parent):
            raise ConfigError(
                f"{task_dir.parent} was not written by vlmrl; the built-in task writes its files there: move it, or pick another training.output_dir"
            )
        record(task_dir.parent.parent, ["data"])  # the built-in task's generated files are vlmrl's
        options = {"distractors": d.task_distractors} if d.task == "count" else {}
        options["colours"] = tuple(d.task_colours)
        files = TASKS[d.task](
            task_dir, n_train=d.task_train_size, n_test=d.task_test_size, seed=cfg.training.seed, image_size=d.task_image_size, **options
        )
        train_path = train_path or str(files["train"])
        eval_path = eval_path or (str(files["test"]) if d.task_test_size else "")
    reports = []
    processor = processor if processor is not None else configured_processor(cfg)
    checks = {"max_image_pixels": d.max_image_pixels, "shape_check": image_shape_check(cfg, processor)}
    layout = data_layout_options(cfg.data)
    train_rows: list[dict] = []
    prompts = None
    if need_train:
        train_rows, rep = load_data_files(train_path, "data.train_path", cfg.data, checks, layout)
        shown = ", ".join(data_files(train_path))
        train_rows, prompts = apply_prompt_budget(processor, cfg, train_rows, rep, shown)
        reports.append(f"train {shown}: {rep.summary()}; {prompts.describe()}{record_bad_rows(cfg.training, 'train', rep)}")
    eval_rows: list[dict] = []
    if eval_path:
        eval_rows, rep = load_data_files(eval_path, "data.eval_path", cfg.data, checks, layout)
        eval_rows, _ = apply_prompt_budget(processor, cfg, eval_rows, rep, eval_path)
        if cfg.training.eval_max_samples:
            eval_rows = eval_rows[: cfg.training.eval_max_samples]
        reports.append(f"eval {eval_path}: {rep.summary()}{record_bad_rows(cfg.training, 'eval', rep)}")
    refuse_videos_without_support(train_rows, eval_rows, processor, cfg)
    return Datasets(train=train_rows, eval=eval_rows, reports=reports, prompts=prompts)


def load_data_files(value, field: str, d: DataConfig, checks: dict, layout: dict) -> tuple[list[dict], object]:
    """The validated rows of data.train_path / data.eval_path (one data file or a list of them, read in order, each with
    its own data.image_root folder when there are as many: rows.roots_per_file) and one report for them all."""
    files = data_files(value)
    rows: list[dict] = []
    reports = []
    # data.train_path reads a hub-style folder's train split when it names none (EasyR1, datasets.load_dataset);
    # evaluation must name its split (evaluating on the training rows by default would mislead).
    split = "train" if field == "data.train_path" else None
    for file, roots in zip(files, roots_per_file(files, d.image_root, field)):
        try:
            got, rep = load_dataset_split(
                file, limit_images=d.limit_images, skip_bad_rows=d.skip_bad_rows, image_roots=roots, default_split=split, **checks, **layout
            )
        except MissingData as e:
            raise DataError(f"{field}={file}: {e}") from None
        rows += got
        reports.append(rep)
    return rows, merge_reports(reports, files)


def data_layout_options(d: DataConfig) -> dict:
    """How data files are read (formats.py): data.format, data.columns, data.prompt_template (a .jinja file's text, or
    the template itself). data.image_root is per data file (load_data_files)."""
    template = d.prompt_template
    if template and template.endswith((".jinja", ".j2", ".txt")) and "{{" not in template:
        path = Path(template).expanduser()
        if not path.is_file():
            raise DataError(f"data.prompt_template: file not found: {path}")
        template = path.read_text(encoding="utf-8")
    return {"layout": d.format, "columns": dict(d.columns), "prompt_template": template or None}


def refuse_videos_without_support(train_rows: list[dict], eval_rows: list[dict], processor, cfg: Config) -> None:
    """Video rows for a model whose processor vlmrl cannot feed videos: one line before any training, naming a row."""

    with_video = [r for r in [*train_rows, *eval_rows] if r.get("videos")]
    if not with_video:
        return
    reason = video_support(processor if processor is not None else configured_processor(cfg))
    if reason:
        raise DataError(f"{with_video[0].get('_source', '?')} and {len(with_video) - 1} more rows have videos, but {reason}")


def image_shape_check(cfg: Config, processor=None):
    """The check of image sizes against the model's image processor (processing.ImageShapeCheck)."""

    processor = processor if processor is not None else configured_processor(cfg)
    return ImageShapeCheck(processor, cfg.data.min_pixels, cfg.data.max_pixels, cfg.data.max_image_pixels)


def configured_processor(cfg: Config):
    """The model folder's processor with the configured pixel bounds."""

    return load_processor(
        resolve_model_path(cfg.model.name_or_path),
        trust_remote_code=cfg.model.trust_remote_code,
        min_pixels=cfg.data.min_pixels,
        max_pixels=cfg.data.max_pixels,
        local_files_only=not cfg.model.allow_hub_download,
    )


def record_bad_rows(t: TrainingConfig, split: str, report) -> str:
    """Every problem of the rows data.skip_bad_rows dropped, one JSON line each (``split``, ``source`` = file:line,
    ``field``, ``kind``, ``reason``), in output_dir/bad_rows.jsonl (rewritten per split each run, main process only).
    Returns the text that points the report line to that file ('' when nothing was dropped).

    The file is listed in output_dir's manifest as it is written: the preflight (and `vlmrl check`) read the data
    before the run claims the folder, and the run must then take it as its own. A bad_rows.jsonl vlmrl did not
    write is never replaced nor deleted: DataError when rows were dropped (their list has nowhere to go), else it is
    left as it is."""

    out = Path(t.output_dir)
    path = out / "bad_rows.jsonl"
    if env_world()[1] == 0:
        if (path.exists() or path.is_symlink()) and not is_owned(path):
            if not report.problems:
                return ""
            raise DataError(
                f"training.output_dir={out} holds bad_rows.jsonl, which vlmrl did not write but the dropped rows would be listed "
                f"in; move it out of {out} or pick another training.output_dir"
            )
        # The other split's lines stay (train and eval load one after the other); unreadable lines go.
        kept = [json.dumps(r, ensure_ascii=False) for r in read_jsonl(path) if isinstance(r, dict) and r.get("split") != split]
        lines = kept + [json.dumps({"split": split, **r}, ensure_ascii=False) for r in bad_rows_records(report)]
        if lines:
            record(out, [path.name])  # before writing: a kill in between leaves a listed name, never an unlisted file
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        elif path.exists():
            path.unlink()
    return f" (all listed in {path})" if report.skipped_rows else ""


def encode_rows(processor, rows: list[dict], cfg: Config, device: torch.device) -> dict:
    """Prompt batch for dataset rows: chat-template text + images, left padded, on `device`."""

    d = cfg.data
    texts, images, videos = row_prompt_inputs(processor, rows, cfg)
    try:
        batch = encode_prompts(processor, texts, images, videos if any(videos) else None)
    except ValueError as e:  # what validation could not foresee still names the rows
        raise _rows_error(rows, images, e) from e
    if d.max_prompt_length is not None:
        refuse_long_prompts(rows, batch["attention_mask"].sum(dim=1).tolist(), d.max_prompt_length)
    note_image_grids(rows, batch)
    # Pixel values in the weights' dtype: some processors compute in bfloat16 (Llama 4's) and some vision towers do
    # not cast their input (Llama 4's patch embedding), so a float32 run would fail on bfloat16 pixels (or the reverse).
    # (Pixels only: other float inputs, e.g. Qwen2.5-VL's seconds per temporal patch, keep their precision.)
    dtype = getattr(torch, cfg.model.dtype)
    return {k: (v.to(device, dtype) if k.startswith("pixel_values") else v.to(device)) if torch.is_tensor(v) else v for k, v in batch.items()}


def row_prompt_inputs(processor, rows: list[dict], cfg: Config) -> tuple[list[str], list[list], list[list]]:
    """What the processor turns into a prompt batch, per row: the chat-template text (one placeholder per image or
    video, not expanded), its images (PIL, resized to data.min/max_pixels) and its videos (lists of frames). The
    vLLM backend sends the same text and images to vLLM, which expands the placeholders itself."""
    d = cfg.data
    cache = shared_image_cache(d.image_cache_mb)
    images = [_row_images(r, d, cache) for r in rows]
    exact = type(processor).__name__ in FIXED_FRAME_PROCESSORS  # LLaVA-OneVision batches videos of one frame count
    videos = [[_load_row_video(r, v, d, cache, exact) for v in r.get("videos") or []] for r in rows]
    tools = tool_schemas(cfg)  # the tools the model may call, for templates that describe them
    texts = [build_row_prompt(processor, r, len(imgs), d.system_prompt, len(vids), tools) for r, imgs, vids in zip(rows, images, videos)]
    return texts, images, videos


def _row_images(row: dict, d, cache) -> list:
    """A row's images; a file that broke after the check (truncated, replaced) names the row too."""

    try:
        return load_images(row["images"][: d.limit_images], d.min_pixels, d.max_pixels, max_image_pixels=d.max_image_pixels, cache=cache)
    except DataError as e:
        source = row.get("_source")
        raise DataError(f"{source}: {e}" if source and not str(e).startswith(str(source)) else str(e)) from e


def note_image_grids(rows: list[dict], batch: dict) -> None:
    """VLM-R1's rows (they carry ``image_path``) get ``image_grid_thw``: their first image's [t, h, w] patch grid, as
    VLM-R1's trainer hands it to rewards (its IoU reward rescales boxes with it). Set on the row itself: the grid of a
    row's image does not change between steps."""
    grids = batch.get("image_grid_thw")
    if grids is None or not any("image_path" in r for r in rows):
        return
    start = 0
    for row, n in zip(rows, batch["images_per_row"].tolist()):
        if n and "image_path" in row:
            row["image_grid_thw"] = [int(v) for v in grids[start].tolist()]
        start += n


def refuse_long_prompts(rows: list[dict], lengths: list[int], limit: int) -> None:
    """data.max_prompt_length: DataError naming the first row whose prompt (image tokens included) is longer."""

    for row, n in zip(rows, lengths):
        if n > limit:
            raise DataError(
                f"{row.get('_source', '?')}: the prompt is {n} tokens (image tokens included), over data.max_prompt_length={limit}; "
                "raise it, lower data.max_pixels, or drop the row"
            )


def train_row_count(cfg: Config) -> int:
    """Rows of the training data, read (and kept for the run) unless the preflight already read them."""
    key = _datasets_key(cfg, True)
    if key not in _VALIDATED:
        _VALIDATED.clear()
        _VALIDATED[key] = _load_datasets(cfg, True)
    return len(_VALIDATED[key].train)


def epochs_as_steps(cfg: Config, log=print) -> Config:
    """training.num_train_epochs: the config with training.max_steps = ceil(epochs x rows / prompts per step)."""

    epochs = cfg.training.num_train_epochs
    if epochs is None:
        return cfg
    rows = train_row_count(cfg)
    steps = max(1, math.ceil(epochs * rows / cfg.prompts_per_step))
    if steps != cfg.training.max_steps:
        log(f"training.num_train_epochs={epochs:g}: {rows} rows at {cfg.prompts_per_step} prompts per step -> training.max_steps={steps}")
    return replace(cfg, training__max_steps=steps)


def _load_row_video(row: dict, source, d, cache, exact_frames: bool = False):
    """One video of a row (data.load_video under data.max_frames / fps / video_max_pixels); errors name the row."""

    try:
        return load_video(
            source,
            max_frames=d.max_frames,
            fps=d.fps,
            min_pixels=None,
            max_pixels=d.video_max_pixels,
            cache=cache,
            exact_frames=exact_frames,
            max_image_pixels=d.max_image_pixels,
        )
    except (VideoError, DataError) as e:
        raise DataError(f"{row.get('_source', '?')}: video: {e}") from e


def _rows_error(rows: list[dict], images: list[list], error: Exception):
    """DataError naming each row of a batch the processor refused, with its image sizes after resizing."""

    described = "; ".join(f"{r.get('_source', '?')} (images {[f'{im.width}x{im.height}' for im in imgs]})" for r, imgs in zip(rows, images))
    return DataError(f"the processor refused a batch of rows: {described}: {type(error).__name__}: {' '.join(str(error).split())}")
