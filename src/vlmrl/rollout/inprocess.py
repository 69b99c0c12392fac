"""rollout.backend=inprocess (the default): vlmrl's own engines sample in the training process, with the weights it
trains. `rollout.engine` picks the decoder inside models/rollout.generate (HF generate, the shared-prefix loop, the
continuous decoder and its static decode); tools.tools switches to multi-turn tool rollouts (run/tool_rollout.py).
Seeds: one stream per prompt where rows are sampled per prompt (continuous decoder, tools, rollout.sampling_seed=prompt),
else one stream per step and process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from vlmrl.config import Config
from vlmrl.models.processing import select_rows
from vlmrl.models.rollout import Completions, cat_completions, generate, row_streams
from vlmrl.rollout.base import SampleRequest
from vlmrl.run.tool_rollout import sample_with_tools

if TYPE_CHECKING:
    from transformers import ProcessorMixin

    from vlmrl.engine.distributed import Distributed
    from vlmrl.models.prefix import LogprobOptions
    from vlmrl.tools.registry import Tool


@dataclass
class InProcessRollout:
    """The in-process decoders behind the rollout seam. `dist`: the run's distributed.Distributed (its engine runs
    the decoder through the wrapped model and gathers sharded weights for generation); `opts`: LogprobOptions;
    `decode_agreement`: how the processes decode in step (dist.decode_agreement; None: each decides alone)."""

    cfg: Config
    dist: Distributed | None  # None: evaluate's greedy decoding on the model as it is
    model: torch.nn.Module
    processor: ProcessorMixin
    opts: LogprobOptions
    per_prompt_seed: bool = False  # rollout.sampling_seed resolved for this run
    tools: dict[str, Tool] = field(default_factory=dict)  # multi-turn tool rollouts when not empty
    pad_id: int = 0
    name: str = "inprocess"
    metrics: dict[str, float] = field(default_factory=dict)  # nothing measured here beyond the loop's own metrics
    decode_agreement: Callable[[bool], bool] | None = None

    def sample(self, request: SampleRequest) -> Completions:
        """[P*G, T] completions, seeded so that a redo (after an OOM, or after a resume) samples the same."""
        r, dist = self.cfg.rollout, self.dist
        with self.opts.autocast(), dist.gathered_for_generation(self.cfg.memory.generation_gather):
            if self.tools:  # multi-turn rollouts with tools (tool_rollout.py): the continuous decoder's seeds, one call
                return dist.call(
                    sample_with_tools, self.processor, self.cfg, self.tools, request.rows, request.prompts, request.seeds, self.decode_agreement
                )
            if row_streams(r):  # one stream per row from (seed, step, global prompt position, generation): one call
                engine = dict(engine=r.engine, decode_batch_size=r.decode_batch_size, decode_step=r.decode_step)
                return self._generate(request.prompts, request.prompts_per_call, **engine, prompt_seeds=request.seeds)
            if not self.per_prompt_seed:  # one stream per step and process (one process: rank 0, W 1)
                torch.manual_seed(request.step_seed)
                return self._generate(request.prompts, request.prompts_per_call)
            # rollout.sampling_seed=prompt: each prompt from its own stream, whichever process samples it.
            pieces = []
            for i, seed in enumerate(request.seeds):
                torch.manual_seed(seed)
                pieces.append(self._generate(select_rows(request.prompts, [i]), 1))
            return cat_completions(pieces, self.pad_id)

    def _generate(self, batch: dict, per_call: int, **engine) -> Completions:
        r = self.cfg.rollout
        return self.dist.call(
            generate,
            self.processor.tokenizer,
            batch,
            num_generations=r.num_generations,
            max_new_tokens=r.max_completion_length,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            prompts_per_call=per_call,
            min_new_tokens=r.min_completion_length,
            shared_prefix=self.opts.shared_prefix,
            decode_agreement=self.decode_agreement,
            **engine,
        )

    def evaluator(self, model: torch.nn.Module, opts) -> InProcessRollout:
        """The greedy decoder of one evaluation: this engine on `model` as the evaluation gets it (one process: the
        policy; sharded: the engine's runner), not the wrapped one."""
        return InProcessRollout(self.cfg, None, model, self.processor, opts, decode_agreement=self.decode_agreement)

    def greedy(self, rows: list[dict], prompts: dict, names: list[str]) -> Completions:
        """One greedy completion per prompt row of `prompts` [P, L] (evaluation; `rows` and `names` [P]: unused here)."""
        r = self.cfg.rollout
        with self.opts.autocast():
            return generate(
                self.model,
                self.processor.tokenizer,
                prompts,
                num_generations=1,
                do_sample=False,
                max_new_tokens=r.max_completion_length,
                shared_prefix=self.opts.shared_prefix,
                engine=r.engine,
                decode_batch_size=r.decode_batch_size,
                decode_step=r.decode_step,
                decode_agreement=self.decode_agreement,
            )
