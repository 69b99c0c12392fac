"""Generative rewards (VLM-as-judge): the reward `judge` asks a model to grade each completion (judge.*): the row's
images, then judge.template filled with the question, the completion and the solution; the reply's score
(judge.score_pattern, judge.score_min..score_max) becomes a reward in [0, 1].

The judge is reached in-process (judge.model_path: any family vlmrl loads, frozen, greedy) or served (judge.url: an
OpenAI-compatible chat-completions endpoint such as `vllm serve`, images as base64 data URLs). A judge's reply is
derived from the policy's output, so an unparseable reply, a timeout or a failed request never ends a run: the
completion gets judge.fallback_score, the step's metrics count it (judge/fallbacks) and one line names the row. A
judge that cannot be loaded or reached when the rewards are built is a ConfigError naming the field (exit 2)."""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmrl.config import Config, ConfigError, JudgeConfig
from vlmrl.rewards.args import completion_text


# ---------------------------------------------------------------- pure pieces: template, parser, cache key
def fill_template(template: str, question: str, completion: str, solution: str) -> str:
    """judge.template with its fields filled in (the values are inserted verbatim: braces in them are text)."""
    return template.format(question=question, completion=completion, solution=solution)


def parse_score(reply: str, pattern: str | re.Pattern, lo: float, hi: float) -> float | None:
    """The reward in [0, 1] a judge's reply gives: the first group of the last match of `pattern`, as a number v
    with lo <= v <= hi, mapped to (v - lo) / (hi - lo). None (unparseable) when nothing matches, the group is not a
    number, or v is outside [lo, hi]. E.g. "Score: 7/10" with lo 0, hi 10 -> 0.7."""
    matches = list(re.finditer(pattern, reply))
    if not matches:
        return None
    try:
        value = float(matches[-1].group(1))
    except (TypeError, ValueError, IndexError):
        return None
    if not (math.isfinite(value) and lo <= value <= hi):
        return None
    return (value - lo) / (hi - lo)


def image_fingerprint(image: Any) -> str:
    """sha256 of an image: a file's bytes (a path), an in-memory image's mode, size and pixels (PIL), or bytes."""
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        st = path.stat()
        return _file_digest(str(path), st.st_mtime_ns, st.st_size)
    h = hashlib.sha256()
    if isinstance(image, (bytes, bytearray)):
        h.update(bytes(image))
    elif hasattr(image, "tobytes"):
        h.update(f"{getattr(image, 'mode', '')}{getattr(image, 'size', '')}".encode())
        h.update(image.tobytes())
    else:
        h.update(repr(image).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """sha256 of a file's bytes, read once per (path, modification time, size): a row's image is fingerprinted for
    each of its completions every step."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_key(question: str, completion: str, solution: str, fingerprints: list[str]) -> str:
    """The judgement's cache key: (prompt, completion, solution, image fingerprints), hashed."""
    return hashlib.sha256(json.dumps([question, completion, solution, fingerprints]).encode()).hexdigest()


class JudgeCache:
    """Judgements (a score in [0, 1], or None for an unparseable reply) by cache_key, the `size` most recently used
    kept; size 0 keeps nothing. Failed and timed-out requests are not judgements and are never stored."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[str, float | None] = OrderedDict()

    def get(self, key: str) -> tuple[bool, float | None]:
        """(found, the judgement)."""
        if key not in self.entries:
            return False, None
        self.entries.move_to_end(key)
        return True, self.entries[key]

    def found(self, keys: list[str]) -> dict[str, float | None]:
        """The cached scores of `keys` (each looked up in order, as `get` does)."""
        scores = {}
        for key in keys:
            hit, score = self.get(key)
            if hit:
                scores[key] = score
        return scores

    def put(self, key: str, score: float | None) -> None:
        self.entries[key] = score
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


# ---------------------------------------------------------------- one request, one reply
@dataclass
class JudgeRequest:
    images: list  # PIL images, as the policy saw them (data.min_pixels / max_pixels)
    text: str  # judge.template filled in


@dataclass
class Reply:
    text: str | None = None
    failure: str | None = None  # why no reply came (timeout, refused, HTTP error): the fallback score, not cached


def chat_messages(request: JudgeRequest, image_part: Callable[[Any], dict]) -> list[dict]:
    """One user turn: the images first, then the text (as vlmrl's prompts place them)."""
    return [{"role": "user", "content": [*(image_part(im) for im in request.images), {"type": "text", "text": request.text}]}]


# ---------------------------------------------------------------- served judge (OpenAI-compatible)
class ServedJudge:
    """judge.url: POST {url}/chat/completions per request (greedy: temperature 0), judge.batch_size in flight, each
    with judge.timeout_s and at most judge.retries further tries. probe() (at build) asks {url}/models."""

    def __init__(self, j: JudgeConfig):
        self.j, self.base = j, j.url.rstrip("/")
        self.model = j.served_model or self.probe()

    def _headers(self) -> dict:
        key = os.environ.get(self.j.api_key_env) if self.j.api_key_env else None
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def probe(self) -> str:
        """The first model id the server lists; ConfigError naming judge.url when it cannot be reached or lists none."""
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.base}/models", headers=self._headers()), timeout=self.j.timeout_s) as r:
                ids = [m["id"] for m in json.loads(r.read())["data"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"judge.url={self.j.url}: GET {self.base}/models failed ({_reason(e)}); "
                "start the judge's server (e.g. vllm serve MODEL) or fix judge.url"
            ) from None
        if not ids:
            raise ConfigError(f"judge.url={self.j.url}: the server lists no model at {self.base}/models; set judge.served_model")
        return ids[0]

    def replies(self, requests: list[JudgeRequest]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.j.batch_size) as pool:
            return list(pool.map(self._ask, requests))

    def _ask(self, request: JudgeRequest) -> Reply:
        body = {
            "model": self.model,
            "messages": chat_messages(request, lambda im: {"type": "image_url", "image_url": {"url": data_url(im)}}),
            "max_tokens": self.j.max_new_tokens,
            "temperature": 0.0,
        }
        data = json.dumps(body).encode()
        why = ""
        for attempt in range(self.j.retries + 1):
            if attempt:
                time.sleep(min(0.1 * 2**attempt, 2.0))
            try:
                req = urllib.request.Request(f"{self.base}/chat/completions", data=data, headers=self._headers(), method="POST")
                with urllib.request.urlopen(req, timeout=self.j.timeout_s) as r:
                    return Reply(str(json.loads(r.read())["choices"][0]["message"]["content"] or ""))
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                why = _reason(e)
        return Reply(failure=f"{self.j.retries + 1} tries failed, the last: {why}")


def data_url(image) -> str:
    """A PIL image as a base64 PNG data URL (OpenAI's image_url part)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------- the reward
@dataclass
class JudgeReward:
    """The reward `judge`: fn(prompts, completions, solution=..., images=..., log_metric=...) -> [0, 1] or the
    fallback per completion. `where` (set by rewards.scoring for each batch) names a completion's row in log lines."""

    j: JudgeConfig
    backend: Any  # LocalJudge | ServedJudge: .replies(list[JudgeRequest]) -> list[Reply]
    load_images: Callable[[list], list]  # a row's image paths -> PIL images, as the policy saw them
    where: Callable[[int], str] | None = None
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    cache: JudgeCache = None

    def __post_init__(self):
        self.__name__ = "judge"
        self.pattern = re.compile(self.j.score_pattern)
        self.cache = self.cache or JudgeCache(self.j.cache_size)

    def __call__(self, prompts: list, completions: list, solution: list | None = None, images: list | None = None, log_metric=None, **kwargs):
        n = len(completions)
        questions = kwargs.get("problem") or [_question(p) for p in prompts]
        solutions = [str(s) if s is not None else "" for s in (solution or [None] * n)]
        row_images = images or [[] for _ in range(n)]
        texts = [completion_text(c) for c in completions]
        keys = [cache_key(str(q), t, s, [image_fingerprint(im) for im in ims or []]) for q, t, s, ims in zip(questions, texts, solutions, row_images)]
        scores = self.cache.found(keys)
        hits = sum(key in scores for key in keys)
        todo = first_of_each(keys, set(scores))  # each distinct judgement asked once (a group often repeats a completion)
        requests = [
            JudgeRequest(self.load_images(list(row_images[i] or [])), fill_template(self.j.template, str(questions[i]), texts[i], solutions[i]))
            for i in todo
        ]
        failures = self._ask(requests, [keys[i] for i in todo], scores)
        return self._finish(keys, scores, failures, hits, log_metric)

    def _ask(self, requests: list[JudgeRequest], keys: list[str], scores: dict) -> dict[str, str]:
        """The judge's replies to `requests` (one per key) parsed into `scores` and cached; returns why each failed."""
        failures: dict[str, str] = {}
        for key, reply in zip(keys, self.backend.replies(requests) if requests else []):
            if reply.failure is not None:
                failures[key] = reply.failure
                continue
            scores[key] = parse_score(reply.text, self.pattern, self.j.score_min, self.j.score_max)
            self.cache.put(key, scores[key])
            if scores[key] is None:
                j = self.j
                failures[key] = f"unparseable judgement {_short(reply.text)} (pattern {j.score_pattern!r}, {j.score_min:g}..{j.score_max:g})"
        return failures

    def _finish(self, keys: list[str], scores: dict, failures: dict, hits: int, log_metric) -> list[float]:
        values, fallbacks, timeouts = [], 0, 0
        for i, key in enumerate(keys):
            score = scores.get(key)
            if score is None:
                why = failures.get(key, "unparseable judgement (cached)")
                fallbacks += 1
                timeouts += key not in scores
                self.log(f"judge: {self.where(i) if self.where else f'completion {i}'}: {why}; reward judge.fallback_score={self.j.fallback_score:g}")
                score = self.j.fallback_score
            values.append(float(score))
        if log_metric is not None:
            log_metric("judge/fallbacks", fallbacks)
            log_metric("judge/failed_requests", timeouts)
            log_metric("judge/cache_hits", hits)
        return values


def first_of_each(keys: list[str], known: set[str]) -> list[int]:
    """Positions of the first occurrence of each key not in `known`, in order."""
    todo, seen = [], set(known)
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            todo.append(i)
    return todo


def _question(prompt: Any) -> str:
    """The question of a prompt: the text itself, or the text of the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"] if isinstance(prompt, list) else []
    return completion_text(users[-1:]) if users else completion_text(prompt)


def _short(text: str | None, limit: int = 80) -> str:
    text = repr(text or "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_judge(cfg: Config, local_judge: Callable[[Config], Any] | None = None) -> JudgeReward:
    """The reward `judge` of the config, its judge reached now so that one that cannot be had stops the run before it
    starts (ConfigError naming judge.model_path / judge.url): served, the server probed (ServedJudge); in-process,
    `local_judge(cfg)` (models.judge.local_judge_on: the folder checked now, loaded on first use), which the caller
    passes since it knows the device (and the models layer sits above this one)."""
    from vlmrl.data.media import load_images

    d = cfg.data

    def images(paths: list) -> list:
        paths = paths[: d.limit_images] if d.limit_images else paths
        return load_images(paths, d.min_pixels, d.max_pixels, max_image_pixels=d.max_image_pixels)

    if cfg.judge.url is not None:
        return JudgeReward(cfg.judge, ServedJudge(cfg.judge), images)
    if local_judge is None:  # a caller that cannot run a model (none today): say so rather than fail later
        raise ConfigError(f"judge.model_path={cfg.judge.model_path}: this command cannot run an in-process judge; use judge.url")
    return JudgeReward(cfg.judge, local_judge(cfg), images)
