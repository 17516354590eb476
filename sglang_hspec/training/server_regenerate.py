"""`hspec data regenerate --server URL`: the target's replies from a running SGLang (or any OpenAI-compatible)
server instead of our engine, as SpecForge regenerates its data.

`ChatServer` stands in for the engine in `regenerate.regenerate`: the same shards, status files, resume,
merge and stats (so `hspec data merge / pack` and `hspec train` read the result unchanged); only one engine
call differs. A chat server applies the chat template itself, so a turn sends the rebuilt conversation
(the source's user turns and the regenerated replies so far) to /v1/chat/completions, `concurrency`
requests at a time. The local tokenizer (`--target`) still plans prompt lengths, counts target tokens and
finds repetition loops, on the reply text re-tokenized.

Failures: a 5xx, 408 or 429 answer, a dropped connection or a timeout is retried `retries` times with
backoff; a request that still fails, or that the server refuses (other 4xx, a malformed body), fails its
conversation, which is recorded as failed in the status file. A server that cannot be reached at all stops
the run (`ServerUnreachableError`) without committing the batch in flight: rerun the command to resume.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sglang_hspec.core.types import SamplingParams
from sglang_hspec.training.regenerate import AbortRun

REQUEST_TIMEOUT_S = 600.0  # one reply of max_new_tokens on a loaded server
CONNECT_TIMEOUT_S = 10.0
RETRY_DELAY_S = 1.0  # doubled after each failed try
TRANSIENT_STATUSES = (408, 429, 500, 502, 503, 504)
LAUNCH_HINT = "start it with `python -m sglang.launch_server --model-path <target> --port PORT` or fix the URL"


class ServerUnreachableError(AbortRun, ConnectionError):
    """The --server URL does not answer: nothing more can be generated this run."""


@dataclass
class ServerReply:
    """One reply, in the fields `regenerate._regenerate_batch` reads from an engine result; `error` is set
    (and the rest empty) when the request failed for good."""

    output_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None


def checked_server_url(url: str) -> str:
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        raise ValueError(f"--server {url!r}: write it as http://HOST:PORT, e.g. http://127.0.0.1:30000 (the server's "
                         "root, without /v1)")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ChatServer:
    """An OpenAI-compatible chat server as a regeneration engine (`takes_messages`: it is sent
    conversations, not token ids)."""

    takes_messages = True

    def __init__(self, url: str, *, tokenizer, model: str | None = None, concurrency: int = 16, retries: int = 3,
                 timeout_s: float = REQUEST_TIMEOUT_S):
        self.url = checked_server_url(url)
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.retries = retries
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                                  limits=limits)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate")
        self.model = model if model is not None else served_model(self.url, self._http)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate_messages(self, conversations: list[list[dict[str, str]]], sampling: SamplingParams,
                          seeds: list[int | None]) -> list[ServerReply]:
        """One reply per conversation, `concurrency` requests in flight; in input order."""
        bodies = [self._body(c, sampling, seed) for c, seed in zip(conversations, seeds)]
        replies = list(self._pool.map(self._reply, bodies))
        for r in replies:  # here, not in the threads: a fast tokenizer is not safe to call from several at once
            if r.text:
                r.output_ids = list(self.tokenizer(r.text, add_special_tokens=False)["input_ids"])
        return replies

    def _body(self, messages, sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": sampling.max_new_tokens,
                                "temperature": 0.0 if sampling.greedy else sampling.temperature, "stream": False}
        if not sampling.greedy:
            body["top_p"] = sampling.top_p
            if sampling.top_k > 0:
                body["top_k"] = sampling.top_k  # an SGLang (and vLLM) extension; 0 means off here
            if seed is not None:
                body["seed"] = seed
        return body

    def _reply(self, body: dict[str, Any]) -> ServerReply:
        where = f"--server {self.url}/v1/chat/completions"
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_DELAY_S * 2 ** (attempt - 1))
            try:
                resp = self._http.post("/v1/chat/completions", json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                problem = f"cannot connect ({e or type(e).__name__})"
                continue
            except httpx.TransportError as e:  # read timeout, dropped connection: the server may be overloaded
                problem = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code in TRANSIENT_STATUSES:
                problem = f"HTTP {resp.status_code}: {_error_text(resp.text)}"
                continue
            if resp.status_code != 200:  # refused: resending the same request cannot help
                return _failed(f"{where}: HTTP {resp.status_code}: {_error_text(resp.text)}")
            try:
                choice = resp.json()["choices"][0]
                text = (choice["message"].get("content") or "").strip()
                finish_reason = str(choice.get("finish_reason") or "stop")
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                return _failed(f"{where}: not a chat completion: {resp.text[:200]!r}")
            return ServerReply(output_ids=[], text=text, finish_reason=finish_reason)  # ids: generate_messages
        if problem.startswith("cannot connect"):
            raise ServerUnreachableError(f"{where}: {problem} after {self.retries + 1} tries; is the server still "
                                         f"running? {LAUNCH_HINT}. The committed shards are kept: rerun the same "
                                         "command to resume")
        return _failed(f"{where}: {problem} (after {self.retries + 1} tries)")


def _failed(message: str) -> ServerReply:
    return ServerReply(output_ids=[], text="", finish_reason="error", error=message)


def _error_text(body: str) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:200]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return (err if isinstance(err, str) else body)[:200]


def served_model(url: str, http: httpx.Client | None = None) -> str:
    """The first model GET /v1/models reports (SGLang serves one: its --served-model-name, by default the
    --model-path); the URL's problem, naming --server, when there is none."""
    where = f"--server {url}"
    client = http or httpx.Client(base_url=url, timeout=CONNECT_TIMEOUT_S)
    try:
        resp = client.get("/v1/models")
    except httpx.TransportError as e:
        raise ServerUnreachableError(f"{where}: cannot connect ({e or type(e).__name__}); is the server "
                                     f"running? {LAUNCH_HINT}") from None
    finally:
        if http is None:
            client.close()
    if resp.status_code != 200:
        raise ValueError(f"{where}: GET /v1/models answered HTTP {resp.status_code} ({_error_text(resp.text)}); "
                         "point --server at an OpenAI-compatible server's root, or name the model with --server-model")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{where}: GET /v1/models lists no model ({resp.text[:200]!r}); name it with "
                         "--server-model") from None


# flags of the engine path only: with --server they would silently do nothing
ENGINE_ONLY_FLAGS = (("--dtype", "dtype"), ("--device", "device"), ("--drafter", "drafter"), ("--slots", "slots"),
                     ("--threads", "threads"), ("--max-batch-tokens", "max_batch_tokens"))


def refuse_engine_flags(args) -> None:
    given = [flag for flag, attr in ENGINE_ONLY_FLAGS if getattr(args, attr) is not None]
    if given:
        raise ValueError(f"--server generates on the server, so {', '.join(given)} would do nothing here: drop "
                         f"{'it' if len(given) == 1 else 'them'} (set the dtype, device and speculation on the "
                         "server's launch command)")


def tokenizer_source(target: str | None, model: str) -> str:
    """--target when given, else the served model if it is a local model directory here."""
    if target is not None:
        return target
    if (Path(model) / "config.json").is_file():
        return model
    raise ValueError(f"--server serves {model!r}, which is not a local model directory here: pass --target DIR, the "
                     "target's local Hugging Face directory (its tokenizer plans prompt lengths and counts tokens)")


def run_server_cli(args) -> int:
    import msgspec

    from sglang_hspec.target.loading import load_tokenizer
    from sglang_hspec.training.config import make_output_dir
    from sglang_hspec.training.data import evaluation_prompt_texts
    from sglang_hspec.training.regenerate import check_regenerate_flags, record_run, regenerate

    refuse_engine_flags(args)
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be an integer >= 1 (requests in flight), got {args.concurrency}")
    if args.server_retries < 0:
        raise ValueError(f"--server-retries must be an integer >= 0 (extra tries of a failed request), got "
                         f"{args.server_retries}")
    args.temperature = 0.0 if args.temperature is None else args.temperature  # greedy unless asked
    check_regenerate_flags(args)
    exclude_texts = evaluation_prompt_texts(args.eval_texts)
    url = checked_server_url(args.server)
    model = args.server_model if args.server_model is not None else served_model(url)
    args.target = tokenizer_source(args.target, model)
    tokenizer = load_tokenizer(args.target)
    make_output_dir(args.out, name="--out")
    with ChatServer(url, tokenizer=tokenizer, model=model, concurrency=args.concurrency,
                    retries=args.server_retries) as server:
        args.server, args.server_model = url, model
        record_run(args.out, settings={k: v for k, v in vars(args).items() if k != "func"}, dtype=None,
                   device=f"server {url}")
        stats = regenerate(
            engine=server, tokenizer=tokenizer, in_paths=args.in_paths, out_dir=args.out, batch_size=args.batch_size,
            max_batch_tokens=None, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_turns=args.max_turns,
            max_prompt_tokens=args.max_prompt_tokens, heldout_fraction=args.heldout, exclude_texts=exclude_texts,
            limit=args.limit, max_batches=args.max_batches, loops=args.loops)
    print(json.dumps({**msgspec.structs.asdict(stats),
                      "this_run_tokens_per_second": round(stats.this_run_tokens_per_second, 1)}))
    return 0
