"""A loopback HTTP server that replays SGLang 0.5.23's response shapes, and misbehaves on request.

Shapes follow the SGLang source: ``meta_info`` as ``TokenizerManager`` builds it (spec keys only on
the final event, from ``_calculate_spec_decoding_metrics``: accept_length = completion_tokens /
verify_ct, proposed = verify_ct * (num_draft_tokens - 1)); ``/generate`` SSE as ``http_server``
writes it (``data: {json}\\n\\n`` per scheduler step, cumulative unless incremental, then
``data: [DONE]``); chat completions and their chunks as ``protocol.py`` / ``sse_utils.py`` serialise
them (role chunk, content chunks, a finish_reason chunk, an sglext chunk, a usage chunk, [DONE]).

Generation is deterministic: the prompt fixes the token ids, and a fixed cycle of accepted lengths
per verify step fixes the speculative counters, so tests can compute every number by hand.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

EOS_ID = 2
NUM_DRAFT_TOKENS = 8  # speculative_num_draft_tokens = gamma + 1 with gamma = 7
ACCEPT_CYCLE = (3, 1, 4, 2)  # tokens committed per verify step (bonus included)
MODES = (
    "ok",
    "http500",
    "malformed",
    "stall",
    "stall_mid_stream",
    "drop_mid_stream",
    "no_final",
    "stream_error",
    "bad_gzip",  # every answer says Content-Encoding: gzip, but the body is plain
    "redirect",  # POSTs answer 307 to another address
    "http401",  # POSTs answer 401, as SGLang's --api-key check does
    "no_sse",  # stream requests get the non-streaming JSON body
)


def token_ids_for(prompt: str, n: int) -> list[int]:
    seed = sum(prompt.encode())
    return [10 + (seed + 7 * i) % 90 for i in range(n)]


def text_for(ids: list[int]) -> str:
    return "".join(f" w{t}" for t in ids)


def step_sizes(n: int) -> list[int]:
    """Tokens added per scheduler step: 1 from prefill, then the accept cycle (the last step clipped)."""
    if n <= 0:
        return []
    sizes, left, k = [1], n - 1, 0
    while left > 0:
        take = min(ACCEPT_CYCLE[k % len(ACCEPT_CYCLE)], left)
        sizes.append(take)
        left -= take
        k += 1
    return sizes


@dataclass
class Behaviour:
    mode: str = "ok"
    speculative: bool = True
    incremental: bool = False  # SGLang's --incremental-streaming-output
    cap_length: float | None = None  # report spec_cap_length (ragged verify) when set
    stall_s: float = 3.0
    delay_s: float = 0.0  # hold every POST this long, so concurrent requests overlap
    # Overrides merged into what the server reports, to make impossible counters on request:
    final_meta: dict[str, Any] = field(default_factory=dict)  # /generate's final meta_info
    spec_details: dict[str, Any] = field(default_factory=dict)  # chat sglext.spec_tokens_details
    usage: dict[str, Any] = field(default_factory=dict)  # chat usage
    server_info_body: bytes | None = None  # the raw /server_info body, when set
    in_flight: int = 0
    max_in_flight: int = 0
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def plan(prompt: str, max_new_tokens: int, ignore_eos: bool) -> tuple[list[int], dict[str, Any]]:
    """Output ids and the finish reason for a request."""
    natural = 4 + len(prompt) % 9  # where the fake model would emit EOS
    if ignore_eos or natural > max_new_tokens:
        return token_ids_for(prompt, max_new_tokens), {"type": "length", "length": max_new_tokens}
    return token_ids_for(prompt, natural), {"type": "stop", "matched": EOS_ID}


def spec_meta(n_tokens: int, behaviour: Behaviour) -> dict[str, Any]:
    sizes = step_sizes(n_tokens)
    verify_ct = len(sizes) - 1
    if not behaviour.speculative or verify_ct <= 0:
        return {}
    correct = sum(s - 1 for s in sizes[1:])
    proposed = verify_ct * (NUM_DRAFT_TOKENS - 1)
    hist = [0] * NUM_DRAFT_TOKENS
    for s in sizes[1:]:
        hist[s - 1] += 1
    meta = {
        "spec_accept_rate": correct / proposed,
        "spec_accept_length": n_tokens / verify_ct,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": verify_ct,
        "spec_correct_drafts_histogram": hist,
    }
    if behaviour.cap_length is not None:
        meta["spec_cap_length"] = behaviour.cap_length
    return meta


def meta_info(rid: str, prompt: str, ids_so_far: int, finish: dict | None, behaviour: Behaviour) -> dict:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt.split()) + 1,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": ids_so_far,
        "cached_tokens": 0,
    }
    if finish is not None:
        meta["e2e_latency"] = 0.05 * ids_so_far
        meta.update(spec_meta(ids_so_far, behaviour))
        meta.update(behaviour.final_meta)
    return meta


def chat_prompt(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}" for m in messages)


def spec_tokens_details(n_tokens: int, behaviour: Behaviour) -> dict[str, Any] | None:
    meta = spec_meta(n_tokens, behaviour)
    if not meta:
        return None
    return {  # pydantic SpecTokensDetails dumps every field
        "spec_accept_rate": meta["spec_accept_rate"],
        "spec_accept_length": meta["spec_accept_length"],
        "spec_cap_length": meta.get("spec_cap_length", 0.0),
        "spec_block_accept_length": 0.0,
        "spec_num_correct_drafts": meta["spec_num_correct_drafts"],
        "spec_num_proposed_drafts": meta["spec_num_proposed_drafts"],
        "spec_verify_ct": meta["spec_verify_ct"],
        "spec_correct_drafts_histogram": meta["spec_correct_drafts_histogram"],
        "spec_cap_lens_histogram": [],
        **behaviour.spec_details,
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeSGLangServer

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    # -- plumbing ---------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.server.behaviour.mode == "bad_gzip":
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        self.wfile.write(body)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        if self.server.behaviour.mode == "bad_gzip":
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj: Any) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _misbehave_before_answer(self) -> bool:
        b = self.server.behaviour
        if b.mode == "http500":
            self._send(500, json.dumps({"error": {"message": "CUDA error: device-side assert"}}).encode())
            return True
        if b.mode == "redirect":
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:1{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if b.mode == "http401":
            self._send(401, json.dumps({"error": "Unauthorized"}).encode())
            return True
        if b.mode == "malformed":
            self._send(200, b'{"text": "half a respo')
            return True
        if b.mode == "stall":
            self.server.release.wait(b.stall_s)
            return False
        return False

    # -- routes -----------------------------------------------------------------------------------

    def do_GET(self) -> None:
        b = self.server.behaviour
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/server_info" and b.server_info_body is not None:
            self._send(200, b.server_info_body)
        elif self.path == "/server_info":
            info = {
                "model_path": "tiny-qwen3",
                "speculative_algorithm": "HSPEC" if b.speculative else None,
                "speculative_num_draft_tokens": NUM_DRAFT_TOKENS if b.speculative else None,
                "version": "0.5.23",
                "internal_states": [{"avg_spec_accept_length": 2.5}] if b.speculative else [{}],
            }
            self._send(200, json.dumps(info).encode())
        else:
            self._send(404, json.dumps({"detail": "Not Found"}).encode())

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        b = self.server.behaviour
        # Count a request in flight only while it is held, before any byte of the answer is sent:
        # the client cannot have its answer (and send its next request) while it is still counted.
        with self.server.lock:
            b.requests.append((self.path, body))
            b.in_flight += 1
            b.max_in_flight = max(b.max_in_flight, b.in_flight)
        if b.delay_s:
            self.server.release.wait(b.delay_s)
        with self.server.lock:
            b.in_flight -= 1
        if self._misbehave_before_answer():
            return
        if self.path == "/generate":
            self._generate(body)
        elif self.path == "/v1/chat/completions":
            self._chat(body)
        else:
            self._send(404, json.dumps({"detail": "Not Found"}).encode())

    def _generate(self, body: dict[str, Any]) -> None:
        b = self.server.behaviour
        prompt = body["text"]
        params = body.get("sampling_params", {})
        ids, finish = plan(prompt, params.get("max_new_tokens", 128), params.get("ignore_eos", False))
        rid = f"gen-{self.server.next_id()}"
        if not body.get("stream") or b.mode == "no_sse":
            out = {
                "text": text_for(ids),
                "output_ids": ids,
                "meta_info": meta_info(rid, prompt, len(ids), finish, b),
            }
            self._send(200, json.dumps(out).encode())
            return
        self._start_stream()
        done = 0
        sizes = step_sizes(len(ids))
        for k, size in enumerate(sizes):
            last = k == len(sizes) - 1
            if b.mode == "stream_error" and k == 1:
                self._event({"error": {"message": "boom", "type": "invalid_request_error", "code": 400}})
                self._end_stream()
                return
            if b.mode == "no_final" and last:
                break
            new = ids[done : done + size]
            done += size
            shown = new if b.incremental else ids[:done]
            event = {
                "text": text_for(shown),
                "output_ids": shown,
                "meta_info": meta_info(rid, prompt, done, finish if last else None, b),
            }
            self._event(event)
            if k == 0 and b.mode in ("stall_mid_stream", "drop_mid_stream"):
                if b.mode == "drop_mid_stream":
                    self.close_connection = True
                    return  # no terminating chunk: the client sees a truncated body
                self.server.release.wait(b.stall_s)
        self._end_stream()

    def _chat(self, body: dict[str, Any]) -> None:
        b = self.server.behaviour
        prompt = chat_prompt(body["messages"])
        ids, finish = plan(prompt, body.get("max_tokens", 128), body.get("ignore_eos", False))
        rid = f"chatcmpl-{self.server.next_id()}"
        model = body.get("model", "default")
        created = 1_700_000_000
        details = spec_tokens_details(len(ids), b) if body.get("return_spec_tokens_details") else None
        usage = {
            "prompt_tokens": len(prompt.split()) + 1,
            "total_tokens": len(prompt.split()) + 1 + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
            **b.usage,
        }
        matched = finish.get("matched")
        if not body.get("stream") or b.mode == "no_sse":
            out: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text_for(ids), "reasoning_content": None},
                        "logprobs": None,
                        "finish_reason": finish["type"],
                        "matched_stop": matched,
                    }
                ],
                "usage": usage,
                "metadata": None,
            }
            if details is not None:
                out["sglext"] = {"spec_tokens_details": details}
            self._send(200, json.dumps(out).encode())
            return

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, matched_stop: Any = None) -> dict:
            return {  # msgspec StreamChunk: usage omitted when None; choice fields always present
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "matched_stop": matched_stop,
                    }
                ],
            }

        self._start_stream()
        self._event(chunk({"reasoning_content": None, "role": "assistant", "content": ""}))
        done = 0
        for size in step_sizes(len(ids)):
            self._event(chunk({"reasoning_content": None, "content": text_for(ids[done : done + size])}))
            done += size
        self._event(chunk({"reasoning_content": None}, finish["type"], matched))
        tail = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
        }
        if details is not None:
            self._event({**tail, "usage": None, "sglext": {"spec_tokens_details": details}})
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({**tail, "usage": usage})
        self._end_stream()


class FakeSGLangServer(ThreadingHTTPServer):
    """Serve on 127.0.0.1 in a daemon thread; use as a context manager. ``url`` is the base URL.

    With ``listen=False`` the port is bound but not listening (connections are refused) until
    :meth:`start_listening`, which lets a test exercise connection retries without a port race.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behaviour: Behaviour | None = None, *, listen: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.behaviour = behaviour or Behaviour()
        self.release = threading.Event()  # ends stalls early at shutdown
        self._ids = 0
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.server_bind()
        if listen:
            self.start_listening()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_id(self) -> int:
        with self.lock:
            self._ids += 1
            return self._ids

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up is what the timeout tests want, not a server fault.
        if isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            return
        super().handle_error(request, client_address)

    def start_listening(self) -> None:
        self.server_activate()
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def __enter__(self) -> FakeSGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()


def start_listening_later(server: FakeSGLangServer, delay_s: float) -> threading.Thread:
    def go() -> None:
        time.sleep(delay_s)
        server.start_listening()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread
