"""Sync and async clients for SGLang's ``/generate`` and ``/v1/chat/completions``, built on httpx.

Connection failures are retried by httpx's transport (``retries``: connect errors only, with
exponential backoff), never after the request reached the server, so a generation is not run twice.

Example (needs a running server)::

    from sglang_hspec.client import HSpecClient

    with HSpecClient("http://127.0.0.1:30000", require_speculative=True) as client:
        r = client.generate("The capital of France is", max_new_tokens=32)
        print(r.text, r.spec.tau, r.tokens_per_s)
        for chunk in client.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text_delta, end="", flush=True)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx
import msgspec

from .errors import (
    HSpecClientError,
    MalformedResponseError,
    NotSpeculativeError,
    RequestTimeoutError,
    ServerHTTPError,
    ServerUnavailableError,
)
from .types import (
    ChatChunk,
    ChatResult,
    ChatStreamAssembler,
    GenerateChunk,
    GenerateResult,
    GenerateStreamAssembler,
    decode_json,
    parse_chat,
    parse_generate,
)

Message = dict[str, str]


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``/server_info`` says about speculation (and the raw dict, for anything else)."""

    version: str | None
    model_path: str | None
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int | None
    raw: dict[str, Any]

    @property
    def is_speculative(self) -> bool:
        return bool(self.speculative_algorithm)


def _find_key(obj: Any, key: str) -> Any:
    # SGLang's resolved_dict() may nest argument groups; search depth-first, top level first.
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for value in obj.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def _parse_server_info(obj: Any) -> ServerInfo:
    if not isinstance(obj, dict):
        raise MalformedResponseError(f"/server_info: expected a JSON object, got {type(obj).__name__}")
    num_draft = _find_key(obj, "speculative_num_draft_tokens")
    return ServerInfo(
        version=obj.get("version"),
        model_path=_find_key(obj, "model_path"),
        speculative_algorithm=_find_key(obj, "speculative_algorithm"),
        speculative_num_draft_tokens=int(num_draft) if isinstance(num_draft, int | float) else None,
        raw=obj,
    )


def _error_message(body: str) -> str:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:500]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("detail"), str):  # FastAPI's own errors
            return obj["detail"]
    return body[:500]


class _Base:
    """Request building, response checks and error mapping shared by both clients."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connect_timeout: float,
        retries: int,
        require_speculative: bool,
        model: str,
        api_key: str | None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(
                f"timeouts must be positive, got timeout={timeout}, connect_timeout={connect_timeout}"
            )
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.require_speculative = require_speculative
        self.model = model
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    # -- request bodies ---------------------------------------------------------------------------

    @staticmethod
    def _generate_body(
        prompt: str | None,
        input_ids: Iterable[int] | None,
        max_new_tokens: int,
        temperature: float,
        ignore_eos: bool,
        sampling_params: dict[str, Any] | None,
        stream: bool,
    ) -> dict[str, Any]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt= or input_ids=")
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        params.update(sampling_params or {})
        body: dict[str, Any] = {"sampling_params": params, "stream": stream}
        if prompt is not None:
            body["text"] = prompt
        else:
            body["input_ids"] = list(input_ids)
        return body

    def _chat_body(
        self,
        messages: list[Message],
        max_tokens: int,
        temperature: float,
        model: str | None,
        extra_body: dict[str, Any] | None,
        stream: bool,
    ) -> dict[str, Any]:
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        body: dict[str, Any] = {
            "model": model or self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": stream,
            # SGLang extension: per-request speculative counters under `sglext`.
            "return_spec_tokens_details": True,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(extra_body or {})
        return body

    # -- checks and error mapping -----------------------------------------------------------------

    def _check_spec(self, result: GenerateResult | ChatResult) -> None:
        # A 1-token answer comes from prefill alone and has no verify step even on a speculative server.
        if self.require_speculative and result.spec is None and result.completion_tokens >= 2:
            raise NotSpeculativeError(
                f"{self.base_url}: request {result.request_id} generated {result.completion_tokens} tokens "
                "but the server reported no speculative stats (no spec_verify_ct). Launch it with "
                "--speculative-algorithm HSPEC (or DSPARK), or pass require_speculative=False."
            )

    def _raise_for_status(self, status: int, body: str, path: str) -> None:
        if status >= 400:
            raise ServerHTTPError(
                f"{self.base_url}{path}: HTTP {status}: {_error_message(body)}", status_code=status, body=body
            )

    @contextlib.contextmanager
    def _errors(self, path: str) -> Iterator[None]:
        url = f"{self.base_url}{path}"
        try:
            yield
        except HSpecClientError:
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnavailableError(
                f"{url}: cannot connect ({exc or type(exc).__name__}) after {self.retries} "
                "retries. Is the server running on that host and port? Start it with "
                "`python -m sglang.launch_server ... --port PORT` or fix the URL."
            ) from exc
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
            raise RequestTimeoutError(
                f"{url}: no data from the server for {self.timeout:g} s ({type(exc).__name__}). "
                "Raise timeout= for long generations, or check that the server is not stuck."
            ) from exc
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise ServerUnavailableError(
                f"{url}: the server dropped the connection mid-response ({exc or type(exc).__name__}). "
                "Check the server log for a crash."
            ) from exc

    def _sse_payloads(self, lines: Iterable[str]) -> Iterator[Any]:
        """Yield decoded ``data:`` payloads of an SSE stream; ``None`` marks ``[DONE]``."""
        for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, `event:` names, `:` comments
            data = line[5:].strip()
            if data == "[DONE]":
                yield None
                return
            yield decode_json(data, f"{self.base_url}: stream event")

    def _stream_error(self, obj: Any, path: str) -> None:
        if isinstance(obj, dict) and "error" in obj and "meta_info" not in obj and "choices" not in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            raise ServerHTTPError(
                f"{self.base_url}{path}: error inside the stream: {_error_message(msgspec.json.encode(obj))}",
                status_code=code if isinstance(code, int) else 400,
                body=msgspec.json.encode(obj).decode(),
            )


class HSpecClient(_Base):
    """Synchronous client.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:30000"``.
        timeout: seconds to wait for any data (whole body, or the next stream event).
        connect_timeout: seconds to wait for a TCP connection.
        retries: extra connection attempts after a refused or timed-out connect.
        require_speculative: raise :class:`NotSpeculativeError` when a multi-token answer carries no
            speculative stats (the server runs without ``--speculative-algorithm``).
        model: the ``model`` field of chat requests (SGLang accepts any name for its one model).
        api_key: sent as a bearer token (``--api-key`` on the server).
        transport: an httpx transport to use instead of the default (tests, proxies).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        require_speculative: bool = False,
        model: str = "default",
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            require_speculative=require_speculative,
            model=model,
            api_key=api_key,
        )
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=self._timeout,
            headers=self._headers,
            transport=transport or httpx.HTTPTransport(retries=retries),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HSpecClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post_json(self, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        with self._errors(path):
            resp = self._http.post(path, json=body)
            self._raise_for_status(resp.status_code, resp.text, path)
            return decode_json(resp.content, f"{self.base_url}{path}"), time.perf_counter() - start

    def _get_json(self, path: str) -> Any:
        with self._errors(path):
            resp = self._http.get(path)
            self._raise_for_status(resp.status_code, resp.text, path)
            return decode_json(resp.content, f"{self.base_url}{path}")

    @contextlib.contextmanager
    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[Iterator[Any]]:
        with self._errors(path), self._http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._raise_for_status(resp.status_code, resp.text, path)
            yield self._sse_payloads(resp.iter_lines())

    def health(self) -> bool:
        """True when ``/health`` answers 200; False when it answers anything else or nobody listens."""
        try:
            with self._errors("/health"):
                return self._http.get("/health").status_code == 200
        except (ServerUnavailableError, RequestTimeoutError):
            return False

    def server_info(self) -> ServerInfo:
        """The server's configuration from ``/server_info``."""
        return _parse_server_info(self._get_json("/server_info"))

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> GenerateResult:
        """One native ``/generate`` request (raw text, no chat template)."""
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, False
        )
        obj, elapsed = self._post_json("/generate", body)
        result = parse_generate(obj, client_latency_s=elapsed, what=f"{self.base_url}/generate")
        self._check_spec(result)
        return result

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> Iterator[GenerateChunk]:
        """Stream ``/generate``: yields deltas; the last chunk carries ``result``."""
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, True
        )
        assembler = GenerateStreamAssembler(f"{self.base_url}/generate stream")
        start = time.perf_counter()
        with self._stream("/generate", body) as payloads:
            for obj in payloads:
                if obj is None:
                    break
                self._stream_error(obj, "/generate")
                chunk = assembler.feed(obj, client_latency_s=time.perf_counter() - start)
                if chunk.result is not None:
                    self._check_spec(chunk.result)
                yield chunk
        if assembler.final is None:
            raise MalformedResponseError(f"{self.base_url}/generate: stream ended before the final event")

    def chat(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> ChatResult:
        """One OpenAI-compatible chat completion (the server applies the chat template)."""
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, False)
        obj, elapsed = self._post_json("/v1/chat/completions", body)
        result = parse_chat(obj, client_latency_s=elapsed, what=f"{self.base_url}/v1/chat/completions")
        self._check_spec(result)
        return result

    def chat_stream(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Iterator[ChatChunk]:
        """Stream a chat completion: yields content deltas; the last chunk carries ``result``."""
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, True)
        assembler = ChatStreamAssembler(f"{self.base_url}/v1/chat/completions stream")
        start = time.perf_counter()
        with self._stream("/v1/chat/completions", body) as payloads:
            for obj in payloads:
                if obj is None:
                    break
                self._stream_error(obj, "/v1/chat/completions")
                chunk = assembler.feed(obj)
                if chunk is not None:
                    yield chunk
        result = assembler.finish(client_latency_s=time.perf_counter() - start)
        self._check_spec(result)
        yield ChatChunk(text_delta="", result=result)


class AsyncHSpecClient(_Base):
    """Asyncio client with the same methods as :class:`HSpecClient` (``await`` / ``async for``).

    Example (needs a running server)::

        async with AsyncHSpecClient("http://127.0.0.1:30000") as client:
            results = await asyncio.gather(*(client.generate(p, max_new_tokens=64) for p in prompts))
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        require_speculative: bool = False,
        model: str = "default",
        api_key: str | None = None,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            require_speculative=require_speculative,
            model=model,
            api_key=api_key,
        )
        # A benchmark opens one connection per simulated user; httpx's default pool (100) would queue.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self._timeout,
            headers=self._headers,
            transport=transport or httpx.AsyncHTTPTransport(retries=retries, limits=limits),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncHSpecClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post_json(self, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        with self._errors(path):
            resp = await self._http.post(path, json=body)
            self._raise_for_status(resp.status_code, resp.text, path)
            return decode_json(resp.content, f"{self.base_url}{path}"), time.perf_counter() - start

    async def _get_json(self, path: str) -> Any:
        with self._errors(path):
            resp = await self._http.get(path)
            self._raise_for_status(resp.status_code, resp.text, path)
            return decode_json(resp.content, f"{self.base_url}{path}")

    async def _stream_payloads(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        with self._errors(path):
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._raise_for_status(resp.status_code, resp.text, path)
                async for line in resp.aiter_lines():
                    for obj in self._sse_payloads([line]):
                        if obj is None:
                            return  # [DONE]: end here so the response closes now, not at finalisation
                        yield obj

    async def health(self) -> bool:
        try:
            with self._errors("/health"):
                return (await self._http.get("/health")).status_code == 200
        except (ServerUnavailableError, RequestTimeoutError):
            return False

    async def server_info(self) -> ServerInfo:
        return _parse_server_info(await self._get_json("/server_info"))

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> GenerateResult:
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, False
        )
        obj, elapsed = await self._post_json("/generate", body)
        result = parse_generate(obj, client_latency_s=elapsed, what=f"{self.base_url}/generate")
        self._check_spec(result)
        return result

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, True
        )
        assembler = GenerateStreamAssembler(f"{self.base_url}/generate stream")
        start = time.perf_counter()
        async for obj in self._stream_payloads("/generate", body):
            if obj is None:
                break
            self._stream_error(obj, "/generate")
            chunk = assembler.feed(obj, client_latency_s=time.perf_counter() - start)
            if chunk.result is not None:
                self._check_spec(chunk.result)
            yield chunk
        if assembler.final is None:
            raise MalformedResponseError(f"{self.base_url}/generate: stream ended before the final event")

    async def chat(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> ChatResult:
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, False)
        obj, elapsed = await self._post_json("/v1/chat/completions", body)
        result = parse_chat(obj, client_latency_s=elapsed, what=f"{self.base_url}/v1/chat/completions")
        self._check_spec(result)
        return result

    async def chat_stream(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> AsyncIterator[ChatChunk]:
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, True)
        assembler = ChatStreamAssembler(f"{self.base_url}/v1/chat/completions stream")
        start = time.perf_counter()
        async for obj in self._stream_payloads("/v1/chat/completions", body):
            if obj is None:
                break
            self._stream_error(obj, "/v1/chat/completions")
            chunk = assembler.feed(obj)
            if chunk is not None:
                yield chunk
        result = assembler.finish(client_latency_s=time.perf_counter() - start)
        self._check_spec(result)
        yield ChatChunk(text_delta="", result=result)
