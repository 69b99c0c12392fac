"""Command line: `vlmrl train|sft|eval|check|demo|config|plan|export|tiny|convert|rollout-server`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import traceback
from pathlib import Path

from vlmrl.config import ConfigError, load_config
from vlmrl.config import reference_markdown
from vlmrl.defaults import describe

DEBUG_ENV = "VLMRL_DEBUG"
CONFIG_HELP = (
    "optional YAML config, then any number of key=value overrides, e.g. "
    "rollout.num_generations=8 training.max_steps=50 (TRL names without a section also work: beta=0.04)"
)


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


# Per command: (one-line help, description, epilog with an example and the pointer to `vlmrl config`).
COMMAND_HELP = {
    "train": (
        "GRPO training from rewards.",
        "GRPO training (rollout, rewards, group advantages, clipped updates). Checks the config, data, rewards "
        "and model folder first (as vlmrl check does), then trains; resumes from output_dir's newest checkpoint.",
        "example:\n"
        "  vlmrl train model.name_or_path=outputs/sft/final data.train_path=data/train.parquet \\\n"
        "    data.eval_path=data/test.parquet algorithm.reward_funcs='[accuracy, answer_format]' \\\n"
        "    training.output_dir=outputs/grpo\n\n"
        "Every setting (GRPO: rollout.*, algorithm.*, optim.*, training.*): vlmrl config",
    ),
    "sft": (
        "Supervised fine-tuning on the rows' targets.",
        "Supervised fine-tuning on each row's response (default <answer>solution</answer>): stage 1 the "
        "projector only (sft.projector_steps), stage 2 the language model (sft.steps, sft.learning_rate). "
        "Runs the same checks first as train.",
        "example:\n"
        "  vlmrl sft model.name_or_path=/models/Qwen2.5-VL-3B-Instruct data.train_path=data/train.jsonl \\\n"
        "    data.eval_path=data/test.jsonl sft.steps=200 sft.learning_rate=1e-5 training.output_dir=outputs/sft\n"
        "then GRPO from it: vlmrl train model.name_or_path=outputs/sft/final ...\n\n"
        "Every setting (SFT: sft.*, data.*, model.*): vlmrl config",
    ),
    "eval": (
        "Greedy evaluation on data.eval_path.",
        "Greedy evaluation of a model on data.eval_path: reward means (eval/<reward>, e.g. accuracy or IoU), "
        "written to output_dir/eval.json. data.eval_path is required except for runs on the built-in task.",
        "example:\n"
        "  vlmrl eval model.name_or_path=outputs/grpo/final data.eval_path=data/test.parquet \\\n"
        "    algorithm.reward_funcs='[accuracy]' training.output_dir=outputs/eval\n\n"
        "Every setting: vlmrl config",
    ),
    "check": (
        "Check config, data, rewards and model folder without loading weights.",
        "Run train's checks in seconds, without loading any weights: the config, every data row, the reward "
        "functions called on a few real rows, the model folder's files; then say which defaults apply, what a run "
        "would do with output_dir (new, resume from step N, complete) and the memory planner's verdict for the "
        "device (exit 1 when the run is predicted not to fit, 2 on any other problem).",
        "example:\n  vlmrl check my.yaml data.train_path=data/train.parquet\n\nEvery setting: vlmrl config",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmrl", description="GRPO and SFT for vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (short, text, epilog) in COMMAND_HELP.items():
        p = sub.add_parser(
            name, help=short, description=textwrap.fill(text, 100), epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("args", nargs="*", help=CONFIG_HELP)
    d = sub.add_parser(
        "demo",
        help="Build the tiny model, synthesize data, SFT, GRPO, evaluate, report.",
        description="The end-to-end demo on the embedded tiny Qwen2.5-VL (CPU, a few minutes).",
    )
    d.add_argument("--output-dir", default="outputs/demo")
    d.add_argument("--quick", action="store_true", help="A few steps only (smoke test).")
    sub.add_parser("config", help="Print the config reference (markdown) generated from the field docs.")
    from vlmrl.tiny_models.tiny_families import add_tiny_arguments

    add_tiny_arguments(sub)
    ex = sub.add_parser(
        "export",
        help="Write a checkpoint (or a run folder's newest) as a plain HF model folder.",
        description="Checkpoint -> plain HF folder: base model + trained weights (LoRA merged) + processor.",
    )
    ex.add_argument("checkpoint", help="output_dir/checkpoint-<step>, or a run folder (its newest valid checkpoint)")
    ex.add_argument("out", help="folder to write")
    ex.add_argument(
        "overrides",
        nargs="*",
        help="key=value settings that replace the checkpoint's config, e.g. "
        "model.name_or_path=<base model folder>; model.trust_remote_code / model.allow_hub_download are "
        "never taken from the checkpoint, only from here (with model.name_or_path)",
    )
    from vlmrl.plan.cli import add_arguments as add_plan_arguments

    pl = sub.add_parser(
        "plan",
        help="Predict the per-GPU memory peak of a GRPO step before launch; --search for configs that fit.",
        description="Memory planner: every term of the per-device peak, a verdict, --search, --trace (docs/planner.md).",
    )
    add_plan_arguments(pl)
    cv = sub.add_parser(
        "convert",
        help="Write another trainer's config (TRL, EasyR1, ms-swift, VLM-R1) as a vlmrl YAML.",
        description="vlmrl convert --from trl|easyr1|ms-swift|vlm-r1 [-o vlmrl.yaml] [--processes N] FILE_OR_ARGS: a YAML config, a launch "
        "script, or its --key value (EasyR1: key=value) arguments; lists every key with no vlmrl equivalent and why.",
    )
    cv.add_argument("--from", dest="peer", required=True, choices=["trl", "easyr1", "ms-swift", "vlm-r1"])
    cv.add_argument("-o", "--output", default="vlmrl.yaml", help="YAML to write (never overwritten)")
    cv.add_argument("--processes", type=int, help="GPUs the source ran on, when it does not say (its per-GPU batch sizes become vlmrl's global ones)")
    cv.add_argument("source", nargs="*", help="config file, launch script, or the --key value arguments themselves")
    sub.add_parser("rollout-server", help="Serve rollouts from a vLLM engine to a run with rollout.vllm_mode=server (vlmrl rollout-server -h).")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rollout-server"]:  # its own options (rollout/server.py)
        from vlmrl.rollout.server import main as serve

        return serve(argv[1:])
    if argv[:1] == ["convert"] and "-h" not in argv and "--help" not in argv:
        return _convert(argv[1:])
    ns = parser.parse_args(argv)
    if ns.command == "plan":
        from vlmrl.plan.cli import run_safely

        return run_safely(ns)
    from vlmrl.rewards.forks import leave_if_forked

    owner = os.getpid()
    try:
        code = _run_command(ns, owner)
    except BaseException as e:
        leave_if_forked(owner, f"vlmrl {ns.command}", e)  # a process forked by user code never reports the run's errors
        raise
    leave_if_forked(owner, f"vlmrl {ns.command}")
    return code


def _run_command(ns, owner: int) -> int:
    """The command, its user errors reported in one line (exit 2) by the process that started it (`owner`)."""
    from vlmrl.rewards.forks import leave_if_forked
    from vlmrl.run.rundir import RunAlreadyComplete

    try:
        return _dispatch(ns)
    except (RunAlreadyComplete, *user_error_types()) as e:
        leave_if_forked(owner, f"vlmrl {ns.command}", e)
        return _report(ns.command, e)


def _report(command: str, e: BaseException) -> int:
    from vlmrl.run.rundir import RunAlreadyComplete

    if isinstance(e, RunAlreadyComplete):  # running a finished run again: nothing to do, not a failure
        print(f"vlmrl {command}: {e}", file=sys.stderr)
        return 0
    code = report_user_error(command, e)
    from vlmrl.engine.oom import OutOfMemoryAbort

    if isinstance(e, OutOfMemoryAbort):
        # The other processes were stopped inside a collective; a normal interpreter exit can wait forever on them
        # (DeepSpeed's process-group teardown does), so this one ends at once, as they did (abort.watch_for_abort).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _convert(argv: list[str]) -> int:
    """`vlmrl convert`: its own options first (--from, -o), everything else is the source (a file or a peer's --key value)."""
    from vlmrl.run.convert import run_convert

    own = {"--from": None, "-o": "vlmrl.yaml", "--processes": None}
    rest, i = [], 0
    while i < len(argv):
        name = "-o" if argv[i] == "--output" else argv[i]
        if name in own and i + 1 < len(argv):
            own[name] = argv[i + 1]
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    try:
        if own["--from"] is None:
            raise ConfigError("vlmrl convert: say which trainer the config is for: --from trl|easyr1|ms-swift|vlm-r1")
        processes = own["--processes"]
        if processes is not None and not processes.isdigit():
            raise ConfigError(f"vlmrl convert: --processes takes the number of GPUs the source ran on, got {processes!r}")
        log = lambda line: print(line, file=sys.stderr)  # noqa: E731
        return run_convert(own["--from"], rest, own["-o"], log=log, processes=int(processes) if processes else None)
    except user_error_types() as e:
        return report_user_error("convert", e)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Failures the user fixes (config, data, model folder, rewards, checkpoints / resume, out of memory at size 1,
    a sampler whose prompts or weights are not the trainer's, a rollout server gone):
    they end the run with one message and exit code 2; anything else is a bug and keeps its traceback."""
    import vlmrl.checkpoints.files as checkpoint
    from vlmrl.data.errors import DataError
    from vlmrl.models.loading import ModelLoadError
    from vlmrl.engine.oom import OutOfMemoryGaveUp
    from vlmrl.rewards.guard import RewardError
    from vlmrl.run.tracking import TrackerError
    from vlmrl.rollout.parity import RolloutParityError
    from vlmrl.rollout.wire import RolloutServerError
    from vlmrl.train import NonFiniteStop

    extra = tuple(getattr(checkpoint, name) for name in ("ResumeError",) if hasattr(checkpoint, name))
    return (
        ConfigError,
        DataError,
        ModelLoadError,
        RewardError,
        TrackerError,
        checkpoint.CheckpointError,
        OutOfMemoryGaveUp,
        NonFiniteStop,
        RolloutParityError,
        RolloutServerError,
        *extra,
    )


def report_user_error(command: str, error: BaseException) -> int:
    """Print `vlmrl <command>: <message>` on stderr (the traceback too with VLMRL_DEBUG=1); returns exit code 2."""
    if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes"):
        traceback.print_exception(error)
    print(f"vlmrl {command}: {error}", file=sys.stderr)
    return 2


def _dispatch(ns) -> int:
    if ns.command == "config":
        print(reference_markdown())
        return 0
    if ns.command == "export":
        from vlmrl.run.export import export_checkpoint

        export_checkpoint(ns.checkpoint, ns.out, overrides=ns.overrides)
        return 0
    if ns.command == "tiny":
        from vlmrl.tiny_models.tiny_families import run_tiny

        return run_tiny(ns)
    if ns.command == "demo":
        from vlmrl.demo import run_demo

        run_demo(ns.output_dir, quick=ns.quick)
        return 0
    return _run(ns.command, load_config(*_split(ns.args)))


def _run(command: str, cfg) -> int:
    from vlmrl.run.preflight import preflight
    from vlmrl.models.policy import hf_progress_bars

    # Errors raised here are the user's (config, data, model folder, rewards): main() prints them in one line, exit 2.
    data = preflight(cfg, command, log=lambda line: print(line, file=sys.stderr))  # before any weights load
    if command == "check":
        from vlmrl.run.verdict import finish_check
        from vlmrl.plan.planner import data_shape_of

        longest = data.prompts.longest_text if data is not None and data.prompts else None  # the planner's verdict for the longest prompt
        shape = data_shape_of(data.train, cfg.data.limit_images, cfg.data.max_frames, longest) if data is not None else {}
        return finish_check(cfg, log=lambda line: print(line, file=sys.stderr), data_shape=shape)  # output_dir, planner verdict
    with hf_progress_bars(cfg.logging.progress_bar):  # also the loads inside the run (checkpoint weights on resume)
        if command == "train":
            from vlmrl.train import train

            metrics = train(cfg)
        elif command == "sft":
            from vlmrl.sft import sft

            metrics = sft(cfg)
        else:
            metrics = run_eval(cfg)
    from vlmrl.engine.device import env_world

    if env_world()[1] == 0:  # the evaluation's results, from the main process only
        evaluated = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if evaluated:
            print(json.dumps(evaluated, indent=1))
        else:  # not an empty `{}`: say there was no evaluation, and where the run's metrics are
            print(
                f"vlmrl {command}: no evaluation ran (data.eval_path is empty); the run's metrics are in {cfg.training.output_dir}/metrics.jsonl",
                file=sys.stderr,
            )
    return 0


def run_eval(cfg) -> dict:
    from vlmrl.evaluate import evaluate
    from vlmrl.run.datasets import load_datasets
    from vlmrl.models.policy import load_policy
    from vlmrl.rewards.scoring import load_reward_funcs
    from vlmrl.models.judge import local_judge_on
    from vlmrl.engine.device import resolve_device, seed_everything

    device = resolve_device(cfg.training.device)
    seed_everything(cfg.training.seed)
    model, processor = load_policy(cfg, device)
    data = load_datasets(cfg, need_train=False, processor=processor)
    if not data.eval:
        raise ConfigError("data.eval_path is empty and no built-in task test split is configured; set data.eval_path")
    funcs, _ = load_reward_funcs(cfg, local_judge_on(device))
    from vlmrl.run.preflight import eval_data_name

    print(f"vlmrl eval: {cfg.model.name_or_path} on {eval_data_name(cfg)}, {len(data.eval)} rows; {describe(cfg)}", file=sys.stderr)
    from vlmrl.rollout.backends import eval_backend

    backend = eval_backend(cfg, model, processor, lambda line: print(line, file=sys.stderr))  # rollout.backend=vllm: vLLM decodes
    metrics = evaluate(model, processor, data.eval, cfg, funcs, device, backend=backend)
    out = Path(cfg.training.output_dir)
    from vlmrl.checkpoints.run_manifest import is_owned, record

    if (out / "eval.json").exists() and not is_owned(out / "eval.json"):
        raise ConfigError(f"{out / 'eval.json'} was not written by vlmrl; move it, or pick another training.output_dir")
    record(out, ["eval.json"])
    (out / "eval.json").write_text(json.dumps(metrics, indent=1))
    return metrics


if __name__ == "__main__":
    sys.exit(main())
