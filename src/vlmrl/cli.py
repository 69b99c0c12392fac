"""Command line: `vlmrl train|sft|eval|demo|config|plan`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import ConfigError, load_config

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
    ex.add_argument("overrides", nargs="*", help="key=value settings that replace the checkpoint's config, e.g. "
                    "model.name_or_path=<base model folder>; model.trust_remote_code / model.allow_hub_download are "
                    "never taken from the checkpoint, only from here (with model.name_or_path)")
    from .plan_cli import add_arguments as add_plan_arguments

    pl = sub.add_parser("plan", help="Predict the per-GPU memory peak of a GRPO step before launch; --search for configs that fit.",
                        description="Memory planner: every term of the per-device peak, a verdict, --search, --trace (docs/planner.md).")
    add_plan_arguments(pl)
    ns = parser.parse_args(argv)
    if ns.command == "plan":
        from .plan_cli import run_safely

        return run_safely(ns)

    try:
        if ns.command == "config":
            from .config import reference_markdown

            print(reference_markdown())
            return 0
        if ns.command == "export":
            from .checkpoint import CheckpointError
            from .distributed import export_checkpoint
            from .models import ModelLoadError

            try:
                export_checkpoint(ns.checkpoint, ns.out, overrides=ns.overrides)
            except (CheckpointError, ModelLoadError) as e:  # ModelLoadError: the base model named in config.yaml is not there
                print(f"vlmrl export: {e}", file=sys.stderr)
                return 2
            return 0
        if ns.command == "demo":
            from .demo import run_demo

            run_demo(ns.output_dir, quick=ns.quick)
            return 0
        cfg = load_config(*_split(ns.args))
    except ConfigError as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2
    return _run(ns.command, cfg)


def _run(command: str, cfg) -> int:
    from .checkpoint import CheckpointError
    from .data import DataError
    from .models import ModelLoadError
    from .rewards import RewardError
    from .rundir import RunAlreadyComplete

    try:
        if command == "train":
            from .train import train

            metrics = train(cfg)
        elif command == "sft":
            from .sft import sft

            metrics = sft(cfg)
        else:
            metrics = run_eval(cfg)
    except RunAlreadyComplete as e:  # running a finished run again: nothing to do, not a failure
        print(f"vlmrl {command}: {e}", file=sys.stderr)
        return 0
    except (DataError, ModelLoadError, RewardError, ConfigError, CheckpointError) as e:
        # CheckpointError: a refused resume, an invalid or unsafe checkpoint, a failed save (training.on_save_error=stop).
        print(f"vlmrl {command}: {e}", file=sys.stderr)
        return 2
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
    data = load_datasets(cfg, need_train=False)
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
