"""rollout.backend: which sampler a run uses, chosen once at start (train.start_run), and why (`vlmrl check`)."""

from __future__ import annotations

import importlib.util

from vlmrl.config import ConfigError
from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.inprocess import InProcessRollout


def vllm_missing() -> str | None:
    """None when vLLM can be imported here, else why not (one line)."""
    if importlib.util.find_spec("vllm") is None:
        return "the vllm package is not installed in this Python (`make test-vllm` builds .venv-vllm with it; see the README)"
    return None


def describe_backend(cfg, world_size: int = 1) -> str:
    """One line for `vlmrl check`: the sampler that will run and why; raises ConfigError where it cannot."""
    r = cfg.rollout
    if r.backend == "inprocess":
        return f"rollout: vlmrl's in-process decoder (rollout.backend=inprocess, the default; rollout.engine={r.engine})"
    refuse_vllm(cfg, world_size)
    if r.vllm_mode == "server":
        from vlmrl.rollout.client import server_addresses

        servers = server_addresses(r)
        where = "the rollout server" if len(servers) == 1 else f"{len(servers)} rollout servers in data parallel"
        states = "; ".join(f"{host}:{port}: {server_state(host, port, r.vllm_server_timeout)}" for host, port in servers)
        return (
            f"rollout: vLLM in {where} (rollout.backend=vllm, vllm_mode=server; {states}); weights pushed over their own "
            "process group and probed before every rollout, every prompt checked against the trainer's"
        )
    where = "the training process" if world_size == 1 else f"each of the {world_size} training processes (DDP or FSDP2)"
    return (
        f"rollout: vLLM colocated in {where} (rollout.backend=vllm, vllm_mode={r.vllm_mode}, "
        f"vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization}); weights pushed and probed before every rollout, "
        "every prompt checked against the trainer's" + not_applied(cfg)
    )


def not_applied(cfg) -> str:
    """The GPU-only vLLM settings a run stores (the planner counts them) but does not apply here, as a clause: sleep
    (vLLM refuses it on CPU; the GPU path is not wired yet) and tensor parallelism (one training process, one rank)."""
    r = cfg.rollout
    unused = [f"vllm_sleep_level={r.vllm_sleep_level}"] if r.vllm_sleep_level else []
    unused += [f"vllm_tensor_parallel_size={r.vllm_tensor_parallel_size}"] if r.vllm_tensor_parallel_size != 1 else []
    if not unused:
        return ""
    import torch

    cpu = cfg.training.device == "cpu" or (cfg.training.device == "auto" and not torch.cuda.is_available())
    where = "on CPU (vLLM refuses sleep there; one process is one rank)" if cpu else "in this version (one process, no sleep yet)"
    return f"; {', '.join(unused)} not applied {where}: `vlmrl plan` counts them"


def server_state(host: str, port: int, timeout: float, wait: float = 2.0) -> str:
    """Whether something listens at host:port now (a server may also start later: a run waits `timeout` seconds)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=wait).close()
    except OSError as e:
        return (
            f"nothing answers there now ({e.strerror or e}): start `vlmrl rollout-server MODEL --host {host} --port {port}`; "
            f"a run waits up to {timeout:g} s (rollout.vllm_server_timeout)"
        )
    return "a server answers there"


def refuse_vllm(cfg, world_size: int, engine: str | None = None) -> None:
    """ConfigError when rollout.backend=vllm cannot run here (a server-mode trainer needs no vLLM of its own).
    Several training processes: colocated under DDP or FSDP2, each process pushing the whole model to its own engine
    (`engine`: the run's training engine name, distributed.Distributed.engine.name; None: not known yet, `vlmrl check`)."""
    missing = vllm_missing() if cfg.rollout.vllm_mode == "colocate" else None
    if missing:
        raise ConfigError(f"rollout.backend=vllm: {missing}; or set rollout.backend=inprocess")
    if world_size > 1 and cfg.rollout.vllm_mode == "server":
        raise ConfigError(
            f"rollout.vllm_mode=server with {world_size} training processes: a rollout server holds one trainer's weights; "
            "launch one process, or use rollout.vllm_mode=colocate (one vLLM engine per process, DDP)"
        )
    if world_size > 1 and engine not in (None, "ddp", "fsdp2"):
        raise ConfigError(
            f"rollout.backend=vllm with {world_size} processes runs under DDP or FSDP2 (every process pushes the whole model "
            f"to its own engine, FSDP2's shards gathered first); the {engine} engine's gather for the push is not wired yet: "
            "launch with DDP or FSDP2, or set rollout.backend=inprocess"
        )


def make_backend(cfg, dist, model, processor, opts, per_prompt_seed: bool, tools: dict, pad_id: int, log=print) -> RolloutBackend:
    """The run's rollout backend (rollout/base.py): vlmrl's in-process decoders, or vLLM (colocated, or its servers)."""
    if cfg.rollout.backend != "vllm":
        agreement = dist.decode_agreement(cfg.memory.generation_gather)  # processes decoding in step, or None
        return InProcessRollout(cfg, dist, model, processor, opts, per_prompt_seed, tools, pad_id, decode_agreement=agreement)
    refuse_vllm(cfg, dist.world_size, dist.engine.name if dist.world_size > 1 else None)
    from vlmrl.rollout.vllm_backend import VLLMRollout

    # sharded weights (FSDP2): gathered whole around each push and probe, on every process at once
    return VLLMRollout(cfg, model, processor, log, gathered=lambda: dist.gathered_for_generation("full"), call=dist.call)


def eval_backend(cfg, model, processor, log=print) -> RolloutBackend | None:
    """What `vlmrl eval` decodes with: None (the in-process decoders), or vLLM built from cfg.model.name_or_path
    (rollout.backend=vllm; its greedy decoding, rollout/vllm_backend.VLLMGreedy) with `model`'s weights pushed."""
    if cfg.rollout.backend != "vllm":
        return None
    refuse_vllm(cfg, 1)
    from vlmrl.rollout.vllm_backend import VLLMRollout

    return VLLMRollout(cfg, model, processor, log)
