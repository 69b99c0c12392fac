"""The zoom task (issue 28 part 5): the generator, expert tool-use traces as SFT rows (tool turns masked, model turns
trained, the same text the multi-turn loop renders), and the plain multi-turn loop."""

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlmrl.data.tasks import CORNERS, make_zoom_task, zoom_spots
from vlmrl.tools.context import ToolContext
from vlmrl.tools.environment import ToolEnvironment
from vlmrl.tools.execute import ToolCall, ToolResult, run_tool
from vlmrl.tools.registry import load_tools
from vlmrl.tools.traces import expert_conversation, sft_rows, template_messages, tool_call_text

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def rows_of(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_zoom_spots_are_two_seen_pixels_at_quadrant_centres():
    spots = zoom_spots(448, 56, 4)
    assert [s[0] for s in spots] == [[13, 13, 15, 15], [41, 13, 43, 15], [13, 41, 15, 43], [41, 41, 43, 43]]
    assert spots[1][1] == (41 * 8, 13 * 8)
    with pytest.raises(ValueError, match="square number"):
        zoom_spots(448, 56, 3)
    with pytest.raises(ValueError, match="multiple"):
        zoom_spots(450, 56, 4)
    with pytest.raises(ValueError, match="jitter must be between 0 and 4"):
        make_zoom_task("/nonexistent", n_train=1, n_test=0, jitter=5)


def test_zoom_task_is_deterministic_balanced_and_needs_the_zoom(tmp_path):
    files = make_zoom_task(tmp_path / "a", n_train=8, n_test=8)
    again = make_zoom_task(tmp_path / "b", n_train=8, n_test=8)
    assert files["test"].read_bytes() == again["test"].read_bytes()
    rows = rows_of(files["train"])
    assert sorted(r["solution"] for r in rows) == sorted(list(CORNERS) * 2)
    inks = set()
    for r in rows:
        im = Image.open(tmp_path / "a" / r["image"]).convert("L")
        inks.add(im.histogram()[255])
        assert im.histogram()[255] + im.histogram()[0] == 448 * 448  # black and white only
        x1, y1, x2, y2 = (8 * v for v in r["zoom_box"])
        # The detail lies inside the box the expert zooms into (seen pixels x 8 = original pixels) ...
        left, top, right, bottom = im.getbbox()
        assert x1 <= left and y1 <= top and right <= x2 and bottom <= y2
        # ... and the missing corner is the one the solution names: the white square's corner block is black.
        right, bottom = right - 1, bottom - 1
        corner = {"top-left": (left, top), "top-right": (right, top), "bottom-left": (left, bottom), "bottom-right": (right, bottom)}
        assert [name for name, xy in corner.items() if im.getpixel(xy) == 0] == [r["solution"]]
    # The same ink for every answer: a blur of the detail cannot tell the answers apart by brightness.
    assert len(inks) == 1
    # At the model's pixel budget (56x56) the detail is about one pixel: the corner is not there to read.
    small = Image.open(tmp_path / "a" / rows[0]["image"]).convert("L").resize((56, 56), Image.Resampling.BICUBIC)
    assert sum(1 for v in small.get_flattened_data() if v > 64) <= 4


def test_zoom_task_corner_aligned_square_fills_the_zoomed_boxs_top_left_quarter(tmp_path):
    files = make_zoom_task(tmp_path / "a", n_train=4, n_test=0, spots=1, jitter=0, corner_aligned=True)
    for r in rows_of(files["train"]):
        assert r["zoom_box"] == [27, 27, 29, 29]
        im = Image.open(tmp_path / "a" / r["image"]).convert("L")
        # the square is exactly the box's top-left seen pixel (8x8 original pixels): one image token once zoomed
        assert im.getbbox() == (27 * 8, 27 * 8, 28 * 8, 28 * 8)
    with pytest.raises(ValueError, match="corner_aligned needs jitter 0"):
        make_zoom_task(tmp_path / "b", n_train=1, n_test=0, jitter=1, corner_aligned=True)


def zoom_conversation(tmp_path):
    image = Image.new("RGB", (448, 448))
    call = ToolCall("zoom", {"bbox_2d": [13, 13, 15, 15], "factor": 4})
    result = run_tool(load_tools(["zoom"]), call, ToolContext(images=[image], seen_sizes=[(56, 56)]))
    assert result.ok and result.images[0].size == (64, 64)
    path = str(tmp_path / "orig.png")
    image.save(path)
    prompt = [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "Which corner?"}]}]
    return expert_conversation(prompt, [call], [result], "<answer>top-left</answer>")


def test_sft_rows_cut_after_each_image_bearing_tool_turn(tmp_path):
    conversation = zoom_conversation(tmp_path)
    saved = []
    rows = sft_rows(conversation, lambda im: saved.append(im) or f"z{len(saved)}.png", solution="top-left")
    assert len(rows) == 2 and len(saved) == 1
    call = tool_call_text("zoom", {"bbox_2d": [13, 13, 15, 15], "factor": 4})
    assert rows[0]["messages"] == [{"role": "user", "content": "<image>Which corner?"}, {"role": "assistant", "content": call}]
    assert rows[0]["images"] == [str(tmp_path / "orig.png")]
    assert rows[1]["messages"][2] == {"role": "user", "content": "<tool_response>\n<image>zoomed 16x16 region x4: 64x64\n</tool_response>"}
    assert rows[1]["messages"][3]["content"] == "<answer>top-left</answer>" and rows[1]["images"][1] == "z1.png"
    assert all(r["solution"] == "top-left" for r in rows)
    # A text-only tool turn adds no cut: the answer after it is trained with the call, in one row.
    text_only = conversation[:2] + [{"role": "tool", "name": "zoom", "content": "no"}] + conversation[3:]
    assert len(sft_rows(text_only, lambda im: "x.png")) == 1
    with pytest.raises(ValueError, match="end with an assistant"):
        sft_rows(conversation[:-1], lambda im: "x.png")


def test_sft_rows_train_the_model_turns_only_and_match_the_loop_rendering(tmp_path, tiny_qwen25vl):
    from vlmrl.data.formats import normalize_rows
    from vlmrl.models.conversations import sft_view
    from vlmrl.models.processing import load_processor, render_chat
    from vlmrl.models.tool_loop import conversation_text

    processor = load_processor(tiny_qwen25vl, min_pixels=3136, max_pixels=3136)
    conversation = zoom_conversation(tmp_path)
    rows = sft_rows(conversation, lambda im: "z.png", solution="top-left")
    loaded, _ = normalize_rows([{**r, "_source": f"row {i}"} for i, r in enumerate(rows)], "t", "messages")
    views = [sft_view(processor, r, num_images=len(r["images"])) for r in loaded]
    trained = [[text for text, on in v["_sft_pieces"] if on] for v in views]
    assert trained == [
        [tool_call_text("zoom", {"bbox_2d": [13, 13, 15, 15], "factor": 4}) + "<|im_end|>\n"],
        ["<answer>top-left</answer><|im_end|>\n"],
    ]
    # Nothing of the tool turn is trained: its text sits in the second row's prompt.
    assert all("tool_response" not in text for pieces in trained for text in pieces)
    # The second row's prompt is the text the multi-turn loop renders before the last turn (same tokens at eval).
    prompt_text = render_chat(processor, views[1]["_messages"], add_generation_prompt=True)
    assert prompt_text == conversation_text(processor, conversation[:3])
    assert template_messages(conversation[:3], "user")[2]["role"] == "user"


def test_tool_loop_runs_calls_until_each_row_answers(monkeypatch):
    from vlmrl.models import tool_loop

    seen = []

    def scripted(model, processor, conversations, settings, tools=None):
        seen.append([len(c) for c in conversations])
        assert [t["function"]["name"] for t in tools] == ["zoom"]  # the loop's prompts describe the tools (issue 35, 11)
        return [
            tool_call_text("zoom", {"bbox_2d": [0, 0, 2, 2]}) if len(c) == 1 and i == 0 else "<answer>x</answer>" for i, c in enumerate(conversations)
        ]

    monkeypatch.setattr(tool_loop, "_turn", scripted)
    rows = [{"prompt": "q", "image": Image.new("RGB", (8, 8))} for _ in range(2)]
    envs = [ToolEnvironment(load_tools(["zoom"])) for _ in rows]
    out = tool_loop.run_tool_loop(None, None, envs, rows)
    # Turn 1 for both rows; turn 2 only for the row that called, with the tool's image in its conversation.
    assert seen == [[1, 1], [3]]
    assert [t.num_turns for t in out] == [2, 1] and [len(t.tool_calls) for t in out] == [1, 0]
    assert len(out[0].images) == 2 and out[0].end_reason == "answered"
    with pytest.raises(ValueError, match="2 environments for 1 rows"):
        tool_loop.run_tool_loop(None, None, envs, rows[:1])


def test_zoom_benchmark_expert_rows_zoom_onto_the_detail(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoom_task

    files = make_zoom_task(tmp_path / "d", n_train=4, n_test=0)
    rows = rows_of(files["train"])
    out = zoom_task.tool_rows(rows, tmp_path / "d", tmp_path / "t")
    assert len(out) == 8
    for i in range(len(rows)):
        zoomed = Image.open(out[2 * i + 1]["images"][1]).convert("L")
        assert zoomed.size == (64, 64)
        # The zoomed box shows the whole detail: 3 of its 4 blocks of ink, far more than one pixel's worth.
        assert sum(1 for v in zoomed.get_flattened_data() if v > 128) > 300
    # call_every=2: every row's answer, the calls of rows 0 and 2 only
    fewer = zoom_task.tool_rows(rows, tmp_path / "d", tmp_path / "t2", call_every=2)
    assert [len(r["images"]) for r in fewer] == [1, 2, 2, 1, 2, 2]


def test_template_messages_groups_tool_runs():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    tools = [{"role": "tool", "name": "t", "content": "1"}, {"role": "tool", "name": "t", "content": "2"}]
    out = template_messages(msgs + tools + [{"role": "assistant", "content": "b"}], "user")
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]
    assert template_messages(msgs + tools, "tool") == msgs + tools
    assert isinstance(ToolResult("x", "y").text, str)


def test_zoom_benchmark_results_render_from_the_json(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoom_task

    ev = {
        "rows": 4, "accuracy": 0.75, "turns_per_rollout": 2.0, "tool_calls_per_rollout": 1.0, "rollouts_with_a_call": 1.0,
        "tool_success_rate": 1.0, "right_box_rate": 0.5, "end_reasons": {"answered": 4}, "eval_seconds": 1.0, "example_turns": ["a", "b"],
    }  # fmt: skip
    result = {
        "command": "x", "task": {"n_train": 8, "n_test": 4}, "sft_steps": 2, "sft_seconds": {"tool": 1.0, "no_tool": 1.0},
        "tool": ev, "no_tool": {**ev, "accuracy": 0.25, "tool_success_rate": None}, "total_seconds": 3.0,
        "machine": {"date": "2026-11-27", "cpus": 2, "load_1_5_15": [1.0, 1.0, 1.0], "torch": "t", "transformers": "t"},
    }  # fmt: skip
    md = zoom_task.markdown(result)
    assert "| accuracy | 75.0% | 25.0% |" in md and "GRPO with the tool: not run." in md
    assert "tool SFT + GRPO" not in md  # no GRPO column without a GRPO evaluation
    assert zoom_task.figure(result, tmp_path / "f.png").stat().st_size > 0
