"""`vlmrl rollout-server MODEL --host H --port P`: a process that owns one vLLM engine and samples for a trainer run
with rollout.backend=vllm, rollout.vllm_mode=server (client.py), one trainer at a time.

The engine is built from MODEL with the first trainer's options (dtype, seed, image bounds, ...: the run's, sent at
connection) and kept across trainers: a killed and resumed run, or the next run with the same options, finds it
built; other options are refused in one line (restart the server). Each connection is a session with its own
weight group (wire.weight_group on this server's TCPStore at --group-port, gloo or NCCL as the trainer asks). A
trainer that dies, even in the middle of a push, ends its session only: the server waits for the next one.
Requests are JSON (wire.py); nothing received is unpickled; a bad request gets an error reply, never ends the server.
"""

from __future__ import annotations

import argparse
import sys
import threading
from multiprocessing.connection import Listener

import torch

from vlmrl.rollout.wire import RolloutServerError, authkey, broadcast_weights, decode_image, receive, send, weight_group

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RolloutServer:
    def __init__(self, folder: str, host: str, port: int, group_port: int, memory_share: float, timeout: float, log=print):
        self.folder, self.host, self.port, self.group_port = folder, host, port, group_port
        self.memory_share, self.timeout, self.log = memory_share, timeout, log
        self.engine = None
        self.sessions = 0
        self.store = None  # this server's TCPStore (created with the first session; every session prefixes its keys)
        self.listening = threading.Event()

    def serve(self, sessions: int | None = None) -> None:
        """Accept trainers one after another (forever, or `sessions` of them)."""
        with Listener((self.host, self.port), authkey=authkey()) as listener:
            self.listening.set()
            self.log(f"rollout server: listening at {self.host}:{self.port} (weights at port {self.group_port}), model {self.folder}")
            while sessions is None or self.sessions < sessions:
                try:
                    conn = listener.accept()
                except Exception as e:  # a failed handshake (wrong key) ends that connection only
                    self.log(f"rollout server: refused a connection ({type(e).__name__}: {e})")
                    continue
                self.sessions += 1
                with conn:
                    self.session(conn, self.sessions)

    def session(self, conn, number: int) -> None:
        """One trainer: requests until it closes or dies."""
        group = None
        while True:
            try:
                message = receive(conn)
            except (EOFError, OSError):
                self.log(f"rollout server: session {number} ended")
                return
            except ValueError as e:
                send(conn, {"error": f"not a JSON request: {e}"})
                continue
            try:
                op = message.get("op")
                if op == "init":
                    reply = self.init(message)
                    reply["session"] = number
                    send(conn, reply)
                    group = weight_group(self.host, self.group_port, number, 1, message.get("backend", "gloo"), self.timeout)[1]
                    continue
                if op == "push":
                    if group is None:
                        raise RolloutServerError("push before init")
                    reply = self.push(group, message)
                elif op in ("generate", "prompt_logprobs") and self.engine is None:
                    raise RolloutServerError(f"{op} before init")
                elif op == "generate":
                    reply = self.generate(message)
                elif op == "prompt_logprobs":
                    reply = {
                        "logprobs": self.engine.prompt_logprobs(list(message["ids"]), [decode_image(i) for i in message["images"]], int(message["n"]))
                    }
                else:
                    raise RolloutServerError(f"unknown op {op!r}")
            except (EOFError, ConnectionError) as e:
                self.log(f"rollout server: session {number} ended ({type(e).__name__})")
                return
            except Exception as e:  # a bad request, or the trainer gone mid-push (the group's error): reply, carry on
                reply = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                self.log(f"rollout server: session {number}: {reply['error']}")
            try:
                send(conn, reply)
            except OSError:
                self.log(f"rollout server: session {number} ended (the trainer is gone)")
                return

    def init(self, message: dict) -> dict:
        """Build the engine with the trainer's options, or check that the one built has them."""
        import torch.distributed as dist

        options = message["options"]
        if self.engine is None:
            from vlmrl.rollout.vllm_engine import LocalEngine

            self.log(f"rollout server: building the vLLM engine ({options['dtype']})")
            self.engine = LocalEngine(self.folder, options, self.memory_share)
        elif self.engine.options != options:
            differ = sorted(k for k in set(options) | set(self.engine.options) if options.get(k) != self.engine.options.get(k))
            raise RolloutServerError(f"this server's engine was built with other options ({', '.join(differ)}): restart the server for this run")
        if self.store is None:
            self.store = dist.TCPStore(self.host, self.group_port, None, is_master=True, wait_for_workers=False)
        return {"model": self.folder, "group_port": self.group_port}

    def push(self, group, message: dict) -> dict:
        layout = message["layout"]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        tensors = broadcast_weights(group, layout, None, device)
        seconds = self.engine.push([(name, t) for (name, _, _), t in zip(layout, tensors)])
        return {"seconds": seconds}

    def generate(self, message: dict) -> dict:
        requests = []
        for r in message["requests"]:
            images = [decode_image(i) for i in r["images"]]
            requests.append({"prompt": str(r["prompt"]), "multi_modal_data": {"image": images}} if images else {"prompt": str(r["prompt"])})
        return {"outputs": self.engine.generate(requests, list(message["params"]))}


def main(argv: list[str]) -> int:
    """`vlmrl rollout-server` (exit 2 with one line on a bad folder or a port in use)."""
    from vlmrl.models.loading import resolve_model_path

    parser = argparse.ArgumentParser(prog="vlmrl rollout-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the run's model folder (its config, tokenizer and processor; the trainer pushes the weights)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen at (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port of the requests (the trainer's rollout.vllm_server_port)")
    parser.add_argument("--group-port", type=int, default=None, help="port of the weight group's TCPStore (default: --port + 1)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="share of the device's memory vLLM reserves (on CPU: of the first NUMA node's host memory)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a weight broadcast may wait for the trainer")
    ns = parser.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if ns.host not in LOOPBACK and authkey() == b"vlmrl-rollout-server":
        log("rollout server: listening beyond loopback with the default key: set VLMRL_ROLLOUT_SERVER_KEY (the same for the trainer)")
    from pathlib import Path

    from vlmrl.rollout.backends import vllm_missing

    folder = resolve_model_path(ns.model)
    problem = vllm_missing() or (None if (Path(folder) / "config.json").is_file() else f"{folder} holds no config.json (a model folder)")
    if problem:  # refused at start, not when the first trainer connects
        print(f"vlmrl rollout-server: {problem}", file=sys.stderr)
        return 2
    try:
        RolloutServer(folder, ns.host, ns.port, ns.group_port or ns.port + 1, ns.gpu_memory_utilization, ns.timeout, log).serve()
    except OSError as e:
        print(f"vlmrl rollout-server: cannot listen at {ns.host}:{ns.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
