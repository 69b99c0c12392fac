"""rollout.vllm_mode=server without vLLM: the trainer's client (rollout/client.py) against the real server loop
(rollout/server.py) holding a stand-in engine, in threads of this process: weights over a real gloo group, images
and requests over the authenticated JSON connection; and every way a server can be missing, dead, silent or hostile.
The server with the real vLLM engine, trained through and resumed: tests/test_vllm_server.py (vLLM venv)."""

import json
import pickle
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

import pytest
import torch
from PIL import Image

from vlmrl.config import ConfigError, load_config
from vlmrl.rollout.backends import describe_backend
from vlmrl.rollout.client import RemoteEngine, connect
from vlmrl.rollout.server import RolloutServer
from vlmrl.rollout.wire import RolloutServerError, authkey, decode_image, encode_image

pytestmark = pytest.mark.unit

OPTIONS = {"dtype": "float32", "seed": 0, "allowed_token_ids": [0, 1, 2]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInEngine:
    """What LocalEngine answers, from what it was sent (no model)."""

    def __init__(self):
        self.options, self.pushed, self.requests = dict(OPTIONS), [], []

    def push(self, weights):
        self.pushed.append([(name, t.clone()) for name, t in weights])
        return 0.01

    def prompt_logprobs(self, ids, images, n):
        return [-float(i) for i in ids[-n:]]

    def generate(self, requests, params):
        self.requests.append((requests, params))
        return [
            {"prompt_token_ids": [len(r["prompt"])], "samples": [{"token_ids": [p["seed"]], "logprobs": [-0.5]}] * p["n"]}
            for r, p in zip(requests, params)
        ]


@pytest.fixture
def served():
    """(server, port) serving one session in a thread."""
    port = free_port()
    server = RolloutServer("/models/tiny", "127.0.0.1", port, free_port(), 0.3, 30.0, log=lambda *_: None)
    server.engine = StandInEngine()
    thread = threading.Thread(target=server.serve, kwargs={"sessions": 1}, daemon=True)
    thread.start()
    assert server.listening.wait(60)
    yield server, port
    thread.join(timeout=30)


def test_weights_requests_and_images_make_the_round_trip(served):
    server, port = served
    client = RemoteEngine("127.0.0.1", port, 30.0, OPTIONS, "gloo")
    assert client.folder == "/models/tiny"
    weights = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5).bfloat16()), ("c", torch.arange(6).view(2, 3)), ("d", torch.randn(2))]
    assert client.push(weights) > 0
    got = server.engine.pushed[-1]
    assert [n for n, _ in got] == [n for n, _ in weights]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, weights))
    image = Image.new("RGB", (5, 3), (10, 20, 30))
    image.putpixel((4, 2), (1, 2, 3))
    outs = client.generate(
        [{"prompt": "hi <img>", "multi_modal_data": {"image": [image]}}, {"prompt": "x"}], [{"n": 2, "seed": 7}, {"n": 1, "seed": 8}]
    )
    assert outs[0] == {"prompt_token_ids": [8], "samples": [{"token_ids": [7], "logprobs": [-0.5]}] * 2} and outs[1]["samples"][0]["token_ids"] == [8]
    sent = server.engine.requests[-1][0][0]["multi_modal_data"]["image"][0]
    assert sent.size == (5, 3) and sent.tobytes() == image.tobytes()  # lossless: the trainer's pixels
    assert client.prompt_logprobs([4, 5, 6], [], 2) == [-5.0, -6.0]
    client.close()


def test_a_second_run_with_other_options_is_refused_in_one_line(served):
    _, port = served
    with pytest.raises(RolloutServerError, match=r"refused init: .*built with other options \(dtype\): restart the server"):
        RemoteEngine("127.0.0.1", port, 30.0, {**OPTIONS, "dtype": "bfloat16"}, "gloo")


def test_hostile_requests_get_an_error_and_the_server_stays(served):
    """Pickled bytes are refused as not JSON (never unpickled); unknown ops and bad fields are answered with errors;
    the same session then still works."""
    server, port = served
    conn = Client(("127.0.0.1", port), authkey=authkey())

    class Boom:
        def __reduce__(self):
            return (exec, ("import os; os._exit(7)",))

    conn.send_bytes(pickle.dumps(Boom()))
    assert "not a JSON request" in json.loads(conn.recv_bytes())["error"]
    conn.send_bytes(b"[1, 2]")
    assert "expected a JSON object" in json.loads(conn.recv_bytes())["error"]
    for message, error in [({"op": "rm -rf"}, "unknown op"), ({"op": "push", "layout": []}, "push before init"), ({"op": "generate"}, "KeyError")]:
        conn.send_bytes(json.dumps(message).encode())
        assert error in json.loads(conn.recv_bytes())["error"]
    conn.send_bytes(json.dumps({"op": "prompt_logprobs", "ids": [1, 2], "images": [], "n": 1}).encode())
    assert json.loads(conn.recv_bytes()) == {"logprobs": [-2.0]}
    conn.close()


def test_nothing_listening_is_one_line_naming_the_address():
    port = free_port()
    with pytest.raises(RolloutServerError, match=rf"no rollout server answers at 127.0.0.1:{port} after 1 s .*vlmrl rollout-server"):
        connect("127.0.0.1", port, 1.0)


def _fake_server(port: int, behaviour: str):
    """A listener that completes the handshake, reads one request, then closes (`dies`) or says nothing (`silent`)."""
    listener = Listener(("127.0.0.1", port), authkey=authkey())

    def run():
        conn = listener.accept()
        conn.recv_bytes()
        if behaviour == "dies":
            conn.close()
        else:
            stop.wait(30)
        listener.close()

    stop = threading.Event()
    threading.Thread(target=run, daemon=True).start()
    return stop


@pytest.mark.parametrize("behaviour, message", [("dies", "is gone (EOFError during init)"), ("silent", "sent no reply to init within 2 s")])
def test_a_dead_or_silent_server_is_one_line_not_a_hang(behaviour, message):
    port = free_port()
    stop = _fake_server(port, behaviour)
    try:
        with pytest.raises(RolloutServerError, match=rf"the rollout server at 127.0.0.1:{port} " + message.replace("(", r"\(").replace(")", r"\)")):
            engine = RemoteEngine.__new__(RemoteEngine)
            engine.address, engine.timeout = f"127.0.0.1:{port}", 2.0
            engine.conn = connect("127.0.0.1", port, 2.0)
            engine.call({"op": "init"}, wait=2.0)
    finally:
        stop.set()


def test_a_wrong_key_is_refused_in_one_line(monkeypatch):
    port = free_port()
    monkeypatch.setenv("VLMRL_ROLLOUT_SERVER_KEY", "server-secret")
    listener = Listener(("127.0.0.1", port), authkey=authkey())
    threading.Thread(target=lambda: pytest.raises(AuthenticationError, listener.accept), daemon=True).start()
    monkeypatch.setenv("VLMRL_ROLLOUT_SERVER_KEY", "another")
    try:
        with pytest.raises(RolloutServerError, match=rf"127.0.0.1:{port} refused the handshake .*VLMRL_ROLLOUT_SERVER_KEY"):
            connect("127.0.0.1", port, 5.0)
    finally:
        listener.close()


def test_image_encoding_is_lossless():
    image = Image.new("RGB", (7, 2))
    image.putdata([(i, 255 - i, i * 3 % 256) for i in range(14)])
    back = decode_image(encode_image(image))
    assert back.mode == "RGB" and back.tobytes() == image.tobytes()


def test_check_names_the_server_and_whether_it_answers():
    port = free_port()
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.vllm_mode=server", f"rollout.vllm_server_port={port}"])
    line = describe_backend(cfg)
    assert f"vLLM in the rollout server (rollout.backend=vllm, vllm_mode=server; 127.0.0.1:{port}: nothing answers there now" in line
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert "a server answers there" in describe_backend(cfg)
    two = load_config(None, ["rollout.backend=vllm", "rollout.vllm_mode=server", f"rollout.vllm_servers=['127.0.0.1:{port}', 'localhost:{port}']"])
    assert "vLLM in 2 rollout servers in data parallel (rollout.backend=vllm, vllm_mode=server; 127.0.0.1:" in describe_backend(two)


def test_train_with_no_server_exits_2_in_one_line(tmp_path, capsys):
    """The whole command (the trainer needs no vLLM of its own in server mode): exit 2, the last line names host:port."""
    from vlmrl.cli import main
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    folder = build_tiny_qwen25vl(tmp_path / "model")
    port = free_port()
    args = [f"model.name_or_path={folder}", f"training.output_dir={tmp_path / 'run'}", "data.task=count", "data.task_train_size=8"]
    args += ["data.task_test_size=2", "rollout.backend=vllm", "rollout.vllm_mode=server", f"rollout.vllm_server_port={port}"]
    args += ["rollout.vllm_server_timeout=1", "training.max_steps=1", "logging.progress_bar=false"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"vlmrl train: no rollout server answers at 127.0.0.1:{port} after 1 s"), err[-1]


def test_several_servers_in_data_parallel_split_the_prompts_in_order():
    """rollout.vllm_servers: every server gets the weights; 5 prompts go 2 + 3 to the two servers, in order, and come
    back in the trainer's order."""
    from vlmrl.rollout.client import ServerPool, connect_servers

    servers = []
    for _ in range(2):
        server = RolloutServer("/models/tiny", "127.0.0.1", free_port(), free_port(), 0.3, 30.0, log=lambda *_: None)
        server.engine = StandInEngine()
        threading.Thread(target=server.serve, kwargs={"sessions": 1}, daemon=True).start()
        assert server.listening.wait(60)
        servers.append(server)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.vllm_mode=server", f"rollout.vllm_servers={json.dumps(addresses)}"])
    pool = connect_servers(cfg.rollout, OPTIONS, "gloo")
    assert isinstance(pool, ServerPool) and pool.address == ", ".join(addresses)
    weights = [("w", torch.randn(4, 4)), ("b", torch.randn(4))]
    pool.push(weights)
    assert all(torch.equal(s.engine.pushed[-1][0][1], weights[0][1]) for s in servers)
    requests = [{"prompt": "p" * (i + 1)} for i in range(5)]
    outs = pool.generate(requests, [{"n": 1, "seed": 100 + i} for i in range(5)])
    assert [o["prompt_token_ids"][0] for o in outs] == [1, 2, 3, 4, 5]  # the trainer's order
    assert [o["samples"][0]["token_ids"][0] for o in outs] == [100, 101, 102, 103, 104]  # each prompt's own seed
    assert [[r["prompt"] for r in s.engine.requests[-1][0]] for s in servers] == [["p", "pp"], ["ppp", "pppp", "ppppp"]]
    pool.close()


def test_a_malformed_server_list_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"rollout.vllm_servers=\['10.0.0.2'\]: each entry is host:port"):
        load_config(None, ["rollout.vllm_servers=['10.0.0.2']"])


def test_the_server_refuses_a_folder_without_a_model_at_start(tmp_path, capsys):
    """Refused in one line before it listens (not when the first trainer connects): exit 2."""
    from vlmrl.cli import main

    assert main(["rollout-server", str(tmp_path / "nothing"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vlmrl rollout-server: ")
    assert "holds no config.json" in err or "vllm package is not installed" in err
