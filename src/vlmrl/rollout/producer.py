"""The rollout producer: a process of its own that samples the rollouts of rollout.max_staleness > 0 (pipeline.py).

It holds its own copy of the policy (loaded from the run's model folder, then overwritten by every weight push),
and serves one trainer over a duplex pipe: JSON control messages (wire.send / wire.receive: nothing received is
unpickled) and, for weights and prompt tensors, broadcasts over a two-rank gloo group of their own (wire.
weight_group, wire.broadcast_weights; the trainer is rank 0). Requests are handled in the order they come:
  push   {version, layout}: the weights arrive; later samples are this version's;
  sample {step, layout, extra, seeds, step_seed, prompts_per_call}: the prompt tensors arrive, the in-process
         engine (inprocess.InProcessRollout, the synchronous loop's sampler) samples them, the reply carries the
         completions, the sampler's log-probs and the version that sampled them;
  close  : the process ends.
Any error is sent back as {"error": one line} and ends the process: the trainer stops the run with that line.
"""

from __future__ import annotations

import time

import torch

from vlmrl.rollout.wire import broadcast_weights, receive, send, weight_group

GROUP_TIMEOUT = 600.0  # seconds a broadcast may wait (the trainer sends each one right after its message)


def completions_message(comp, step: int, version: int, seconds: float) -> dict:
    """The JSON reply of one sampled step (float32 log-probs survive JSON exactly: repr round-trips a double)."""
    logps = comp.sampling_logps
    return {
        "op": "sampled",
        "step": step,
        "version": version,
        "seconds": seconds,
        "ids": comp.ids.cpu().tolist(),
        "mask": comp.mask.cpu().tolist(),
        "truncated": comp.truncated.cpu().tolist(),
        "logps": None if logps is None else logps.float().cpu().tolist(),
    }


def load_weights(model: torch.nn.Module, layout: list[list], tensors: list[torch.Tensor]) -> None:
    """Copy the pushed tensors into `model`'s parameters of the same names; a name it lacks is an error."""
    params = dict(model.named_parameters())
    missing = [name for name, _, _ in layout if name not in params]
    if missing:
        raise ValueError(f"pushed weights the producer's model does not have: {missing[:3]}")
    with torch.no_grad():
        for (name, _, _), tensor in zip(layout, tensors):
            params[name].copy_(tensor)


class Producer:
    """The producer's state: its policy copy, the version it holds, its sampler (InProcessRollout)."""

    def __init__(self, cfg, per_prompt_seed: bool, pad_id: int):
        from vlmrl.engine.device import resolve_device
        from vlmrl.engine.distributed import Distributed
        from vlmrl.models.policy import load_policy
        from vlmrl.models.prefix import LogprobOptions
        from vlmrl.rollout.inprocess import InProcessRollout

        self.device = resolve_device(cfg.training.device)
        self.model, processor = load_policy(cfg, self.device)
        self.model.eval()
        dist = Distributed(None)
        dist.engine.prepare(self.model, None)
        opts = LogprobOptions.from_config(cfg, self.device)
        self.sampler = InProcessRollout(cfg, dist, self.model, processor, opts, per_prompt_seed, {}, pad_id)
        self.version = -1  # no weights pushed yet

    def push(self, group, message: dict) -> None:
        layout = message["layout"]
        tensors = broadcast_weights(group, layout, None, torch.device("cpu"))
        load_weights(self.model, layout, tensors)
        self.version = int(message["version"])

    def sample(self, group, message: dict) -> dict:
        from vlmrl.rollout.base import SampleRequest

        layout = message["layout"]
        tensors = broadcast_weights(group, layout, None, torch.device("cpu"))
        prompts = {name: t.to(self.device) for (name, _, _), t in zip(layout, tensors)}
        prompts.update(message.get("extra") or {})
        step = int(message["step"])
        request = SampleRequest(
            step=step,
            rows=[],
            names=[f"step {step}, prompt {i}" for i in range(len(message["seeds"]))],
            prompts=prompts,
            seeds=[int(s) for s in message["seeds"]],
            step_seed=int(message["step_seed"]),
            prompts_per_call=int(message["prompts_per_call"]),
        )
        start = time.perf_counter()
        comp = self.sampler.sample(request)
        return completions_message(comp, step, self.version, time.perf_counter() - start)


def serve(conn, producer: Producer, group) -> None:
    """Requests until `close` (or the trainer's end of the pipe closes)."""
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            return
        op = message.get("op")
        if op == "close":
            return
        if op == "push":
            producer.push(group, message)
        elif op == "sample":
            send(conn, producer.sample(group, message))
        else:
            raise ValueError(f"unknown request {op!r}")


def producer_main(conn, cfg, port: int, per_prompt_seed: bool, pad_id: int, threads: int) -> None:
    """The process's entry point (multiprocessing spawn): load, say ready, join the weight group, serve."""
    import signal

    # Ctrl-C (and a SIGTERM to the process group) reaches this process too: the trainer finishes its step, writes its
    # checkpoint and closes this process; a trainer that dies closes the pipe, which ends it (EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if threads > 0:
            torch.set_num_threads(threads)
        producer = Producer(cfg, per_prompt_seed, pad_id)
        send(conn, {"op": "ready"})
        _, group = weight_group("127.0.0.1", port, 0, 1, "gloo", GROUP_TIMEOUT)
        serve(conn, producer, group)
    except BaseException as e:  # the trainer stops the run with this line
        try:
            send(conn, {"error": f"{type(e).__name__}: {e}".splitlines()[0]})
        except OSError:
            pass
        raise SystemExit(1) from None
