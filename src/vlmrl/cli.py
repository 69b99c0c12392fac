"""Command line: `vlmrl train|sft|eval|demo|config|plan`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from .config import ConfigError, load_config

DEBUG_ENV = "VLMRL_DEBUG"
CONFIG_HELP = ("optional YAML config, then any number of key=value overrides, e.g. "
               "rollout.num_generations=8 training.max_steps=50 (TRL names without a section also work: beta=0.04)")


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """First positional that is not key=value is the YAML path."""
    path = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise ConfigError(f"unexpected argument {a!r}: give one config file and key=value overrides")
    return path, overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmrl", description="GRPO and SFT for vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [("train", "GRPO training (rollout, rewards, group advantages, clipped updates)."),
                       ("sft", "Supervised fine-tuning: stage 1 projector only, stage 2 language model."),
                       ("eval", "Greedy evaluation on the held-out split: reward means, accuracy / IoU.")]:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("args", nargs="*", help=CONFIG_HELP)
    d = sub.add_parser("demo", help="Build the tiny model, synthesize data, SFT, GRPO, evaluate, report.",
                       description="The end-to-end demo on the embedded tiny Qwen2.5-VL (CPU, a few minutes).")
    d.add_argument("--output-dir", default="outputs/demo")
    d.add_argument("--quick", action="store_true", help="A few steps only (smoke test).")
    sub.add_parser("config", help="Print the config reference (markdown) generated from the field docs.")
    ex = sub.add_parser("export", help="Write a checkpoint (or a run folder's newest) as a plain HF model folder.",
                        description="Checkpoint -> plain HF folder: base model + trained weights (LoRA merged) + processor.")
    ex.add_argument("checkpoint", help="output_dir/checkpoint-<step>, or a run folder (its newest valid checkpoint)")
    ex.add_argument("out", help="folder to write")
    from .plan_cli import add_arguments as add_plan_arguments

    pl = sub.add_parser("plan", help="Predict the per-GPU memory peak of a GRPO step before launch; --search for configs that fit.",
                        description="Memory planner: every term of the per-device peak, a verdict, --search, --trace (docs/planner.md).")
    add_plan_arguments(pl)
    ns = parser.parse_args(argv)
    if ns.command == "plan":
        from .plan_cli import run_safely

        return run_safely(ns)
    try:
        return _dispatch(ns)
    except user_error_types() as e:
        return report_user_error(ns.command, e)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Failures the user fixes (config, data, model folder, rewards, checkpoints / resume, out of memory at size 1):
    they end the run with one message and exit code 2; anything else is a bug and keeps its traceback."""
    from . import checkpoint
    from .data import DataError
    from .models import ModelLoadError
    from .oom import OutOfMemoryGaveUp
    from .rewards import RewardError

    extra = tuple(getattr(checkpoint, name) for name in ("ResumeError",) if hasattr(checkpoint, name))
    return (ConfigError, DataError, ModelLoadError, RewardError, checkpoint.CheckpointError, OutOfMemoryGaveUp, *extra)


def report_user_error(command: str, error: BaseException) -> int:
    """Print `vlmrl <command>: <message>` on stderr (the traceback too with VLMRL_DEBUG=1); returns exit code 2."""
    if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes"):
        traceback.print_exception(error)
    print(f"vlmrl {command}: {error}", file=sys.stderr)
    return 2


def _dispatch(ns) -> int:
    if ns.command == "config":
        from .config import reference_markdown

        print(reference_markdown())
        return 0
    if ns.command == "export":
        from .distributed import export_checkpoint

        export_checkpoint(ns.checkpoint, ns.out)
        return 0
    if ns.command == "demo":
        from .demo import run_demo

        run_demo(ns.output_dir, quick=ns.quick)
        return 0
    return _run(ns.command, load_config(*_split(ns.args)))


def _run(command: str, cfg) -> int:
    from .runtime import hf_progress_bars

    with hf_progress_bars(cfg.logging.progress_bar):  # also the loads inside the run (checkpoint weights on resume)
        if command == "train":
            from .train import train

            metrics = train(cfg)
        elif command == "sft":
            from .sft import sft

            metrics = sft(cfg)
        else:
            metrics = run_eval(cfg)
    from .distributed import env_world

    if env_world()[1] == 0:  # one line of results, from the main process only
        print(json.dumps({k: v for k, v in metrics.items() if k.startswith("eval/")}, indent=1))
    return 0


def run_eval(cfg) -> dict:
    from .evaluate import evaluate
    from .runtime import load_datasets, load_policy, load_reward_funcs, resolve_device, seed_everything

    device = resolve_device(cfg.training.device)
    seed_everything(cfg.training.seed)
    model, processor = load_policy(cfg, device)
    data = load_datasets(cfg, need_train=False, processor=processor)
    if not data.eval:
        raise ConfigError("data.eval_path is empty and no built-in task test split is configured; set data.eval_path")
    funcs, _ = load_reward_funcs(cfg)
    metrics = evaluate(model, processor, data.eval, cfg, funcs, device)
    out = Path(cfg.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(metrics, indent=1))
    return metrics


if __name__ == "__main__":
    sys.exit(main())
