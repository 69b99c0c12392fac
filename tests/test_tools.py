"""Tools (issue 28, parts 1 and 6): schemas, loading, the built-in image tools, execution with a timeout,
tool-call parsing, tool-turn rendering, the environment protocol and trajectories."""

import threading
import time

import pytest
from PIL import Image, ImageDraw

from vlmrl.tools import execute
from vlmrl.tools.environment import ToolEnvironment, TRLEnvironment, run_episode
from vlmrl.tools.execute import ToolCall, ToolResult, normalise_output, run_tool
from vlmrl.tools.image_tools import box_pixels, crop, rotate, zoom
from vlmrl.tools.parsing import parse_tool_calls
from vlmrl.tools.registry import ToolContext, ToolError, load_tool, load_tools, make_tool, tool_schema
from vlmrl.tools.render import for_template, parse_error_message, render_tool_turn, tool_message, tool_role_mode
from vlmrl.tools.trajectory import Trajectory, build_trajectory

pytestmark = pytest.mark.unit


def board(w=40, h=30):
    """A black image with one white pixel block at x 10..13, y 5..7 (inclusive) and a red pixel at (39, 29)."""
    im = Image.new("RGB", (w, h), "black")
    d = ImageDraw.Draw(im)
    d.rectangle([10, 5, 13, 7], fill="white")
    im.putpixel((w - 1, h - 1), (255, 0, 0))
    return im


def ctx(*images):
    return ToolContext(images=list(images))


# ------------------------------------------------------------------ schema and loading


def measure(length: float, unit: str = "cm") -> str:
    """Measure something.

    Args:
        length: How long it is.
        unit: The unit (choices: ["cm", "in"])
    """
    return f"{length} {unit}"


def test_schema_comes_from_signature_hints_and_docstring():
    assert tool_schema(measure) == {
        "type": "function",
        "function": {
            "name": "measure",
            "description": "Measure something.",
            "parameters": {
                "type": "object",
                "properties": {
                    "length": {"type": "number", "description": "How long it is."},
                    "unit": {"type": "string", "enum": ["cm", "in"], "description": "The unit"},
                },
                "required": ["length"],
            },
            "return": {"type": "string"},
        },
    }


def test_context_parameter_is_hidden_from_the_schema():
    props = tool_schema(crop)["function"]["parameters"]["properties"]
    assert set(props) == {"bbox_2d", "image_index", "coordinates"}
    assert props["coordinates"]["enum"] == ["pixel", "normalized", "normalized_1000"]


def test_tool_without_hints_or_docs_fails_at_load_naming_it():
    def nohint(x):
        """Doc.

        Args:
            x: a thing.
        """

    def nodoc(x: int):
        return x

    for fn in (nohint, nodoc):
        with pytest.raises(ToolError, match=rf"tool '{fn.__name__}'.*type hint.*Args:"):
            make_tool(fn)


def test_load_tool_from_file_module_and_builtin(tmp_path, monkeypatch):
    f = tmp_path / "mytools.py"
    f.write_text('def shout(text: str) -> str:\n    """Shout.\n\n    Args:\n        text: What to shout.\n    """\n    return text.upper()\n')
    tools = load_tools([f"{f}:shout", "zoom", "vlmrl.tools.image_tools:rotate"])
    assert list(tools) == ["shout", "zoom", "rotate"]
    assert run_tool(tools, ToolCall("shout", {"text": "hi"})).text == "HI"
    with pytest.raises(ToolError, match="did you mean 'zoom'"):
        load_tool("zom")
    with pytest.raises(ToolError, match=r"has no 'shot'; did you mean .*:shout"):
        load_tool(f"{f}:shot")
    with pytest.raises(ToolError, match="file not found"):
        load_tool(f"{tmp_path}/nope.py:shout")
    with pytest.raises(ToolError, match="already loaded"):
        load_tools(["crop", "crop"])


# ------------------------------------------------------------------ image tools


def test_box_pixels_clamps_orders_and_rounds_outwards():
    assert box_pixels([10, 5, 14, 8], 40, 30) == (10, 5, 14, 8)
    assert box_pixels([14, 8, 10, 5], 40, 30) == (10, 5, 14, 8)  # corners in any order
    assert box_pixels([-5, -5, 100, 100], 40, 30) == (0, 0, 40, 30)  # clamped to the image
    assert box_pixels([10.2, 5.7, 13.1, 7.5], 40, 30) == (10, 5, 14, 8)  # outwards
    assert box_pixels([0.25, 0.5, 0.5, 1.0], 40, 30, "normalized") == (10, 15, 20, 30)
    assert box_pixels([250, 500, 500, 1000], 40, 30, "normalized_1000") == (10, 15, 20, 30)


@pytest.mark.parametrize(
    "box, match",
    [
        ([50, 0, 60, 10], "empty inside the 40x30 image"),  # wholly right of the image
        ([-10, -10, 0, 0], "empty"),  # touches only the corner: zero area after clamping
        ([5, 5, 5, 20], "empty"),  # zero width
        ([1, 2, 3], "four numbers"),
        ([1, 2, 3, float("nan")], "finite"),
        ([1, 2, 3, True], "finite"),
    ],
)
def test_box_pixels_refuses_empty_and_malformed_boxes(box, match):
    with pytest.raises(ValueError, match=match):
        box_pixels(box, 40, 30)


def test_pixel_boxes_are_scaled_from_the_size_the_model_saw():
    assert box_pixels([10, 5, 14, 8], 400, 300, seen=(40, 30)) == (100, 50, 140, 80)
    assert box_pixels([0.25, 0.5, 0.5, 1.0], 400, 300, "normalized", seen=(40, 30)) == (100, 150, 200, 300)  # only pixel boxes
    big = board().resize((400, 300), Image.Resampling.NEAREST)
    out, _ = crop([10, 5, 14, 8], context=ToolContext(images=[big], seen_sizes=[(40, 30)]))
    assert out.size == (40, 30) and set(out.get_flattened_data()) == {(255, 255, 255)}


def test_crop_is_pixel_exact():
    im = board()
    out, text = crop([10, 5, 14, 8], context=ctx(im))
    assert out.size == (4, 3)
    assert set(out.get_flattened_data()) == {(255, 255, 255)}  # exactly the white block
    assert "[10, 5, 14, 8]" in text
    out, _ = crop([9, 4, 15, 9], context=ctx(im))  # one pixel of border on each side
    assert out.size == (6, 5) and out.getpixel((0, 0)) == (0, 0, 0) and out.getpixel((1, 1)) == (255, 255, 255)
    out, _ = crop([30, 20, 99, 99], context=ctx(im))  # clamped: the red corner pixel is the crop's corner
    assert out.size == (10, 10) and out.getpixel((9, 9)) == (255, 0, 0)


def test_zoom_enlarges_and_picks_the_image():
    small, big = board(), Image.new("RGB", (100, 100), "blue")
    out, _ = zoom([10, 5, 14, 8], factor=3, context=ctx(small, big))
    assert out.size == (12, 9) and out.getpixel((6, 4)) == (255, 255, 255)
    out, _ = zoom([0, 0, 10, 10], factor=2, image_index=-1, context=ctx(small, big))
    assert out.size == (20, 20) and out.getpixel((5, 5)) == (0, 0, 255)
    with pytest.raises(ValueError, match="image_index 2 is out of range: the conversation has 2"):
        zoom([0, 0, 10, 10], image_index=2, context=ctx(small, big))
    with pytest.raises(ValueError, match="factor must be"):
        zoom([0, 0, 10, 10], factor=0.5, context=ctx(small))
    with pytest.raises(ValueError, match="no image"):
        zoom([0, 0, 10, 10], context=ctx())


def test_rotate_quarter_turn_moves_the_corner_pixel():
    out, _ = rotate(90, context=ctx(board()))
    assert out.size == (30, 40)
    assert out.getpixel((29, 0)) == (255, 0, 0)  # counter-clockwise: bottom-right goes to top-right


# ------------------------------------------------------------------ execution


def test_tool_exception_and_bad_arguments_become_error_results_naming_the_tool():
    tools = load_tools(["crop"])
    r = run_tool(tools, ToolCall("crop", {"bbox_2d": [50, 0, 60, 10]}), ctx(board()))
    assert not r.ok and r.error.startswith("tool 'crop' failed: ValueError: bbox_2d") and r.images == []
    assert "missing required argument(s) bbox_2d" in run_tool(tools, ToolCall("crop", {}), ctx(board())).error
    assert "unknown argument(s) size" in run_tool(tools, ToolCall("crop", {"bbox_2d": [0, 0, 1, 1], "size": 3}), ctx(board())).error
    assert "not an argument the model can pass" in run_tool(tools, ToolCall("crop", {"bbox_2d": [0, 0, 1, 1], "context": 1})).error
    assert "no such tool; available: crop" in run_tool(tools, ToolCall("shell", {"cmd": "rm"})).error
    assert "must be a JSON object" in run_tool(tools, ToolCall("crop", [1, 2])).error


def test_normalise_output_accepts_text_images_and_trl_parts():
    im = board()
    assert normalise_output("t", "hi") == ToolResult("t", "hi", [])
    assert normalise_output("t", (im, "a")) == ToolResult("t", "a", [im])
    assert normalise_output("t", [{"type": "image", "image": im}, {"type": "text", "text": "b"}]) == ToolResult("t", "b", [im])
    assert "returned a int" in normalise_output("t", 3).error


def test_a_hanging_tool_times_out_without_blocking(monkeypatch):
    release = threading.Event()

    def hang(seconds: float) -> str:
        """Wait.

        Args:
            seconds: Ignored.
        """
        release.wait(30)
        return "late"

    monkeypatch.setattr(execute, "_hung", {})
    tools = {"hang": make_tool(hang)}
    start = time.monotonic()
    r = run_tool(tools, ToolCall("hang", {"seconds": 1}), timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert r.error == "tool 'hang' failed: timed out after 0.2 s"
    for _ in range(execute.MAX_HUNG - 1):
        run_tool(tools, ToolCall("hang", {"seconds": 1}), timeout_s=0.05)
    # MAX_HUNG calls are stuck: the next one is refused at once instead of starting another thread.
    before = threading.active_count()
    assert "refused" in run_tool(tools, ToolCall("hang", {"seconds": 1}), timeout_s=0.05).error
    assert threading.active_count() == before
    release.set()
    for t in execute._hung["hang"]:
        t.join(5)
    assert run_tool(tools, ToolCall("hang", {"seconds": 1}), timeout_s=5).text == "late"  # usable again


def test_a_process_with_a_hung_tool_still_exits():
    """The worker is a daemon thread: the interpreter does not wait for a tool that never returns."""
    import subprocess
    import sys

    code = (
        "import time\n"
        "from vlmrl.tools.execute import ToolCall, run_tool\n"
        "from vlmrl.tools.registry import Tool\n"
        "def forever(): time.sleep(3600)\n"
        "r = run_tool({'forever': Tool('forever', forever, {})}, ToolCall('forever', {}), timeout_s=0.1)\n"
        "print(r.error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "tool 'forever' failed: timed out after 0.1 s", out.stderr


# ------------------------------------------------------------------ parsing


def test_parse_good_calls_and_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"bbox_2d": [1, 2, 3, 4]}}\n</tool_call>\n'
        '<tool_call>{"name": "rotate", "arguments": "{\\"angle\\": 90}"}</tool_call>'
    )
    p = parse_tool_calls(text)
    assert p.content == "Let me look."
    assert p.calls == [ToolCall("zoom", {"bbox_2d": [1, 2, 3, 4]}), ToolCall("rotate", {"angle": 90})]
    assert p.errors == []
    assert parse_tool_calls("<answer>3</answer>").calls == []


@pytest.mark.parametrize(
    "body, match",
    [
        ('{"name": "zoom", "arguments": {"bbox_2d": [1, 2}}', "not valid JSON"),
        ('["zoom"]', "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "zoom", "arguments": "not json"}', "string that is not JSON"),
        ('{"name": "zoom", "arguments": [1]}', "must be a JSON object, got list"),
    ],
)
def test_malformed_calls_are_parse_errors(body, match):
    p = parse_tool_calls(f"x <tool_call>{body}</tool_call> y")
    assert p.calls == [] and len(p.errors) == 1 and match in p.errors[0]
    assert p.content == "x  y"


def test_unclosed_call_is_an_error_and_good_calls_survive_beside_bad_ones():
    p = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call> <tool_call>{"name": "b"')
    assert p.calls == [ToolCall("a", {})]
    assert len(p.errors) == 2 and "no closing </tool_call>" in p.errors[1]


# ------------------------------------------------------------------ rendering


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from vlmrl.tiny_models.tiny import train_tokenizer

    return train_tokenizer()


def test_render_tool_turn_on_the_tiny_qwen_template(qwen_tokenizer):
    # Qwen2.5-VL's template prints any role as given: "<|im_start|>tool" is a header the model never saw, so the
    # results go in a user turn of <tool_response> blocks, images inside.
    assert tool_role_mode(qwen_tokenizer.chat_template) == "user"
    msgs = [tool_message(ToolResult("zoom", "zoomed", [board()])), tool_message(ToolResult("rotate", error="tool 'rotate' failed: x"))]
    assert render_tool_turn(qwen_tokenizer, msgs) == (
        "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>zoomed\n</tool_response>"
        "<tool_response>\ntool 'rotate' failed: x\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Asked for explicitly, the tool role is passed through as the template writes it.
    assert render_tool_turn(qwen_tokenizer, msgs[1:], mode="tool") == "<|im_start|>tool\ntool 'rotate' failed: x<|im_end|>\n<|im_start|>assistant\n"


class Templated:
    """A tokenizer with another chat template."""

    def __init__(self, tokenizer, template):
        self.tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, **kw)


# Our own minimal template with a tool branch of the Qwen text-model kind: consecutive tool results grouped
# into one user turn of <tool_response> blocks.
GROUPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"  # an expression: trim_blocks eats a newline after a tag
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_render_tool_turn_on_a_template_with_a_tool_branch(qwen_tokenizer):
    proc = Templated(qwen_tokenizer, GROUPING_TEMPLATE)
    assert tool_role_mode(GROUPING_TEMPLATE) == "tool"
    msgs = [tool_message(ToolResult("a", "1")), tool_message(ToolResult("b", "2"))]
    assert render_tool_turn(proc, msgs) == (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_without_a_tool_role_falls_back_to_a_user_turn():
    from vlmrl.tiny_models.tiny import LLAVA_CHAT_TEMPLATE

    assert tool_role_mode(LLAVA_CHAT_TEMPLATE) == "user"
    im = board()
    msgs = for_template([tool_message(ToolResult("zoom", "z", [im])), parse_error_message(["bad"])], "user")
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<tool_response>\n"},
                {"type": "image", "image": im},
                {"type": "text", "text": "z\n</tool_response>"},
                {"type": "text", "text": "<tool_response>\n"},
                {"type": "text", "text": "could not read a tool call: bad\n</tool_response>"},
            ],
        }
    ]


def test_render_refuses_a_template_that_rewrites_earlier_turns(qwen_tokenizer):
    from vlmrl.tools.render import ToolTemplateError

    class Rewrites:  # renders the last assistant turn differently once anything follows it
        chat_template = "{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}|{% endfor %}"

        def apply_chat_template(self, messages, **kw):
            return qwen_tokenizer.apply_chat_template(messages, **kw)

    with pytest.raises(ToolTemplateError, match="renders earlier turns differently"):
        render_tool_turn(Rewrites(), [tool_message(ToolResult("t", "x"))])


# ------------------------------------------------------------------ environment and trajectory


class CounterEnv:
    """A toy environment: the model must say a number; each guess is told higher/lower; reward 1 when right."""

    def reset(self, row):
        self.target, self.turns = row["target"], 0
        return [{"role": "user", "content": "guess"}]

    def step(self, action_text):
        self.turns += 1
        guess = int(action_text)
        if guess == self.target:
            return [], 1.0, True
        done = self.turns >= 3
        return [{"role": "user", "content": "higher" if guess < self.target else "lower"}], 0.0, done


def test_environment_protocol_with_a_toy_env():
    guesses = iter(["5", "8", "7"])
    messages, texts, reward = run_episode(CounterEnv(), {"target": 7}, lambda m: next(guesses))
    assert texts == ["5", "8", "7"] and reward == 1.0
    assert [m["content"] for m in messages] == ["guess", "5", "higher", "8", "lower", "7"]
    messages, texts, reward = run_episode(CounterEnv(), {"target": 9}, lambda m: "1")
    assert len(texts) == 3 and reward == 0.0


def test_tool_environment_zoom_rollout_and_trajectory():
    im = board()
    calls = iter(['<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [10, 5, 14, 8], "factor": 2}}</tool_call>', "<answer>white</answer>"])
    seen = []

    def policy(messages):
        seen.append(len(messages))
        return next(calls)

    def reward(t: Trajectory) -> float:
        return float(t.completion[-1]["content"] == "<answer>white</answer>" and len(t.tool_calls) == 1)

    env = ToolEnvironment(load_tools(["zoom", "crop"]), reward_fn=reward)
    messages, texts, r = run_episode(env, {"prompt": "What colour is the block?", "image": im}, policy)
    assert r == 1.0 and seen == [1, 3]
    t = env.trajectory()
    assert t.end_reason == "answered" and t.num_turns == 2 and t.reward == 1.0
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    zoom_call = {"type": "function", "function": {"name": "zoom", "arguments": {"bbox_2d": [10, 5, 14, 8], "factor": 2}}}
    assert t.completion[0] == {"role": "assistant", "content": "", "tool_calls": [zoom_call]}
    assert t.images[0] is im and t.images[1].size == (8, 6)
    assert t.tool_calls == [ToolCall("zoom", {"bbox_2d": [10, 5, 14, 8], "factor": 2})]
    # TRL's conversational reward inputs: the built-in accuracy reward reads the final answer.
    from vlmrl.rewards.args import completion_text
    from vlmrl.rewards.functions import accuracy

    assert completion_text(t.completion) == "<answer>white</answer>"
    assert accuracy(**t.reward_inputs(), solution=["white"]) == [1.0]


def test_tool_environment_limits_turns_images_and_row_tools():
    call = '<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [0, 0, 4, 4]}}</tool_call>'
    env = ToolEnvironment(load_tools(["zoom", "rotate"]), max_turns=2)
    env.reset({"prompt": "p", "image": board()})
    assert env.step(call)[2] is False
    obs, reward, done = env.step(call)
    assert done and reward == 0.0 and env.trajectory().end_reason == "max_turns"
    with pytest.raises(RuntimeError, match="after the rollout ended"):
        env.step(call)
    env = ToolEnvironment(load_tools(["zoom"]), max_images=2)
    env.reset({"prompt": "p", "image": board()})
    assert env.step(call)[2] is False  # 2 images now
    obs, _, done = env.step(call)
    assert done and "image budget (2) is spent" in obs[0]["content"] and env.trajectory().end_reason == "image_budget"
    env = ToolEnvironment(load_tools(["zoom", "rotate"]))
    env.reset({"prompt": "p", "image": board(), "tools": ["rotate"]})
    obs, _, done = env.step(call)
    assert not done and "no such tool; available: rotate" in obs[0]["content"]
    obs, _, done = env.step('<tool_call>{"name": </tool_call>')
    assert not done and obs[0]["name"] == "tool_call_parser" and "not valid JSON" in obs[0]["content"]
    with pytest.raises(ToolError, match="row field 'tools' names 'crop'"):
        env.reset({"prompt": "p", "tools": ["crop"]})


class TRLStyleCounter:
    """A TRL environment_factory-style class: reset(**row), public tool methods, get_reward()."""

    def reset(self, **row):
        self.count, self.target = 0, row["target"]
        return f"Reach {self.target}."

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.count += n
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count == self.target)


def test_trl_style_environment_runs_through_the_protocol():
    env = TRLEnvironment(TRLStyleCounter())
    assert list(env.tools) == ["add"] and env.tools["add"].schema["function"]["parameters"]["required"] == ["n"]
    prompt = env.reset({"prompt": "Count.", "target": 5})
    assert prompt == [{"role": "user", "content": [{"type": "text", "text": "Count."}, {"type": "text", "text": "Reach 5."}]}]
    assert env.step('<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>') == (
        [{"role": "tool", "name": "add", "content": "2"}],
        0.0,
        False,
    )
    env.step('<tool_call>{"name": "add", "arguments": {"n": 3}}</tool_call>')
    assert env.step("done") == ([], 1.0, True)


def test_async_tools_are_awaited():
    async def later(x: int) -> str:
        """Later.

        Args:
            x: A number.
        """
        return str(x * 2)

    assert run_tool({"later": make_tool(later)}, ToolCall("later", {"x": 4})).text == "8"


def test_a_validated_vlmrl_row_opens_with_its_full_resolution_image(tmp_path):
    from vlmrl.data.media import target_size

    path = tmp_path / "big.png"
    board().resize((400, 300), Image.Resampling.NEAREST).save(path)
    env = ToolEnvironment(load_tools(["crop"]), seen_size=lambda im: target_size(im.width, im.height, None, 40 * 30))
    prompt = env.reset({"problem": "What colour?", "images": [str(path)], "solution": "white"})
    assert prompt[0]["content"][0]["image"].size == (400, 300) and prompt[0]["content"][1] == {"type": "text", "text": "What colour?"}
    obs, _, _ = env.step('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [10, 5, 14, 8]}}</tool_call>')
    assert obs[0]["content"][0]["image"].size == (40, 30)  # the model saw 40x30: its box is scaled x10


def test_build_trajectory_rejects_unknown_end_reason():
    with pytest.raises(ValueError, match="end_reason must be one of"):
        build_trajectory([], [], end_reason="bored")
