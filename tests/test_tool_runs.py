"""Tool-using GRPO runs from outside (issue 35, findings 10 and 12): hostile tool images, the built-in crop on a thin
box, the whole dataset row in the tool's context, an environment class chosen in the config, the cap on calls per
turn and the image budget. Each run is `vlmrl train`'s own loop on the tiny Qwen2.5-VL; the random model never writes
a tool call, so each row's first turn is scripted (the engine's `force` hook, as in test_multiturn.py) and the rest
is sampled.
"""

import json

import pytest
from PIL import Image

from vlmrl.tools.environment import ToolEnvironment
from vlmrl.tools.registry import load_tools, make_tool

pytestmark = pytest.mark.integration

HOSTILE = '''
from PIL import Image

CALLS = []


def hostile(kind: str, *, context=None):
    """Return an image no processor can take.

    Args:
        kind: Which image (strip, empty, huge, row).
    """
    CALLS.append(kind)
    if kind == "row":
        return "row keys: " + ",".join(sorted(context.row))
    size = {"strip": (10000, 10), "empty": (0, 0), "huge": (6000, 6000)}[kind]
    return [Image.new("RGB", size, "white"), f"made {kind}"]


def count(*, context=None) -> str:
    """Count a call.
    """
    CALLS.append("count")
    return str(len(CALLS))
'''

ENVIRONMENT = '''
from vlmrl.tools.environment import ToolEnvironment

MADE = []


class Marked(ToolEnvironment):
    """A ToolEnvironment subclass, as a user writes one: every result it returns is marked."""

    def __init__(self, tools, **kwargs):
        super().__init__(tools, **kwargs)
        MADE.append(self)

    def _call(self, call):
        result = super()._call(call)
        result.text = "[marked] " + result.text
        return result
'''


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tool_run(tmp_path, monkeypatch, tiny, turns: list[str], overrides: list[str]):
    """One GRPO step over 2 prompts x G=2 (4 rows); row i's first turn is turns[i] (scripted), the rest sampled.
    Returns the rollouts the engine produced and the step's metrics."""
    import vlmrl.run.tool_rollout as tool_rollout
    from vlmrl.config import load_config
    from vlmrl.data.tasks import make_count_task
    from vlmrl.engine import host_alloc
    from vlmrl.models.multiturn import turn_end
    from vlmrl.models.processing import tokenizer_of, load_processor
    from vlmrl.train import train

    processor = load_processor(tiny)
    end_id, _ = turn_end(processor, [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")])
    scripts = [tokenizer_of(processor)(t, add_special_tokens=False).input_ids + [end_id] for t in turns]
    real, seen = tool_rollout.sample_multiturn, []

    def scripted(*args, **kwargs):
        out = real(*args, **kwargs, force=lambda row, turn, j: scripts[row][j] if turn == 0 and j < len(scripts[row]) else None)
        seen.append(out)
        return out

    monkeypatch.setattr(tool_rollout, "sample_multiturn", scripted)
    monkeypatch.setattr(host_alloc, "pin_mmap_threshold", lambda: True)  # not done to the shared pytest process
    for k in [*host_alloc._USER_SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    data = make_count_task(tmp_path / "count", n_train=4, n_test=0, seed=0, image_size=448)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny}",
            f"data.train_path={data['train']}",
            "data.eval_path=",
            f"training.output_dir={out}",
            "training.max_steps=1",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.max_completion_length=8",
            "rollout.engine=continuous",
            f"tools.max_turn_tokens={max(len(s) for s in scripts) + 4}",
            f"tools.max_total_tokens={max(len(s) for s in scripts) + 100}",  # the sampled turns after the tool turn stay short
            "algorithm.mask_truncated_completions=false",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "training.save_final_model=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            *overrides,
        ],
    )
    train(cfg, log=lambda *a: None)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()] if (out / "samples.jsonl").exists() else []
    return seen[0], metrics[0], samples


def tool_results(trajectory) -> list[dict]:
    return [m for m in trajectory.completion if m["role"] == "tool"]


def text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if p.get("type") == "text")


def test_hostile_tool_images_and_a_thin_crop_do_not_end_the_run(tiny_qwen25vl, tmp_path, monkeypatch):
    """Finding 10: a 10000x10 strip, a 0x0 image and the built-in crop on a thin normalized box each become the
    tool's error result, a 6000x6000 image is scaled down under tools.max_image_pixels; the run finishes its step."""
    turns = [
        call("hostile", kind="strip"),
        call("hostile", kind="empty"),
        call("crop", bbox_2d=[0, 0, 1, 0.001], coordinates="normalized"),
        call("hostile", kind="huge"),
    ]
    out, metrics, _ = tool_run(tmp_path, monkeypatch, tiny_qwen25vl, turns, ["tools.tools=[crop,hostile.py:hostile]"])
    results = [tool_results(t)[0] for t in out.trajectories]
    for message in results[:3]:
        assert text_of(message).startswith(f"tool {message['name']!r} failed:"), message
    assert "10000x10" in text_of(results[0]) and "0x0" in text_of(results[1]) and "448x1" in text_of(results[2])
    huge = [p["image"] for p in results[3]["content"] if p.get("type") == "image"]
    assert len(huge) == 1 and huge[0].size == (56, 56), "shown to the model at the run's pixel bounds"
    assert "resized from 6000x6000" in text_of(results[3])
    assert metrics["tools/call_success_rate"] == 0.25 and metrics["tools/calls_mean"] == 1.0


def test_whole_row_configured_environment_and_calls_per_turn_in_a_run(tiny_qwen25vl, tmp_path, monkeypatch):
    """Finding 12: context.row is the dataset row (its solution and response columns too); tools.environment picks
    the environment class (a ToolEnvironment subclass in a file) that runs every rollout; a turn of 3 calls runs
    tools.max_calls_per_turn of them and the model is told the rest did not run."""
    turns = [call("hostile", kind="row")] * 2 + [call("count") * 3] * 2
    overrides = ["tools.tools=[hostile.py:hostile,hostile.py:count]", "tools.environment=env.py:Marked", "tools.max_calls_per_turn=2"]
    out, _, _ = tool_run(tmp_path, monkeypatch, tiny_qwen25vl, turns, overrides)
    for t in out.trajectories[:2]:
        text = text_of(tool_results(t)[0])
        assert text.startswith("[marked] row keys: ") and {"problem", "images", "solution", "response"} <= set(text.split(": ")[1].split(",")), text
    for t in out.trajectories[2:]:
        results = tool_results(t)
        assert len(results) == 3 and "3 tool calls in one turn: only the first 2 were run (tools.max_calls_per_turn)" in text_of(results[0]), results
        assert all(text_of(m).startswith("[marked] ") and text_of(m)[9:].isdigit() for m in results[1:]), results


def test_samples_hold_the_rollout_tokens_and_mean_length_counts_the_model_tokens(tiny_qwen25vl, tmp_path, monkeypatch):
    """Finding 13: samples.jsonl holds each tool rollout's prompt ids, token ids, loss mask and sampled log-probs,
    enough to check it from outside: the tokens decode to the logged completion, the masked tokens are the model's
    turns (the tool turn is off the mask), the log-probs are the sampler's (< 0 on the mask, 0 off it), and
    completions/mean_length is the mean of the masked tokens (TRL counts the model's tokens), mean_total_length all."""
    from vlmrl.models.processing import load_processor

    turns = [call("zoom", bbox_2d=[0, 0, 28, 28])] * 4
    out, metrics, samples = tool_run(tmp_path, monkeypatch, tiny_qwen25vl, turns, ["tools.tools=[zoom]", "logging.log_completions=4"])
    tok = load_processor(tiny_qwen25vl).tokenizer
    assert len(samples) == 4
    for s, t in zip(samples, out.trajectories):
        ids, mask, logps = s["token_ids"], s["loss_mask"], s["sampling_logps"]
        assert len(ids) == len(mask) == len(logps) and 0 < sum(mask) < len(ids)
        assert tok.decode(ids, skip_special_tokens=True) == s["completion"]
        model = tok.decode([i for i, m in zip(ids, mask) if m])
        # the model's turns, each with the turn end it sampled (the last one's only when it ended the turn itself)
        assert model.startswith(t.turn_texts[0] + "<|im_end|>") and model.replace("<|im_end|>", "") == "".join(t.turn_texts), model
        assert "tool_response" in tok.decode([i for i, m in zip(ids, mask) if not m])
        assert all(lp < 0 for lp, m in zip(logps, mask) if m) and all(lp == 0 for lp, m in zip(logps, mask) if not m)
        assert tok.decode(s["prompt_ids"]).startswith("<|im_start|>") and s["end_reason"] == t.end_reason
    assert metrics["completions/mean_length"] == pytest.approx(sum(sum(s["loss_mask"]) for s in samples) / 4)
    assert metrics["completions/mean_total_length"] == pytest.approx(sum(len(s["token_ids"]) for s in samples) / 4)
    assert metrics["completions/mean_length"] < metrics["completions/mean_total_length"]


def test_sft_on_tool_traces_warns_of_a_planner_miss_once(tiny_qwen25vl, tmp_path, monkeypatch):
    """Finding 13: `vlmrl sft` on tool-use traces (rows of tools.traces.sft_rows) said "planner predicted ... measured"
    at every step; the same miss is now said once. Any miss is made to count (the warning threshold set below every
    error), so the test does not depend on how far off the planner is on this machine."""
    from test_zoom_task import zoom_conversation

    import vlmrl.plan.runlog as runlog
    from vlmrl.config import load_config
    from vlmrl.sft import sft
    from vlmrl.tools.traces import image_saver, sft_rows

    monkeypatch.setattr(runlog, "PREDICTION_WARN_FRACTION", -1.0)
    save = image_saver(tmp_path / "images", "z")
    rows = [r for _ in range(2) for r in sft_rows(zoom_conversation(tmp_path), save, solution="top-left")]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list = []
    overrides = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={tmp_path / 'traces.jsonl'}",
        "data.eval_path=",
        f"training.output_dir={tmp_path / 'out'}",
        "sft.projector_steps=0",
        "sft.steps=3",
        "sft.batch_size=2",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "training.save_final_model=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
    ]
    sft(load_config(None, overrides), log=lambda line, *_: lines.append(str(line)))
    assert len(lines) > 3 and sum("planner predicted" in line for line in lines) == 1, lines


# ---------------------------------------------------------------- the environment alone (no model)


def _counting_tool(calls: list):
    def counted(*, context=None):
        """Return an image and count the call."""
        calls.append(1)
        return Image.new("RGB", (8, 8))

    return make_tool(counted, name="counted")


def test_calls_past_the_image_budget_are_not_run():
    """Finding 12: once a call spends the image budget, the turn's later calls are not executed."""
    calls: list = []
    env = ToolEnvironment({"counted": _counting_tool(calls)}, max_images=2)
    env.reset({"problem": "q", "images": [Image.new("RGB", (8, 8))]})
    observation, _, done = env.step(call("counted") * 4)
    assert done and env.trajectory().end_reason == "image_budget"
    assert len(calls) == 2, "the call that spent the budget ran; the two after it must not"
    assert [text_of(m).startswith("tool 'counted' failed:") for m in observation] == [False, True, True, True]


def test_thin_crop_is_an_error_result_without_a_processor():
    """Finding 10, the environment alone: crop's 400x1 result is refused by the side-ratio check (no processor)."""
    env = ToolEnvironment(load_tools(["crop"]))
    env.reset({"problem": "q", "images": [Image.new("RGB", (400, 300))]})
    observation, _, _ = env.step(call("crop", bbox_2d=[0, 0, 1, 0.001], coordinates="normalized"))
    assert "400x1" in text_of(observation[0]) and "200:1" in text_of(observation[0])


TRL_ENVIRONMENT = '''
class Counter:
    """A TRL environment_factory class: public methods are its tools, get_reward scores the rollout."""

    def reset(self, **row):
        self.total = 0
        return "Count up to " + row["solution"] + "."

    def add(self, n: int) -> str:
        """Add to the running total.

        Args:
            n: How much to add.
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)
'''


def test_a_trl_environment_class_from_the_config_spec(tmp_path, monkeypatch):
    """Finding 12: tools.environment names a TRL environment_factory class in a file: each rollout gets its own
    instance, its methods are the tools the model is told of, reset(**row) sees the whole row and get_reward scores."""
    from vlmrl.tools.environment import environment_factory
    from vlmrl.tools.registry import ToolError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "trl_env.py").write_text(TRL_ENVIRONMENT)
    make, tools = environment_factory("trl_env.py:Counter", {})
    assert list(tools) == ["add"] and tools["add"].schema["function"]["parameters"]["properties"]["n"]["type"] == "integer"
    a, b = make(max_turns=3), make(max_turns=3)
    prompt = a.reset({"problem": "count", "solution": "5"})
    b.reset({"problem": "count", "solution": "5"})
    assert prompt[-1]["content"][-1]["text"] == "Count up to 5."
    a.step(call("add", n=2) + call("add", n=3))
    _, reward, done = a.step("done")
    assert done and reward == 5.0 and a.trajectory().reward == 5.0
    assert b.step("done")[1] == 0.0, "each rollout has its own instance"
    with pytest.raises(ToolError, match="leave tools.tools empty"):
        environment_factory("trl_env.py:Counter", load_tools(["crop"]))
