"""rollout.vllm_mode=server, the trainer's side: a RemoteEngine answers what vllm_engine.LocalEngine answers, from a
rollout server (`vlmrl rollout-server`, server.py) over one authenticated connection (wire.py).

Connecting retries until the server answers or rollout.vllm_server_timeout passes (a server still loading its
model); afterwards every reply must come within that timeout. A server that is gone, dies or stays silent ends
the run with one line naming host:port (RolloutServerError), never a hang. Each RemoteEngine is a new session:
a resumed run connects again, and the run pushes its weights before its first rollout as any run does.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import torch

from vlmrl.rollout.wire import RolloutServerError, authkey, broadcast_weights, encode_image, receive, send, weight_group, weight_layout


def connect(host: str, port: int, timeout: float) -> Connection:
    """An authenticated connection to host:port, retried once a second for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(1.0, deadline - time.monotonic()))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RolloutServerError(
                    f"no rollout server answers at {host}:{port} after {timeout:g} s ({e.strerror or e}); start one with "
                    f"`vlmrl rollout-server MODEL --host {host} --port {port}`, or set rollout.vllm_server_host/port"
                ) from None
            time.sleep(1.0)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout):  # the server is busy with another trainer (one at a time)
            raise RolloutServerError(
                f"the rollout server at {host}:{port} did not answer the handshake within {timeout:g} s (serving another trainer?)"
            )
        answer_challenge(conn, authkey())
        deliver_challenge(conn, authkey())
    except (OSError, EOFError) as e:
        conn.close()
        raise RolloutServerError(
            f"the rollout server at {host}:{port} closed the connection ({type(e).__name__}: {e}); "
            "is VLMRL_ROLLOUT_SERVER_KEY the same on both sides?"
        ) from None
    except AuthenticationError as e:
        conn.close()
        raise RolloutServerError(
            f"the rollout server at {host}:{port} refused the handshake ({e}): set the same VLMRL_ROLLOUT_SERVER_KEY on both sides"
        ) from None
    return conn


class RemoteEngine:
    """One session with a rollout server: its engine built (or found) with this run's options, and a weight group."""

    def __init__(self, host: str, port: int, timeout: float, options: dict, backend: str):
        self.address, self.timeout, self.options, self.backend = f"{host}:{port}", timeout, options, backend
        self.conn = connect(host, port, timeout)
        reply = self.call({"op": "init", "options": options, "backend": backend}, wait=max(timeout, 600.0))
        self.folder = reply["model"]
        # The weight group: the server's TCPStore, this trainer rank 0, the server rank 1, this session's prefix.
        self.store, self.group = weight_group(host, reply["group_port"], reply["session"], 0, backend, timeout)

    def call(self, message: dict, wait: float | None = None) -> dict:
        """Send one request, return its reply; RolloutServerError when the server is gone, silent or refuses."""
        try:
            send(self.conn, message)
        except OSError as e:
            raise RolloutServerError(
                f"the rollout server at {self.address} is gone ({type(e).__name__} sending {message['op']}); restart it, then resume the run"
            ) from None
        return self._reply(message["op"], wait)

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> float:
        """The weights over the weight group (one broadcast per dtype), then the server's reload; returns seconds."""
        start = time.perf_counter()
        layout = weight_layout(weights)
        try:
            send(self.conn, {"op": "push", "layout": layout})
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
            broadcast_weights(self.group, layout, [t for _, t in weights], device)
        except (OSError, EOFError, RuntimeError) as e:
            raise RolloutServerError(
                f"the rollout server at {self.address} is gone (pushing weights: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        self._reply("push", None)
        return time.perf_counter() - start

    def _reply(self, op: str, wait: float | None) -> dict:
        wait = self.timeout if wait is None else wait
        try:
            if not self.conn.poll(wait):
                raise RolloutServerError(
                    f"the rollout server at {self.address} sent no reply to {op} within {wait:g} s (rollout.vllm_server_timeout)"
                )
            reply = receive(self.conn)
        except (OSError, EOFError) as e:
            raise RolloutServerError(
                f"the rollout server at {self.address} is gone ({type(e).__name__} during {op}); restart it, then resume the run"
            ) from None
        if "error" in reply:
            raise RolloutServerError(f"the rollout server at {self.address} refused {op}: {reply['error']}")
        return reply

    def prompt_logprobs(self, ids: list[int], images: list, n: int) -> list[float]:
        return self.call({"op": "prompt_logprobs", "ids": ids, "images": [encode_image(i) for i in images], "n": n})["logprobs"]

    def generate(self, requests: list[dict], params: list[dict]) -> list[dict]:
        wire = [{"prompt": r["prompt"], "images": [encode_image(i) for i in r.get("multi_modal_data", {}).get("image", [])]} for r in requests]
        return self.call({"op": "generate", "requests": wire, "params": params})["outputs"]

    def close(self) -> None:
        self.conn.close()


class ServerPool:
    """Several rollout servers in data parallel: each rollout's prompts split among them in contiguous shares, in
    order (each prompt samples from its own seed, so which server samples it changes nothing), the weights pushed to
    every one (each over its own group, at once), each one probed (VLLMRollout.check_probe walks `engines`)."""

    def __init__(self, engines: list[RemoteEngine]):
        self.engines = engines
        self.address = ", ".join(e.address for e in engines)
        self.folder, self.backend = engines[0].folder, engines[0].backend
        self.pool = ThreadPoolExecutor(len(engines))

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> float:
        start = time.perf_counter()
        list(self.pool.map(lambda e: e.push(weights), self.engines))
        return time.perf_counter() - start

    def prompt_logprobs(self, ids: list[int], images: list, n: int) -> list[float]:
        return self.engines[0].prompt_logprobs(ids, images, n)

    def generate(self, requests: list[dict], params: list[dict]) -> list[dict]:
        k = len(self.engines)
        bounds = [len(requests) * i // k for i in range(k + 1)]
        shares = [(e, requests[a:b], params[a:b]) for e, a, b in zip(self.engines, bounds, bounds[1:]) if b > a]
        return [out for part in self.pool.map(lambda s: s[0].generate(s[1], s[2]), shares) for out in part]

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.pool.shutdown()


def server_addresses(r) -> list[tuple[str, int]]:
    """(host, port) of each server: rollout.vllm_servers, or the one at rollout.vllm_server_host:vllm_server_port."""
    if not r.vllm_servers:
        return [(r.vllm_server_host, r.vllm_server_port)]
    return [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in r.vllm_servers]


def connect_servers(r, options: dict, backend: str):
    """The run's RemoteEngine, or a ServerPool of one per rollout.vllm_servers entry."""
    engines = [RemoteEngine(host, port, r.vllm_server_timeout, options, backend) for host, port in server_addresses(r)]
    return engines[0] if len(engines) == 1 else ServerPool(engines)
