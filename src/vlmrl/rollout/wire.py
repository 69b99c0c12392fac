"""What the trainer and a rollout server (`vlmrl rollout-server`, rollout.vllm_mode=server) exchange, and how.

Control messages are JSON over one authenticated connection (multiprocessing.connection's HMAC handshake with the
shared key, then `send_bytes` / `recv_bytes`: nothing received is ever unpickled). Images travel as base64 PNG
(lossless: the server's processor sees the trainer's pixels). Weights travel over a torch.distributed process group
of their own (gloo on CPU, NCCL on GPU) built on the server's TCPStore: never the trainer's default group, so a
DDP run's collectives and the weight push cannot meet.
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import os

import torch

KEY_ENV = "VLMRL_ROLLOUT_SERVER_KEY"  # the shared secret of the handshake (both sides); a fixed default on loopback
DEFAULT_KEY = "vlmrl-rollout-server"
MAX_MESSAGE = 1 << 30  # bytes; a longer message is refused, not read
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8)
}


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable, died, timed out or refused a request: one line naming host:port."""


def authkey() -> bytes:
    return os.environ.get(KEY_ENV, DEFAULT_KEY).encode()


def send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn) -> dict:
    """One JSON object; anything else raises ValueError."""
    message = json.loads(conn.recv_bytes(MAX_MESSAGE).decode())
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    return message


def encode_image(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: str):
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(text, validate=True)))
    image.load()
    return image


def weight_layout(weights: list[tuple[str, torch.Tensor]]) -> list[list]:
    """[[name, dtype, shape], ...] in push order: what the server allocates before the broadcasts."""
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in weights]


def flat_groups(layout: list[list]) -> dict[str, list[int]]:
    """dtype -> the positions in `layout` of its tensors: one broadcast per dtype, of their concatenation."""
    groups: dict[str, list[int]] = {}
    for i, (_, dtype, _) in enumerate(layout):
        if dtype not in DTYPES:
            raise ValueError(f"weight {layout[i][0]}: dtype {dtype} cannot be pushed")
        groups.setdefault(dtype, []).append(i)
    return groups


def weight_group(host: str, port: int, session: int, rank: int, backend: str, timeout: float, is_master: bool = False):
    """(store, process group) of two ranks (0 = the trainer, 1 = the server) under the session's prefix."""
    import torch.distributed as dist

    span = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, None, is_master=is_master, timeout=span, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"vlmrl-weights/{session}/", store)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, 2)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, 2, span)
    return store, group


def broadcast_weights(group, layout: list[list], tensors: list[torch.Tensor] | None, device: torch.device) -> list[torch.Tensor]:
    """Rank 0 sends `tensors` (in `layout` order); rank 1 passes None and gets them back, on `device`."""
    import torch.distributed as dist

    groups = flat_groups(layout)
    out: list[torch.Tensor | None] = [None] * len(layout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for dtype, positions in groups.items():
        sizes = [int(torch.Size(layout[i][2]).numel()) for i in positions]
        if tensors is not None:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in positions])
        else:
            flat = torch.empty(sum(sizes), dtype=DTYPES[dtype], device=device)
        group.broadcast([flat], opts).wait()
        for i, piece in zip(positions, torch.split(flat, sizes)):
            out[i] = piece.view(layout[i][2])
    return out  # type: ignore[return-value]
