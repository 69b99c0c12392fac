"""Generative rewards (the reward `judge`, issue 39 part 4): the score parser, template and cache on hand-computed
examples; the reward's fallbacks, metrics and cache with a fake judge; the served path against a stub
OpenAI-compatible server on 127.0.0.1 (no internet); the planner's term; 2-step GRPO runs with a tiny in-process
judge and with the served one."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from vlmrl.config import ConfigError, load_config
from vlmrl.rewards.judge import JudgeCache, JudgeReward, Reply, cache_key, fill_template, image_fingerprint, parse_score

PATTERN = load_config(None, []).judge.score_pattern


# ---------------------------------------------------------------- the parser, by hand
@pytest.mark.parametrize(
    "reply, lo, hi, expected",
    [
        ("Score: 7/10", 0, 10, 0.7),  # (7 - 0) / (10 - 0)
        ("score=3", 0, 10, 0.3),
        ("**Score**: 10", 0, 10, 1.0),
        ("Score: 2 at first... Final score: 9", 0, 10, 0.9),  # the last match counts
        ("Score: 4", 1, 5, 0.75),  # (4 - 1) / (5 - 1)
        ("Score: -1", -1, 1, 0.0),
        ("Score: 2.5", 0, 5, 0.5),
        ("Score: 12", 0, 10, None),  # outside the range: unparseable
        ("the answer looks right", 0, 10, None),  # garbage
        ("", 0, 10, None),
    ],
)
def test_parse_score_by_hand(reply, lo, hi, expected):
    got = parse_score(reply, PATTERN, lo, hi)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_parse_score_with_a_pattern_whose_group_is_not_a_number():
    assert parse_score("grade: A", r"grade: (\w)", 0, 10) is None
    assert parse_score("<score>8</score>", r"<score>(.*?)</score>", 0, 10) == pytest.approx(0.8)


def test_template_filled_verbatim():
    t = "Q: {question}\nA: {completion}\nS: {solution}"
    assert fill_template(t, "How many?", "{2} <answer>2</answer>", "2") == "Q: How many?\nA: {2} <answer>2</answer>\nS: 2"


def test_cache_keeps_the_most_recently_used():
    c = JudgeCache(2)
    c.put("a", 0.5)
    c.put("b", None)  # an unparseable judgement is a judgement too
    assert c.get("a") == (True, 0.5)  # a is now the most recent
    c.put("c", 1.0)
    assert c.get("b") == (False, None) and c.get("a") == (True, 0.5) and c.get("c") == (True, 1.0)
    off = JudgeCache(0)
    off.put("a", 0.5)
    assert off.get("a") == (False, None)


def test_cache_key_is_prompt_completion_solution_and_image_content(tmp_path):
    red, red2, blue = tmp_path / "r.png", tmp_path / "r2.png", tmp_path / "b.png"
    Image.new("RGB", (4, 4), "red").save(red)
    Image.new("RGB", (4, 4), "red").save(red2)
    Image.new("RGB", (4, 4), "blue").save(blue)
    assert image_fingerprint(red) == image_fingerprint(red2) != image_fingerprint(blue)  # the bytes, not the path
    base = cache_key("q", "c", "s", [image_fingerprint(red)])
    assert base == cache_key("q", "c", "s", [image_fingerprint(red2)])
    others = [cache_key("q2", "c", "s", [image_fingerprint(red)]), cache_key("q", "c2", "s", [image_fingerprint(red)])]
    others += [cache_key("q", "c", "s2", [image_fingerprint(red)]), cache_key("q", "c", "s", [image_fingerprint(blue)])]
    assert base not in others and len(set(others)) == 4


# ---------------------------------------------------------------- the reward with a fake judge
class FakeJudge:
    def __init__(self, replies: dict[str, Reply]):
        self.replies_by_completion, self.asked = replies, []

    def replies(self, requests):
        self.asked += [r.text for r in requests]
        return [next(v for k, v in self.replies_by_completion.items() if f"Answer to grade: {k}\n" in r.text) for r in requests]


def _reward(replies: dict[str, Reply], cache_size: int = 16):
    j = load_config(
        None, ["algorithm.reward_funcs=[judge]", "judge.url=http://127.0.0.1:1/v1", f"judge.cache_size={cache_size}", "judge.fallback_score=-1"]
    ).judge
    lines, metrics = [], {}
    fake = FakeJudge(replies)
    fn = JudgeReward(j, fake, load_images=lambda paths: [], log=lines.append)
    return fn, fake, lines, metrics


def test_scores_fallbacks_metrics_and_cache():
    fn, fake, lines, metrics = _reward({"good": Reply("Score: 8"), "junk": Reply("blah"), "down": Reply(failure="HTTP 500")})
    call = dict(prompts=["q"] * 4, completions=["good", "junk", "down", "good"], solution=["2"] * 4, log_metric=metrics.__setitem__)
    assert fn(**call) == [pytest.approx(0.8), -1.0, -1.0, pytest.approx(0.8)]
    assert len(fake.asked) == 3  # "good" twice in the batch: asked once
    assert metrics == {"judge/fallbacks": 2, "judge/failed_requests": 1, "judge/cache_hits": 0}
    assert len(lines) == 2 and "completion 1" in lines[0] and "unparseable" in lines[0] and "'blah'" in lines[0]
    assert "completion 2" in lines[1] and "HTTP 500" in lines[1] and "fallback_score=-1" in lines[1]
    # again: "good" and "junk" come from the cache, the failed request is asked again (a failure is not a judgement)
    assert fn(**call) == [pytest.approx(0.8), -1.0, -1.0, pytest.approx(0.8)]
    assert len(fake.asked) == 4 and "Answer to grade: down\n" in fake.asked[-1]
    assert metrics == {"judge/fallbacks": 2, "judge/failed_requests": 1, "judge/cache_hits": 3}


def test_no_cache_asks_every_call():
    fn, fake, _, _ = _reward({"good": Reply("Score: 8")}, cache_size=0)
    fn(prompts=["q"], completions=["good"], solution=["2"])
    fn(prompts=["q"], completions=["good"], solution=["2"])
    assert len(fake.asked) == 2


def test_the_row_is_named_through_where():
    fn, _, lines, _ = _reward({"junk": Reply("nothing")})
    fn.where = lambda i: f"sample {i} (step 3, row data.jsonl:7)"
    fn(prompts=[[{"role": "user", "content": [{"type": "text", "text": "How many?"}]}]], completions=[[{"role": "assistant", "content": "junk"}]])
    (line,) = lines
    assert line.startswith("judge: sample 0 (step 3, row data.jsonl:7): unparseable")


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.reward_funcs=[judge]"], "set exactly one of judge.model_path (in-process) and judge.url (served)"),
        (["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", "judge.model_path=/m"], "set exactly one of judge.model_path"),
        (["judge.url=http://a/v1"], "judge.url is set but algorithm.reward_funcs does not list judge"),
        (["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", "judge.template='{question} {answer} {completion}'"], "unknown field(s) answer"),
        (["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", "judge.template='{question}'"], "judge.template has no {completion}"),
        (["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", "judge.score_pattern='score: \\d+'"], "has no group"),
        (["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", "judge.score_max=0"], "judge.score_max=0.0 must be > judge.score_min=0.0"),
        (["algorithm.reward_funcs=[judge]", "judge.url=ftp://a"], "must start with http://"),
    ],
)
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_the_name_judge_outside_the_config_is_explained():
    from vlmrl.rewards.guard import RewardError
    from vlmrl.rewards.loading import load_reward

    with pytest.raises(RewardError, match="built from the config"):
        load_reward("judge")


# ---------------------------------------------------------------- served: a stub OpenAI-compatible server
class Stub:
    """An OpenAI-compatible server on 127.0.0.1 (port 0): GET /v1/models, POST /v1/chat/completions answering
    `reply` (a string, or a list consumed one per request; an int is an HTTP error status; "hang" waits until closed)."""

    def __init__(self, reply):
        self.reply, self.bodies, self.release = reply, [], threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "tiny-judge", "object": "model"}]})

            def do_POST(self):
                stub.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                reply = stub.reply.pop(0) if isinstance(stub.reply, list) else stub.reply
                if reply == "hang":
                    stub.release.wait(10)
                    return
                if isinstance(reply, int):
                    return self._send(reply, {"error": "stub"})
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub(request):
    s = Stub(getattr(request, "param", "Score: 7/10"))
    yield s
    s.close()


def _served(url, *extra):
    from vlmrl.rewards.judge import build_judge

    cfg = load_config(None, ["algorithm.reward_funcs=[judge]", f"judge.url={url}", "data.min_pixels=3136", "data.max_pixels=3136", *extra])
    return build_judge(cfg)


def test_served_judge_reads_the_score_and_sends_the_image(stub, tmp_path):
    img = tmp_path / "i.png"
    Image.new("RGB", (56, 56), (10, 200, 30)).save(img)
    fn = _served(stub.url)
    metrics = {}
    got = fn(prompts=["How many shapes?"], completions=["<answer>3</answer>"], solution=["3"], images=[[str(img)]], log_metric=metrics.__setitem__)
    assert got == [pytest.approx(0.7)] and metrics["judge/fallbacks"] == 0
    (body,) = stub.bodies
    assert body["model"] == "tiny-judge" and body["temperature"] == 0.0 and body["max_tokens"] == 64
    (msg,) = body["messages"]
    image_part, text_part = msg["content"]
    assert (
        text_part["type"] == "text"
        and "Question: How many shapes?" in text_part["text"]
        and "Answer to grade: <answer>3</answer>" in text_part["text"]
    )
    head, data = image_part["image_url"]["url"].split(",", 1)
    assert head == "data:image/png;base64"
    sent = Image.open(io.BytesIO(base64.b64decode(data)))
    assert sent.size == (56, 56) and sent.getpixel((5, 5)) == (10, 200, 30)


@pytest.mark.parametrize("stub", [[500, 503, "Score: 9"]], indirect=True)
def test_served_judge_retries_a_failed_request(stub):
    assert _served(stub.url, "judge.retries=2")(prompts=["q"], completions=["a"], solution=["s"]) == [pytest.approx(0.9)]
    assert len(stub.bodies) == 3


@pytest.mark.parametrize("stub", [500], indirect=True)
def test_served_judge_gives_up_after_the_retries_with_the_fallback(stub):
    metrics = {}
    fn = _served(stub.url, "judge.retries=1", "judge.fallback_score=0.25")
    lines = []
    fn.log = lines.append
    assert fn(prompts=["q"], completions=["a"], solution=["s"], log_metric=metrics.__setitem__) == [0.25]
    assert len(stub.bodies) == 2 and metrics["judge/failed_requests"] == 1
    (line,) = lines
    assert "2 tries failed" in line and "HTTP 500" in line


@pytest.mark.parametrize("stub", ["hang"], indirect=True)
def test_served_judge_times_out_with_the_fallback(stub):
    fn = _served(stub.url, "judge.retries=0", "judge.timeout_s=0.3", "judge.served_model=m")  # no probe: the stub hangs
    lines = []
    fn.log = lines.append
    assert fn(prompts=["q"], completions=["a"], solution=["s"]) == [0.0]
    (line,) = lines
    assert "1 tries failed, the last: " in line and "timed out" in line


def test_an_unreachable_server_is_a_config_error_naming_the_field():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError) as e:
        _served(f"http://127.0.0.1:{port}/v1", "judge.timeout_s=5")
    msg = str(e.value)
    assert msg.startswith(f"judge.url=http://127.0.0.1:{port}/v1: GET") and "\n" not in msg


def test_a_bad_judge_folder_is_a_config_error_naming_the_field(tmp_path):
    import torch

    from vlmrl.models.judge import local_judge_on
    from vlmrl.rewards.judge import build_judge

    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        cfg = load_config(None, ["algorithm.reward_funcs=[judge]", f"judge.model_path={folder}"])
        with pytest.raises(ConfigError, match=f"^judge.model_path={folder}: "):
            build_judge(cfg, local_judge_on(torch.device("cpu")))


# ---------------------------------------------------------------- the planner
def test_the_planner_holds_the_judge_and_its_generation():
    import dataclasses

    from test_planner import FP32, SPEC

    from vlmrl.plan.estimate import plan

    P, G = 3 * SPEC.total_params, 10_000_000
    base, judged = plan(SPEC, FP32), plan(SPEC, dataclasses.replace(FP32, judge_params=P, judge_generate_bytes=G))
    assert base.terms["judge_model"] == 0 and base.terms["judge_generation"] == 0
    assert judged.terms["judge_model"] == P * 4 and judged.terms["judge_generation"] == G
    for phase in ("rollout", "scoring", "update"):  # the judge stays on the device through the step
        assert judged.phases[phase] - base.phases[phase] >= P * 4
    # the judge's generate (after the rollout's, before scoring) is the rollout phase's peak when it is the larger one
    J = 64 * 2**30
    big = plan(SPEC, dataclasses.replace(FP32, judge_params=P, judge_generate_bytes=J))
    assert big.phases["rollout"] >= J + P * 4 > big.phases["scoring"]


def test_workload_from_a_config_with_a_judge(tiny_qwen25vl):
    from vlmrl.plan.config import workload_from_config
    from vlmrl.plan.hf import spec_from_hf_config

    on = ["algorithm.reward_funcs=[judge]", f"judge.model_path={tiny_qwen25vl}", f"model.name_or_path={tiny_qwen25vl}"]
    w = workload_from_config(load_config(None, on))
    assert w.judge_params == spec_from_hf_config(str(tiny_qwen25vl)).total_params > 0 and w.judge_generate_bytes > 0
    served = workload_from_config(
        load_config(None, ["algorithm.reward_funcs=[judge]", "judge.url=http://a/v1", f"model.name_or_path={tiny_qwen25vl}"])
    )
    assert served.judge_params == 0 and served.judge_generate_bytes == 0  # a served judge takes no memory here


# ---------------------------------------------------------------- runs
def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.integration
def test_grpo_with_a_tiny_in_process_judge(tiny_qwen25vl, tmp_path, capsys):
    """`vlmrl tiny` writes the judge folder; `vlmrl train` (preflight included) runs 2 GRPO steps that score every
    completion with it in-process. A random tiny judge writes no "score N" (its greedy replies are digits and noise),
    so each of a step's 4 completions gets the fallback 0.5: the step counts 4 fallbacks and the log names each row."""
    from test_hostile_user_code import run_args
    from vlmrl.cli import main
    from vlmrl.data.tasks import make_count_task

    judge = tmp_path / "judge"
    assert main(["tiny", "--family", "qwen2.5-vl", "--seed", "1", str(judge)]) == 0
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    out = tmp_path / "local"
    extra = ["algorithm.reward_funcs=[judge]", f"judge.model_path={judge}", "judge.max_new_tokens=4", "judge.fallback_score=0.5"]
    assert main(["train", *run_args(tiny_qwen25vl, data, out, *extra)]) == 0
    ms = _metrics(out)
    assert [m["judge/fallbacks"] for m in ms] == [4, 4] and all(m["rewards/judge/mean"] == 0.5 for m in ms)
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if x.startswith("judge: sample ") and " at step " in x]
    assert len(lines) == 8 and "at step 1 (row " in lines[0] and "train.jsonl:" in lines[0] and "unparseable judgement" in lines[0]
    checked = [x for x in err if x.startswith("judge: sample ") and " at the check before training " in x]  # preflight's probe
    assert len(checked) == 2 and "train.jsonl:1" in checked[0]


@pytest.mark.integration
def test_grpo_with_a_served_judge(tiny_qwen25vl, stub, tmp_path):
    """The same run with the judge served by the stub (it answers "Score: 7/10" to everything): every reward is 0.7,
    no fallback, and every request carried the row's image."""
    from test_hostile_user_code import run_args
    from vlmrl.cli import main
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    out = tmp_path / "served"
    assert main(["train", *run_args(tiny_qwen25vl, data, out, "algorithm.reward_funcs=[judge]", f"judge.url={stub.url}")]) == 0
    ms = _metrics(out)
    assert len(ms) == 2 and all(m["reward"] == pytest.approx(0.7) and m["judge/fallbacks"] == 0 for m in ms)
    assert stub.bodies and all(b["messages"][0]["content"][0]["type"] == "image_url" for b in stub.bodies)


@pytest.mark.parametrize("source", ["model_path", "url"])
def test_a_judge_that_cannot_be_had_stops_the_run_before_it_starts(tiny_qwen25vl, tmp_path, capsys, source):
    """`vlmrl train` with a judge folder that does not exist, or a URL where nothing listens: exit 2, one line naming
    the field, nothing trained."""
    from test_hostile_user_code import run_args
    from vlmrl.cli import main
    from vlmrl.data.tasks import make_count_task

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    value = str(tmp_path / "no-judge") if source == "model_path" else f"http://127.0.0.1:{port}/v1"
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    args = run_args(tiny_qwen25vl, data, tmp_path / "out", "algorithm.reward_funcs=[judge]", f"judge.{source}={value}")
    assert main(["train", *args]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmrl train:")]
    assert f"judge.{source}={value}" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_vlmrl_plan_shows_the_judge(tiny_qwen25vl, tmp_path, capsys):
    from vlmrl.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{name_or_path: {tiny_qwen25vl}}}\nalgorithm: {{reward_funcs: [judge]}}\njudge: {{model_path: {tiny_qwen25vl}}}\n")
    assert main(["plan", "--config", str(config)]) == 0
    rows = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.startswith("judge_"))
    assert set(rows) == {"judge_model", "judge_generation"} and all(float(v) > 0 for v in rows.values())


def test_the_in_process_judge_is_greedy(tiny_qwen25vl, tmp_path):
    """The same requests under two torch seeds get the same replies (greedy decoding: a judgement does not depend on
    the random state, so a cache hit and a fresh judgement agree)."""
    from vlmrl.models.judge import LocalJudge
    from vlmrl.rewards.judge import JudgeRequest

    cfg = load_config(None, ["algorithm.reward_funcs=[judge]", f"judge.model_path={tiny_qwen25vl}", "judge.max_new_tokens=8", "data.max_pixels=3136"])
    judge = LocalJudge(cfg, torch.device("cpu"))
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    requests = [JudgeRequest([image], f"Grade: {t}") for t in ("<answer>2</answer>", "three", "")]
    torch.manual_seed(0)
    first = judge.replies(requests)
    torch.manual_seed(1)
    again = judge.replies(requests)
    assert [r.text for r in first] == [r.text for r in again] and all(r.failure is None for r in first)
    assert any(r.text for r in first)  # the tiny judge writes something


def test_the_in_process_judge_times_out_with_a_failure(tiny_qwen25vl):
    """judge.timeout_s is generate's max_time: with a budget no generate can meet, generation stops after its first
    token and the unfinished rows are failures (the fallback score, never cached), not a truncated reply to parse."""
    from vlmrl.models.judge import LocalJudge
    from vlmrl.rewards.judge import JudgeRequest

    over = ["algorithm.reward_funcs=[judge]", f"judge.model_path={tiny_qwen25vl}", "judge.max_new_tokens=8", "judge.timeout_s=1e-9"]
    judge = LocalJudge(load_config(None, over), torch.device("cpu"))
    (reply,) = judge.replies([JudgeRequest([Image.new("RGB", (56, 56))], "Grade: 2")])
    assert reply.text is None and reply.failure == "no reply within judge.timeout_s=1e-09"


@pytest.mark.slow
def test_stop_and_resume_with_an_in_process_judge_is_bit_exact(tiny_qwen25vl, tmp_path):
    """The judge decodes greedily, so a run stopped after step 2 and resumed (its judge reloaded, its cache empty)
    judges the resumed steps as the straight run did: the same judge rewards, losses and final weights. The pattern
    reads the last digit the random tiny judge writes (it writes digits), so the judge's reward varies."""
    from safetensors.torch import load_file
    from test_resume import overrides
    from vlmrl.data.tasks import make_count_task
    from vlmrl.tiny_models.tiny_families import build_family
    from vlmrl.train import train

    judge = build_family("qwen2.5-vl", tmp_path / "judge", seed=1)
    data = make_count_task(tmp_path / "count", n_train=8, n_test=2, seed=0, image_size=56)
    extra = (
        "algorithm.reward_funcs=[judge]",
        f"judge.model_path={judge}",
        "judge.max_new_tokens=6",
        r"judge.score_pattern='(\d)\D*$'",
        "judge.score_max=9",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(load_config(None, overrides(tiny_qwen25vl, data, straight, *extra)))
    cfg = load_config(None, overrides(tiny_qwen25vl, data, resumed, *extra))
    train(cfg, stop_after=2)
    train(cfg)
    keys = ("loss", "reward", "rewards/judge/mean", "judge/fallbacks")
    a_rows, b_rows = _metrics(straight), _metrics(resumed)
    assert len(a_rows) == 4 and any(r["reward_std"] > 0 for r in a_rows)  # the judge's rewards carry a signal
    assert [[r[k] for k in keys] for r in b_rows] == [[r[k] for k in keys] for r in a_rows]
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
