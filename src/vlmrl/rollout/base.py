"""The rollout seam: what the loop and the evaluation ask of whatever samples completions.

A `RolloutBackend` is chosen once at the start of a run (rollout/backends.make_backend) and is the only way the loop
(`train.sample`) and the evaluation (`evaluate.evaluate_on`) reach a decoder (tests/test_rollout_seam.py checks it):
  - `sample(request)`: G completions of each prompt of one step ([P*G, T], grouped by prompt), from the per-prompt
    seeds (or the step's stream) in `request`; a backend that samples elsewhere returns the sampled tokens'
    log-probs (Completions.sampling_logps) and keeps what it measured in `metrics` (logged with the step);
  - `evaluator(model, opts)`: the greedy decoder of one evaluation (`evaluate.evaluate`), whose `greedy(rows, prompts,
    names)` gives one greedy completion per prompt: the in-process decoders on the evaluated model, or vLLM with the
    trainer's weights pushed (and probed) once per evaluation, every prompt checked as in `sample`.
Implementations: rollout/inprocess.py (vlmrl's engines: HF generate, the shared-prefix loop, the continuous decoder
with its static decode, multi-turn tool rollouts) and rollout/vllm_backend.py (vLLM colocated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vlmrl.models.rollout import Completions


@dataclass(frozen=True)
class SampleRequest:
    """One step's prompts on this process, as every backend receives them."""

    step: int
    rows: list[dict]  # [P] the dataset rows (raw: their images, tools, solutions)
    names: list[str]  # [P] how an error line names each row ("step 3, row 17 (file.jsonl)")
    prompts: dict  # the trainer's encoded prompt batch, [P, L] (input_ids, attention_mask, vision inputs)
    seeds: list[int]  # [P] one sampling stream per prompt (rollout.sampling_seed=prompt, row streams, vLLM)
    step_seed: int  # the stream of this step and process, where prompts share one (rollout.sampling_seed=step)
    prompts_per_call: int  # prompts per generate call (halved on OOM: the same samples)


class RolloutBackend(Protocol):
    """What samples a run's rollouts (see the module docstring)."""

    name: str  # "inprocess" or "vllm": logged, and named by `vlmrl check`
    metrics: dict  # what the last `sample` measured (e.g. vllm/sync_seconds), logged with the step

    def sample(self, request: SampleRequest) -> Completions:
        """[P*G, T] completions of `request.prompts`, grouped by prompt."""

    def evaluator(self, model, opts) -> Evaluator:
        """The greedy decoder of one evaluation of `model` (opts: its LogprobOptions)."""


class Evaluator(Protocol):
    """One evaluation's greedy decoder (RolloutBackend.evaluator)."""

    def greedy(self, rows: list[dict], prompts: dict, names: list[str]) -> Completions:
        """[P, T] one greedy completion per row: `rows` [P] the dataset rows, `prompts` their encoded batch [P, L],
        `names` [P] how an error line names each row."""
