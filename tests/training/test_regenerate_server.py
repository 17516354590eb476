"""`hspec data regenerate --server`: the replies of a fake OpenAI-compatible server (stdlib http.server in a
thread, deterministic answers) land in the same shards, status files and splits as the engine path writes."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_hspec.assets.tiny import save_tiny_target, tiny_tokenizer
from sglang_hspec.training import server_regenerate
from sglang_hspec.training.data import read_jsonl
from sglang_hspec.training.data_cli import main as data_main

MODEL = "fake-target"


def reply_to(messages):
    """The fake's answer: the turn count, the last user turn upper-cased and the previous reply in <>, so a
    later turn shows which history it was sent."""
    last = messages[-1]["content"]
    before = f" <{messages[-2]['content']}>" if len(messages) > 1 and messages[-2]["role"] == "assistant" else ""
    return f"A{len(messages)}: {last.upper()}{before}"


class FakeChatServer:
    """/v1/models and /v1/chat/completions on a loopback port. A user turn containing FLAKY is answered 500
    twice, then normally; ALWAYS500 always 500; BAD400 400. `stop_after` requests, the server closes its port
    (a server killed mid-run)."""

    def __init__(self, *, model=MODEL, stop_after=None):
        self.model, self.stop_after = model, stop_after
        self.bodies, self.lock, self.seen = [], threading.Lock(), {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    count = len(fake.bodies)
                    last = body["messages"][-1]["content"]
                    fake.seen[last] = tries = fake.seen.get(last, 0) + 1
                if fake.stop_after is not None and count > fake.stop_after:
                    threading.Thread(target=fake.close).start()
                    self.close_connection = True  # no answer: the client sees the connection drop
                    return
                if "ALWAYS500" in last or ("FLAKY" in last and tries <= 2):
                    return self._send(500, {"object": "error", "message": "scripted overload", "code": 500})
                if "BAD400" in last:
                    return self._send(400, {"object": "error", "message": "scripted refusal", "code": 400})
                text = reply_to(body["messages"])
                self._send(200, {"id": f"c{count}", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: a closing server stops accepting before the client's retries run out
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.005}, daemon=True)
        self.thread.start()
        self.closed = False

    def close(self):
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(**kw):
        servers.append(FakeChatServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(server_regenerate, "RETRY_DELAY_S", 0.001)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer):
    """A local model directory: what --target (or the served model's name) points the tokenizer at."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "target", tokenizer=tokenizer)


def _conv(*turns):
    return [{"role": r, "content": t} for r, t in zip(["user", "assistant"] * len(turns), turns)]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [
    {"id": "two", "conversations": _conv("first q", "old", "second q", "old")},
    {"id": "sys", "conversations": [{"role": "system", "content": "be brief"}, *_conv("hello", "old")]},
    {"id": "flaky", "conversations": _conv("FLAKY please", "old")},
    {"id": "down", "conversations": _conv("ALWAYS500", "old")},
    {"id": "refused", "conversations": _conv("fine", "old", "now BAD400", "old")},
    {"id": "three", "conversations": _conv("a", "old", "b", "old", "c", "old")},
]


def _regen(src, out, url, *extra):
    return data_main(["regenerate", "--in", str(src), "--out", str(out), "--server", url, "--heldout", "0",
                      "--max-turns", "2", "--batch-size", "2", "--concurrency", "3", *extra])


def test_server_replies_rebuild_each_turn_and_failures_are_recorded(tmp_path, fake_server, target_dir, tokenizer,
                                                                    capsys):
    server = fake_server(model=str(target_dir))  # the served name is a local directory: it gives the tokenizer
    src = _write(tmp_path / "in.jsonl", RECORDS)
    assert _regen(src, tmp_path / "out", server.url + "/v1/", "--max-new-tokens", "64") == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["id"]: r["conversations"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")}
    assert rows == {
        # the second turn is sent the first regenerated reply, never the source's "old"
        "two": _conv("first q", "A1: FIRST Q", "second q", "A3: SECOND Q <A1: FIRST Q>"),
        "sys": [{"role": "system", "content": "be brief"}, *_conv("hello", "A2: HELLO")],
        "flaky": _conv("FLAKY please", "A1: FLAKY PLEASE"),  # 500, 500, then 200
        "three": _conv("a", "A1: A", "b", "A3: B <A1: A>"),  # --max-turns 2
    }
    assert server.seen["FLAKY please"] == 3 and server.seen["ALWAYS500"] == 4  # 1 try + 3 retries
    assert server.seen["now BAD400"] == 1  # a refusal is not retried
    statuses = {s["id"]: s for p in sorted((tmp_path / "out" / "shards").glob("*.status.jsonl"))
                for s in read_jsonl(p)}
    where = f"--server {server.url}/v1/chat/completions"
    assert statuses["down"] == {"id": "down", "status": "failed", "target_tokens": 0, "truncated": 0,
                                "reason": f"{where}: HTTP 500: scripted overload (after 4 tries)"}
    # its first turn was fine, but the conversation failed: recorded as failed, not cut short
    assert statuses["refused"] == {"id": "refused", "status": "failed", "target_tokens": 0, "truncated": 0,
                                   "reason": f"{where}: HTTP 400: scripted refusal"}
    tokens = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                 for c in rows.values() for m in c if m["role"] == "assistant")
    assert {k: stats[k] for k in ("input", "succeeded", "failed", "skipped", "target_tokens", "train_records")} == \
        {"input": 6, "succeeded": 4, "failed": 2, "skipped": 0, "target_tokens": tokens, "train_records": 4}
    # greedy by default, no sampling fields; the model name from /v1/models
    first = server.bodies[0]
    assert first == {"model": str(target_dir), "messages": first["messages"], "max_tokens": 64,
                     "temperature": 0.0, "stream": False}
    run = json.loads((tmp_path / "out" / "runs.jsonl").read_text())
    assert (run["settings"]["server"], run["settings"]["server_model"], run["settings"]["target"]) == \
        (server.url, str(target_dir), str(target_dir))
    assert run["device"] == f"server {server.url}" and run["dtype"] is None


def _files(out: Path) -> dict[str, str]:
    """Every file a run leaves that merge / pack / train read (the shards and the splits)."""
    names = [*sorted(p.relative_to(out).as_posix() for p in (out / "shards").glob("*.jsonl")),
             "train.jsonl", "heldout.jsonl"]
    return {n: (out / n).read_text() for n in names}


def test_a_server_killed_mid_run_resumes_to_the_uninterrupted_files(tmp_path, fake_server, target_dir, monkeypatch):
    monkeypatch.setattr(server_regenerate, "RETRY_DELAY_S", 0.05)  # the dead port is closed by the last try
    records = [{"id": f"r{i}", "conversations": _conv(f"q{i}" + " x" * (i % 3), "old", f"more {i}", "old")}
               for i in range(7)]
    src = _write(tmp_path / "in.jsonl", records)
    flags = ("--target", str(target_dir), "--temperature", "0.7", "--seed", "5")
    whole = fake_server()
    assert _regen(src, tmp_path / "whole", whole.url, *flags) == 0
    # 2 conversations x 2 turns per batch: the server dies after two batches, inside the third
    dying = fake_server(stop_after=8)
    with pytest.raises(server_regenerate.ServerUnreachableError, match="rerun the same command to resume"):
        _regen(src, tmp_path / "resumed", dying.url, *flags)
    assert len(list((tmp_path / "resumed" / "shards").glob("*.status.jsonl"))) == 2  # the third not committed
    again = fake_server()  # a restarted server (another port): the shards resume all the same
    assert _regen(src, tmp_path / "resumed", again.url, *flags) == 0
    assert len(again.bodies) == 14 - 8  # only the records not committed before
    assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")
    # sampled: each request carries its own seed, the same on every run
    def sent(bodies):
        return sorted((b["seed"], json.dumps(b["messages"])) for b in bodies)

    assert sent(dying.bodies[:8] + again.bodies) == sent(whole.bodies)
    assert len({b["seed"] for b in whole.bodies}) == 14 and {b["top_p"] for b in whole.bodies} == {0.95}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_url_names_server_and_writes_nothing(tmp_path):
    from sglang_hspec.cli import main as hspec_main

    src = _write(tmp_path / "in.jsonl", RECORDS[:1])
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionError) as err:
        _regen(src, tmp_path / "out", url)
    assert str(err.value).startswith(f"--server {url}: cannot connect (")
    assert str(err.value).endswith("is the server running? start it with `python -m sglang.launch_server "
                                   "--model-path <target> --port PORT` or fix the URL")
    assert hspec_main(["data", "regenerate", "--in", str(src), "--out", str(tmp_path / "out"), "--server", url]) == 2
    with pytest.raises(ValueError, match=r"^--server 'localhost:30000': write it as http://HOST:PORT"):
        _regen(src, tmp_path / "out", "localhost:30000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("flags, message", [
    (["--dtype", "bf16"], "--server generates on the server, so --dtype would do nothing here: drop it (set the "
                          "dtype, device and speculation on the server's launch command)"),
    (["--slots", "8", "--threads", "2", "--drafter", "ngram"],
     "--server generates on the server, so --drafter, --slots, --threads would do nothing here: drop them (set the "
     "dtype, device and speculation on the server's launch command)"),
    (["--device", "cpu", "--max-batch-tokens", "100"],
     "--server generates on the server, so --device, --max-batch-tokens would do nothing here: drop them (set the "
     "dtype, device and speculation on the server's launch command)"),
    (["--concurrency", "0"], "--concurrency must be an integer >= 1 (requests in flight), got 0"),
    (["--server-retries", "-1"], "--server-retries must be an integer >= 0 (extra tries of a failed request), got -1"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_engine_only_flags_are_refused_before_the_server_is_asked(tmp_path, fake_server, flags, message):
    server = fake_server()
    src = _write(tmp_path / "in.jsonl", RECORDS[:1])
    with pytest.raises(ValueError) as err:
        _regen(src, tmp_path / "out", server.url, *flags)
    assert str(err.value) == message
    assert server.bodies == [] and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_served_name_that_is_no_local_directory_asks_for_target(tmp_path, fake_server):
    server = fake_server(model="Qwen/Qwen3-8B")
    src = _write(tmp_path / "in.jsonl", RECORDS[:1])
    with pytest.raises(ValueError) as err:
        _regen(src, tmp_path / "out", server.url)
    assert str(err.value) == ("--server serves 'Qwen/Qwen3-8B', which is not a local model directory here: pass "
                              "--target DIR, the target's local Hugging Face directory (its tokenizer plans prompt "
                              "lengths and counts tokens)")
