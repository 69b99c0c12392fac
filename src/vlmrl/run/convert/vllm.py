"""The peers' vLLM settings (TRL's GRPOConfig, ms-swift's rlhf arguments) as vlmrl's rollout fields of the same meaning,
and TRL's correction of the vLLM / trainer mismatch.
"""

from __future__ import annotations

from typing import Any


from vlmrl.run.convert.common import Conversion, VLLM, VLLM_GPU_ONLY


# The peers' vLLM settings (TRL's GRPOConfig, ms-swift's rlhf arguments) -> vlmrl's rollout fields of the same meaning.
VLLM_KEYS = {
    "vllm_gpu_memory_utilization": "rollout.vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size": "rollout.vllm_tensor_parallel_size",
    "vllm_max_model_length": "rollout.vllm_max_model_length",  # TRL
    "vllm_max_model_len": "rollout.vllm_max_model_length",  # ms-swift
}
# What each peer runs when the source leaves a vLLM setting out: TRL's GRPOConfig (vllm_mode server, a 0.3 cap) and
# ms-swift's rlhf arguments (colocate unless a server host is given, a 0.9 cap).
VLLM_DEFAULTS = {"trl": {"vllm_mode": "server", "cap": 0.3}, "ms-swift": {"vllm_mode": "colocate", "cap": 0.9}}


def convert_vllm(source: dict[str, Any], out: Conversion, peer: str) -> set[str]:
    """use_vllm true: rollout.backend=vllm colocated, with the source's cap (or its trainer's default), sleep level
    (TRL's vllm_enable_sleep_mode sleeps at level 2, ms-swift's sleep_level as given), tensor-parallel size and
    max model length; server mode (the peer's server) as rollout.vllm_mode=server at its host(s) and port(s). LoRA
    runs too (the sync pushes the merged weights, as TRL does). Returns the keys handled; use_vllm false or unset:
    none (they are listed as the source not using vLLM)."""
    if source.get("use_vllm") is not True:
        sleep = {"sleep_level", "vllm_enable_sleep_mode"} & set(source)
        for key in sleep:
            out.skip(key, VLLM)
        return sleep
    defaults = VLLM_DEFAULTS.get(peer, VLLM_DEFAULTS["trl"])
    mode = source.get("vllm_mode") or ("server" if source.get("vllm_server_host") else defaults["vllm_mode"])
    handled = {"use_vllm", "vllm_mode", *VLLM_KEYS, "vllm_enable_sleep_mode", "sleep_level"}
    if mode == "server":
        handled |= convert_vllm_server(source, out, "vllm_mode" not in source)
    if peer == "trl":
        handled |= _trl_importance_sampling(source, out)
    for key in sorted(k for k in source if k.startswith("vllm_") and k not in handled):  # vllm_enable_lora, vllm_enforce_eager, ...
        out.skip(key, "a vLLM engine setting vlmrl does not expose (vlmrl's engine: docs/vllm.md)")
        handled.add(key)
    out.set("rollout.backend", "vllm")
    out.set("rollout.vllm_mode", mode)
    write_vllm_fields(source, out, peer, defaults["cap"])
    return handled


def write_vllm_fields(source: dict[str, Any], out: Conversion, peer: str, default_cap: float) -> None:
    """The engine fields of the same meaning (VLLM_KEYS), the cap (the peer's default when unset) and the sleep level."""
    for key, target in VLLM_KEYS.items():
        if source.get(key) is not None:
            out.set(target, source[key])
    if "vllm_gpu_memory_utilization" not in source:
        out.fill("rollout.vllm_gpu_memory_utilization", default_cap)
        out.notes.append(f"{peer}'s vLLM cap for what the source leaves unset: rollout.vllm_gpu_memory_utilization={default_cap}")
    level = 2 if source.get("vllm_enable_sleep_mode") is True else source.get("sleep_level")
    if level:
        out.set("rollout.vllm_sleep_level", int(level))


def convert_vllm_server(source: dict[str, Any], out: Conversion, defaulted: bool) -> set[str]:
    """vLLM as a server (TRL's `trl vllm-serve`, ms-swift's `swift rollout`): rollout.vllm_mode=server at the source's
    host(s) and port(s), TRL's wait (vllm_server_timeout); the user starts `vlmrl rollout-server` there instead of
    the peer's server (it speaks vlmrl's protocol, not theirs). Several hosts (ms-swift's lists): rollout.vllm_servers."""
    hosts = source.get("vllm_server_host") or "127.0.0.1"
    ports = source.get("vllm_server_port") or 8000
    hosts, ports = (hosts if isinstance(hosts, list) else [hosts]), (ports if isinstance(ports, list) else [ports])
    if len(ports) == 1:
        ports = ports * len(hosts)
    pairs = [(("127.0.0.1" if h == "0.0.0.0" else str(h)), int(p)) for h, p in zip(hosts, ports)]
    if len(pairs) == 1:
        out.set("rollout.vllm_server_host", pairs[0][0])
        out.set("rollout.vllm_server_port", pairs[0][1])
    else:
        out.set("rollout.vllm_servers", [f"{h}:{p}" for h, p in pairs])
    if source.get("vllm_server_timeout") is not None:
        out.set("rollout.vllm_server_timeout", float(source["vllm_server_timeout"]))
    where = " ".join(f"--host {h} --port {p}" for h, p in pairs[:1])
    out.notes.append(
        ("the source's vllm_mode is its trainer's default, server; " if defaulted else "")
        + f"start `vlmrl rollout-server MODEL {where}` where the source ran its peer's vLLM server (docs/vllm.md: server mode)"
    )
    return {"vllm_server_host", "vllm_server_port", "vllm_server_timeout"}


# TRL's correction of the vLLM / trainer mismatch when it generates with vLLM: on by default, sequence_mask, ratios
# above 3.0 masked (GRPOConfig's vllm_importance_sampling_*; cap is the earlier name of clip_max).
TRL_IS_DEFAULTS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask"}
TRL_IS_BOUNDS = {
    "vllm_importance_sampling_cap": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_max": "algorithm.rollout_correction_max",
    "vllm_importance_sampling_clip_min": "algorithm.rollout_correction_min",
}


def _trl_importance_sampling(source: dict[str, Any], out: Conversion) -> set[str]:
    """TRL weights each token's loss by its trainer / vLLM probability ratio when it generates with vLLM (on by
    default): vlmrl's algorithm.rollout_correction of the same mode names and bounds (algo/mismatch.py), TRL's
    defaults written when the source leaves them out; vllm_importance_sampling_correction false is none."""
    keys = {*TRL_IS_DEFAULTS, *TRL_IS_BOUNDS}
    on = source.get("vllm_importance_sampling_correction", True)
    if on is False:
        out.set("algorithm.rollout_correction", "none")
        return keys
    mode = source.get("vllm_importance_sampling_mode")
    (out.set if mode else out.fill)("algorithm.rollout_correction", mode or TRL_IS_DEFAULTS["vllm_importance_sampling_mode"])
    for key, target in TRL_IS_BOUNDS.items():
        if key in source:
            out.set(target, source[key])
    if not {"vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"} & set(source):
        out.fill("algorithm.rollout_correction_max", 3.0)
    if not mode:
        out.notes.append(
            "TRL corrects the vLLM / trainer mismatch by default: algorithm.rollout_correction=sequence_mask, rollout_correction_max=3.0"
        )
    return keys


def vllm_gpu_notes(out: Conversion) -> None:
    """Settings that only act on a GPU: stored (the planner counts them), and `vlmrl check` says they are not applied on CPU."""
    defaults = {"rollout.vllm_sleep_level": 0, "rollout.vllm_tensor_parallel_size": 1}
    gpu_only = [f"{k}={out.settings[k]}" for k, default in defaults.items() if out.settings.get(k, default) != default]
    if gpu_only:
        out.notes.append(
            f"{', '.join(gpu_only)}: {VLLM_GPU_ONLY}; stored, counted by `vlmrl plan`, and `vlmrl check` says they are not applied on CPU"
        )
