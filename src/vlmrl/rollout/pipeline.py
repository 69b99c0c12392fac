"""rollout.max_staleness = k > 0: rollouts are sampled by a producer process (producer.py) while the trainer updates.

The schedule is fixed, so a run is reproducible and resumable: step s is sampled by policy version
`sampling_version(s, k)` = max(0, s-1-k) (version v = the weights after v optimizer steps' worth of GRPO steps; the
synchronous loop is k = 0: step s by version s-1). After step t the trainer pushes version t and submits step
t+k+1; while it scores and updates step t+1 the producer samples ahead. Each row records the version that sampled it
and the trainer refuses a batch more than k versions behind (`check_staleness`, one line).

Before every push the trainer collects every reply outstanding (a reply the trainer does not read could block the
producer while the trainer waits in the broadcast): so at a push the producer is idle, and every sample submitted
before it is complete. That costs no overlap at k = 1 (the trainer needs that step next anyway); at k >= 2 the
producer's head start is bounded by one step's generation (a receiving thread on the producer would lift it).

Checkpoints: the queue after step t holds steps t+1 .. t+k+1. Those sampled by versions before t are complete and
saved in the checkpoint (their weights are gone); those of version t (submitted after the last push) are saved as
their prompts and sampled again on resume from the checkpoint's weights and the same seeds (`saved`, `restore`).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from vlmrl.models.rollout import Completions
from vlmrl.rollout.base import SampleRequest
from vlmrl.rollout.wire import broadcast_weights, receive, send, weight_group, weight_layout

READY_TIMEOUT = 600.0  # seconds the producer may take to load its model


class RolloutProducerError(RuntimeError):
    """The rollout producer died or refused a request: one line."""


class StalenessError(RuntimeError):
    """A batch sampled more than rollout.max_staleness versions behind the policy it would train."""


def sampling_version(step: int, k: int) -> int:
    """The policy version that samples step `step` (1-based) with at most k versions of staleness."""
    return max(0, step - 1 - k)


def versions_behind(step: int, versions: torch.Tensor) -> torch.Tensor:
    """[N] how many versions behind the policy that trains step `step` (version step-1) each row's sampler was."""
    return (step - 1) - versions.long()


def staleness_metrics(step: int, versions: torch.Tensor) -> dict:
    """staleness/mean and staleness/max (versions behind) of one step's rows."""
    behind = versions_behind(step, versions).double()
    return {"staleness/mean": behind.mean().item(), "staleness/max": behind.max().item()}


def check_staleness(step: int, versions: torch.Tensor, k: int) -> None:
    """Raise StalenessError when some row of step `step` was sampled more than k versions behind."""
    worst = int(versions_behind(step, versions).max())
    if worst > k or worst < 0:
        raise StalenessError(
            f"step {step}: rows sampled by policy version {int(versions.min())}, {worst} versions behind; rollout.max_staleness={k} allows 0..{k}"
        )


def completions_of(message: dict) -> Completions:
    """The Completions of a producer's reply (or of a checkpointed queue entry)."""
    logps = message.get("logps")
    return Completions(
        ids=torch.tensor(message["ids"], dtype=torch.long),
        mask=torch.tensor(message["mask"], dtype=torch.long),
        truncated=torch.tensor(message["truncated"], dtype=torch.bool),
        sampling_logps=None if logps is None else torch.tensor(logps, dtype=torch.float32),
    )


@dataclass
class Queued:
    """One step's rollout in the pipeline: its prompts (dataset indices), the version sampling it, and once sampled
    the producer's reply (completions, sampler log-probs, seconds)."""

    step: int
    indices: list[int]  # the step's dataset rows (the sampler's draw, in order)
    version: int
    reply: dict | None = None  # None while in flight

    def as_saved(self) -> dict:
        done = self.reply is not None
        keep = ("ids", "mask", "truncated", "logps", "seconds") if done else ()
        return {"step": self.step, "indices": self.indices, "version": self.version, **{k: self.reply[k] for k in keep}}


def trainable_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a push sends: the parameters training changes (frozen ones are the producer's from the same folder)."""
    from vlmrl.models.loading import unwrap

    return [(name, p.detach()) for name, p in unwrap(model).named_parameters() if p.requires_grad]


class RolloutPipeline:
    """The trainer's side: the producer process, its connection and weight group, and the queue of steps."""

    def __init__(self, cfg, per_prompt_seed: bool, pad_id: int, threads: int = 0, log=print):
        import multiprocessing

        import torch.distributed as dist

        from vlmrl.rollout.producer import producer_main

        self.k, self.last, self.log = cfg.rollout.max_staleness, cfg.training.max_steps, log
        self.queue: dict[int, Queued] = {}
        self.inflight: list[int] = []  # steps submitted and not yet answered, in order
        self.version = -1
        self.metrics: dict = {}
        span = datetime.timedelta(seconds=READY_TIMEOUT)
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=span, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(
            target=producer_main, args=(child, cfg, self.store.port, per_prompt_seed, pad_id, threads), name="vlmrl-rollout-producer", daemon=True
        )
        self.process.start()
        child.close()
        self._reply("ready", READY_TIMEOUT)
        _, self.group = weight_group("127.0.0.1", self.store.port, 0, 0, "gloo", READY_TIMEOUT)

    # ------------------------------------------------------------ requests
    def push(self, model: torch.nn.Module, version: int) -> float:
        """The weights of `version` to the producer (after every reply outstanding is in: the wait is logged as
        pipeline/collect_seconds); returns the seconds of the push itself."""
        start = time.perf_counter()
        self.collect()
        self.metrics["pipeline/collect_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        weights = trainable_weights(model)
        layout = weight_layout(weights)
        self._send({"op": "push", "version": version, "layout": layout})
        broadcast_weights(self.group, layout, [t.cpu() for _, t in weights], torch.device("cpu"))
        self.version = version
        return time.perf_counter() - start

    def submit(self, request: SampleRequest, indices: list[int]) -> None:
        """Ask for step `request.step`'s samples, from the version pushed last (its prompt tensors broadcast now)."""
        tensors = {k: v for k, v in request.prompts.items() if torch.is_tensor(v)}
        extra = {k: v for k, v in request.prompts.items() if not torch.is_tensor(v)}
        layout = weight_layout(list(tensors.items()))
        self._send(
            {
                "op": "sample",
                "step": request.step,
                "layout": layout,
                "extra": extra,
                "seeds": request.seeds,
                "step_seed": request.step_seed,
                "prompts_per_call": request.prompts_per_call,
            }
        )
        broadcast_weights(self.group, layout, [t.cpu() for t in tensors.values()], torch.device("cpu"))
        self.queue[request.step] = Queued(request.step, list(indices), self.version)
        self.inflight.append(request.step)

    def due(self, done: int) -> list[int]:
        """The steps after `done` the queue must hold (done+1 .. done+k+1, none past the run's last) that it does not."""
        return [s for s in range(done + 1, min(done + self.k + 1, self.last) + 1) if s not in self.queue]

    def take(self, step: int) -> tuple[Queued, Completions]:
        """Step `step`'s rollout (waiting for it when in flight), its staleness checked and logged."""
        start = time.perf_counter()
        entry = self.queue[step]
        while entry.reply is None:
            self._collect_one()
        for old in [s for s in self.queue if s < step]:  # trained, or left by a resume: never used again
            del self.queue[old]
        comp = completions_of(entry.reply)
        versions = torch.full((comp.ids.shape[0],), entry.version, dtype=torch.long)
        check_staleness(step, versions, self.k)
        self.metrics = {
            **staleness_metrics(step, versions),
            "pipeline/wait_seconds": time.perf_counter() - start,
            "pipeline/generate_seconds": float(entry.reply["seconds"]),
        }
        return entry, comp

    # ------------------------------------------------------------ checkpoints
    def saved(self, done: int) -> list[dict]:
        """The queue after step `done`, for its checkpoint: sampled entries whole, version-`done` ones as prompts."""
        entries = [self.queue[s] for s in sorted(self.queue) if s > done]
        lost = [e.step for e in entries if e.reply is None and e.version != done]
        if lost:  # every push collects first, so an older version's sample is never in flight here
            raise RolloutProducerError(f"steps {lost} in flight from versions before {done}: they could not be sampled again")
        return [e.as_saved() for e in entries]

    def restore(self, entries: list[dict]) -> list[Queued]:
        """Put a checkpoint's queue back; returns the entries to sample again (their version's weights are the
        checkpoint's, pushed before: same weights, same seeds, same samples)."""
        again = []
        for saved in entries:
            entry = Queued(int(saved["step"]), [int(i) for i in saved["indices"]], int(saved["version"]))
            if "ids" in saved:
                entry.reply = dict(saved)
            else:
                again.append(entry)
            self.queue[entry.step] = entry
        return again

    def close(self) -> None:
        try:
            self._send({"op": "close"})
        except (RolloutProducerError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=30)
        self.conn.close()

    # ------------------------------------------------------------ the connection
    def collect(self) -> None:
        """Every outstanding reply."""
        while self.inflight:
            self._collect_one()

    def _collect_one(self) -> None:
        reply = self._reply("sampled", None)
        step = self.inflight.pop(0)
        if int(reply["step"]) != step or int(reply["version"]) != self.queue[step].version:
            raise RolloutProducerError(
                f"the rollout producer answered step {reply['step']} (version {reply['version']}) where step {step} "
                f"(version {self.queue[step].version}) was due"
            )
        self.queue[step].reply = reply

    def _send(self, message: dict) -> None:
        try:
            send(self.conn, message)
        except OSError as e:
            raise RolloutProducerError(self._gone(f"{type(e).__name__} sending {message['op']}")) from None

    def _reply(self, op: str, wait: float | None) -> dict:
        """The next message from the producer (waiting up to `wait` seconds, or as long as it lives)."""
        deadline = None if wait is None else time.monotonic() + wait
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                if self.conn.poll(0):  # its last words
                    break
                raise RolloutProducerError(self._gone(f"exit code {self.process.exitcode}, waiting for {op}"))
            if deadline is not None and time.monotonic() > deadline:
                raise RolloutProducerError(f"the rollout producer (pid {self.process.pid}) sent no {op} within {wait:g} s")
        try:
            message = receive(self.conn)
        except (EOFError, OSError) as e:
            raise RolloutProducerError(self._gone(f"{type(e).__name__} waiting for {op}")) from None
        if "error" in message:
            raise RolloutProducerError(f"the rollout producer (pid {self.process.pid}) failed: {message['error']}")
        return message

    def _gone(self, what: str) -> str:
        if not self.process.is_alive() and "exit code" not in what:
            what = f"exit code {self.process.exitcode}, {what}"
        return (
            f"the rollout producer (pid {self.process.pid}) is gone ({what}); its error, if any, is above. "
            "Run the same command again: it resumes from the newest checkpoint"
        )
