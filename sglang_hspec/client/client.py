"""Sync and async clients for SGLang's ``/generate`` and ``/v1/chat/completions``, built on httpx.

One implementation: :class:`_ClientCore` holds every public method, and each method builds its
request and the way its answer is read (an :class:`_Exchange` or a :class:`_StreamExchange`) in one
place. :class:`HSpecClient` and :class:`AsyncHSpecClient` differ only in transport: how an exchange
is sent (``httpx.Client`` or ``httpx.AsyncClient``), so a sync call returns the value and an async
call returns an awaitable (or an async iterator) of the same value.

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
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

import httpx
import msgspec

from .errors import (
    HSpecClientError,
    InvalidArgumentError,
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
    ServerInfo,
    decode_json,
    parse_chat,
    parse_generate,
    parse_server_info,
)

__all__ = ["AsyncHSpecClient", "HSpecClient", "ServerInfo"]

Message = dict[str, str]
T = TypeVar("T")
C = TypeVar("C")
R = TypeVar("R", bound="GenerateResult | ChatResult")

# What a public method returns: the value from HSpecClient, an awaitable of it from AsyncHSpecClient.
Answer = T | Awaitable[T]
# What a streaming method returns: an iterator from HSpecClient, an async iterator from AsyncHSpecClient.
Chunks = Iterator[C] | AsyncIterator[C]

_RAISE = object()  # an exchange without a fallback value: failures raise


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


def _status_fix(status: int) -> str:
    if status in (401, 403):
        return "Pass api_key= with the key the server was launched with (--api-key)."
    if status == 404:
        return "Check that base_url is the root of an SGLang 0.5.x server, e.g. http://127.0.0.1:30000."
    if status >= 500:
        return "The server failed: check its log."
    return "The server refused the request: fix what its message names."


def checked_base_url(base_url: Any) -> str:
    """``base_url`` without a trailing slash, or :class:`InvalidArgumentError` saying what is wrong."""
    example = "write it as http://HOST:PORT, e.g. http://127.0.0.1:30000"
    if not isinstance(base_url, str):
        raise InvalidArgumentError(f"base_url must be a string, got {base_url!r}: {example}")
    if not base_url.startswith(("http://", "https://")):
        raise InvalidArgumentError(
            f"base_url must start with http:// or https://, got {base_url!r}: {example}"
        )
    if any(ch.isspace() for ch in base_url):
        raise InvalidArgumentError(f"base_url {base_url!r} contains whitespace: {example}")
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise InvalidArgumentError(f"base_url {base_url!r} is not a valid URL ({exc}): {example}") from None
    if not url.host:
        raise InvalidArgumentError(f"base_url {base_url!r} has no host: {example}")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise InvalidArgumentError(
            f"base_url {base_url!r}: port {url.port} is outside 1-65535. Use the port the server "
            "listens on (launch_server --port; 30000 by default), e.g. http://127.0.0.1:30000."
        )
    if url.query or url.fragment:
        raise InvalidArgumentError(
            f"base_url {base_url!r} has a ?query or #fragment, which would end up in every request: {example}"
        )
    return base_url.rstrip("/")


class _Exchange(Generic[T]):
    """One request and how its answer becomes a result. A transport only sends it, inside
    :meth:`sending`, and stores the read response in ``response``; timing, error mapping and
    parsing happen here, the same for both clients."""

    def __init__(
        self,
        client: _ClientCore,
        method: str,
        path: str,
        *,
        read: Callable[[httpx.Response, float], T],
        body: dict[str, Any] | None = None,
        on_failure: Any = _RAISE,
    ) -> None:
        self.client, self.method, self.path, self.body = client, method, path, body
        self._read, self._on_failure = read, on_failure
        self.response: httpx.Response | None = None
        self.result: T

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self.client._errors(self.path):
                yield
            assert self.response is not None, "the transport must store the response it read"
            self.result = self._read(self.response, time.perf_counter() - start)
        except (ServerUnavailableError, RequestTimeoutError, MalformedResponseError):
            if self._on_failure is _RAISE:
                raise
            self.result = self._on_failure


class _StreamExchange(Generic[C]):
    """One streamed (SSE) request. A transport opens it inside :meth:`sending`, passes the response
    to :meth:`check` (with the body read when the status is not 2xx), then feeds it line by line
    until ``done`` and yields what :meth:`feed` and, after the response closed, :meth:`end` return."""

    def __init__(
        self,
        client: _ClientCore,
        path: str,
        body: dict[str, Any],
        *,
        on_event: Callable[[Any, float], C | None],
        on_end: Callable[[float], C | None],
    ) -> None:
        self.client, self.path, self.body = client, path, body
        self.url = f"{client.base_url}{path}"
        self._on_event, self._on_end = on_event, on_end
        self._start = 0.0
        self._content_type = ""
        self._events = 0
        self.done = False  # [DONE] was read: the transport stops reading, so the response closes now

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        self._start = time.perf_counter()
        with self.client._errors(self.path):
            yield

    def check(self, response: httpx.Response) -> None:
        self.client._raise_for_status(response, self.path)
        self._content_type = response.headers.get("content-type", "")

    def feed(self, line: str) -> list[C]:
        if not line.startswith("data:"):
            return []  # blank separators, `event:` names, `:` comments
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return []
        self._events += 1
        obj = decode_json(data, f"{self.url}: stream event")
        self.client._raise_stream_error(obj, self.path)
        chunk = self._on_event(obj, time.perf_counter() - self._start)
        return [] if chunk is None else [chunk]

    def end(self) -> list[C]:
        if self._events == 0:
            raise MalformedResponseError(
                f"{self.url}: the stream carried no SSE `data:` events (Content-Type "
                f"{self._content_type!r}; SGLang sends text/event-stream). Check that the URL points "
                "at an SGLang server (0.5.x)."
            )
        chunk = self._on_end(time.perf_counter() - self._start)
        return [] if chunk is None else [chunk]


class _ClientCore:
    """Every public method, written once: builds the request, reads the answer. Subclasses supply the
    transport: the httpx classes, ``_send`` (one exchange) and ``_stream`` (one SSE exchange)."""

    _http_class: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]
    _transport_class: ClassVar[type[httpx.HTTPTransport] | type[httpx.AsyncHTTPTransport]]
    _transport_base: ClassVar[type[httpx.BaseTransport] | type[httpx.AsyncBaseTransport]]

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
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """
        Args:
            base_url: the server, e.g. ``"http://127.0.0.1:30000"``.
            timeout: seconds to wait for any data (whole body, or the next stream event).
            connect_timeout: seconds to wait for a TCP connection.
            retries: extra connection attempts after a refused or timed-out connect.
            require_speculative: raise :class:`NotSpeculativeError` when a multi-token answer carries
                no speculative stats (the server runs without ``--speculative-algorithm``).
            model: the ``model`` field of chat requests (SGLang accepts any name for its one model).
            api_key: sent as a bearer token (``--api-key`` on the server).
            max_connections: connections open at once (a benchmark opens one per simulated user;
                httpx's default pool of 100 would queue the rest).
            transport: an httpx transport to use instead of the default (tests, proxies): an
                ``httpx.BaseTransport`` for :class:`HSpecClient`, an ``httpx.AsyncBaseTransport``
                for :class:`AsyncHSpecClient`.

        Raises:
            InvalidArgumentError: (a ``ValueError``) for any invalid argument, before any request.
        """
        self.base_url = checked_base_url(base_url)
        where = f"{type(self).__name__}({self.base_url!r})"
        for name, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, int | float)
                or not (math.isfinite(seconds) and seconds > 0)
            ):
                raise InvalidArgumentError(
                    f"{where}: {name}={seconds!r} must be a finite number of seconds > 0"
                )
        for name, count, least in (("retries", retries, 0), ("max_connections", max_connections, 1)):
            if isinstance(count, bool) or not isinstance(count, int) or count < least:
                raise InvalidArgumentError(f"{where}: {name}={count!r} must be a whole number >= {least}")
        if not isinstance(model, str) or not model:
            raise InvalidArgumentError(f"{where}: model={model!r} must be a non-empty string")
        if api_key is not None and not (
            isinstance(api_key, str) and api_key.isprintable() and api_key.isascii()
        ):
            raise InvalidArgumentError(f"{where}: api_key must be a string of printable ASCII characters")
        if transport is not None and not isinstance(transport, self._transport_base):
            raise InvalidArgumentError(
                f"{where}: transport must be an {self._transport_base.__module__}."
                f"{self._transport_base.__name__}, got {type(transport).__name__}"
            )
        self.timeout = timeout
        self.retries = retries
        self.require_speculative = require_speculative
        self.model = model
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = self._http_class(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            transport=transport or self._transport_class(retries=retries, limits=limits),
        )

    # -- transport (the only part the two clients write differently) ------------------------------

    def _send(self, exchange: _Exchange[T]) -> Answer[T]:
        raise NotImplementedError

    def _stream(self, exchange: _StreamExchange[C]) -> Chunks[C]:
        raise NotImplementedError

    # -- public methods -----------------------------------------------------------------------------

    def health(self) -> Answer[bool]:
        """True when ``/health`` answers 200; False when it answers anything else or nobody listens."""
        return self._send(
            _Exchange(self, "GET", "/health", read=lambda resp, _: resp.status_code == 200, on_failure=False)
        )

    def server_info(self) -> Answer[ServerInfo]:
        """The server's configuration from ``/server_info``."""
        url = f"{self.base_url}/server_info"
        return self._send(
            self._json_exchange("GET", "/server_info", lambda obj, _: parse_server_info(obj, what=url))
        )

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> Answer[GenerateResult]:
        """One native ``/generate`` request (raw text, no chat template)."""
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, False
        )
        url = f"{self.base_url}/generate"

        def parse(obj: Any, elapsed: float) -> GenerateResult:
            return self._checked(parse_generate(obj, client_latency_s=elapsed, what=url))

        return self._send(self._json_exchange("POST", "/generate", parse, body))

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Iterable[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        sampling_params: dict[str, Any] | None = None,
    ) -> Chunks[GenerateChunk]:
        """Stream ``/generate``: yields deltas; the last chunk carries ``result``."""
        body = self._generate_body(
            prompt, input_ids, max_new_tokens, temperature, ignore_eos, sampling_params, True
        )
        assembler = GenerateStreamAssembler(f"{self.base_url}/generate stream")

        def on_event(obj: Any, elapsed: float) -> GenerateChunk:
            chunk = assembler.feed(obj, client_latency_s=elapsed)
            if chunk.result is not None:
                self._checked(chunk.result)
            return chunk

        def on_end(_: float) -> None:
            if assembler.final is None:
                raise MalformedResponseError(f"{self.base_url}/generate: stream ended before the final event")

        return self._stream(_StreamExchange(self, "/generate", body, on_event=on_event, on_end=on_end))

    def chat(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Answer[ChatResult]:
        """One OpenAI-compatible chat completion (the server applies the chat template)."""
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, False)
        url = f"{self.base_url}/v1/chat/completions"

        def parse(obj: Any, elapsed: float) -> ChatResult:
            return self._checked(parse_chat(obj, client_latency_s=elapsed, what=url))

        return self._send(self._json_exchange("POST", "/v1/chat/completions", parse, body))

    def chat_stream(
        self,
        messages: list[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        model: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Chunks[ChatChunk]:
        """Stream a chat completion: yields content deltas; the last chunk carries ``result``."""
        body = self._chat_body(messages, max_tokens, temperature, model, extra_body, True)
        assembler = ChatStreamAssembler(f"{self.base_url}/v1/chat/completions stream")

        def on_end(elapsed: float) -> ChatChunk:
            return ChatChunk(text_delta="", result=self._checked(assembler.finish(client_latency_s=elapsed)))

        return self._stream(
            _StreamExchange(
                self, "/v1/chat/completions", body, on_event=lambda obj, _: assembler.feed(obj), on_end=on_end
            )
        )

    # -- request bodies ---------------------------------------------------------------------------

    def _generate_body(
        self,
        prompt: str | None,
        input_ids: Iterable[int] | None,
        max_new_tokens: int,
        temperature: float,
        ignore_eos: bool,
        sampling_params: dict[str, Any] | None,
        stream: bool,
    ) -> dict[str, Any]:
        if (prompt is None) == (input_ids is None):
            raise InvalidArgumentError(f"{self.base_url}/generate: pass exactly one of prompt= or input_ids=")
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
            raise InvalidArgumentError(
                f"{self.base_url}/v1/chat/completions: messages must be a non-empty list of "
                "{'role': ..., 'content': ...}"
            )
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

    def _json_exchange(
        self, method: str, path: str, parse: Callable[[Any, float], T], body: dict[str, Any] | None = None
    ) -> _Exchange[T]:
        def read(resp: httpx.Response, elapsed: float) -> T:
            self._raise_for_status(resp, path)
            return parse(decode_json(resp.content, f"{self.base_url}{path}"), elapsed)

        return _Exchange(self, method, path, read=read, body=body)

    # -- checks and error mapping -----------------------------------------------------------------

    def _checked(self, result: R) -> R:
        # A 1-token answer comes from prefill alone and has no verify step even on a speculative server.
        if self.require_speculative and result.spec is None and result.completion_tokens >= 2:
            raise NotSpeculativeError(
                f"{self.base_url}: request {result.request_id} generated {result.completion_tokens} tokens "
                "but the server reported no speculative stats (no spec_verify_ct). Launch it with "
                "--speculative-algorithm HSPEC (or DSPARK), or pass require_speculative=False."
            )
        return result

    def _raise_for_status(self, resp: httpx.Response, path: str) -> None:
        """Any non-2xx answer is an error; redirects too, since they are not followed."""
        status = resp.status_code
        if 200 <= status < 300:
            return
        url = f"{self.base_url}{path}"
        if 300 <= status < 400:
            message = (
                f"{url}: HTTP {status} redirect to {resp.headers.get('location', '(no Location header)')}. "
                "The client does not follow redirects (a generation must not be resent): pass the "
                "final address as base_url."
            )
        else:
            message = f"{url}: HTTP {status}: {_error_message(resp.text)}. {_status_fix(status)}"
        raise ServerHTTPError(message, status_code=status, body=resp.text)

    def _raise_stream_error(self, obj: Any, path: str) -> None:
        if isinstance(obj, dict) and "error" in obj and "meta_info" not in obj and "choices" not in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            raise ServerHTTPError(
                f"{self.base_url}{path}: error inside the stream: {_error_message(msgspec.json.encode(obj))}",
                status_code=code if isinstance(code, int) else 400,
                body=msgspec.json.encode(obj).decode(),
            )

    @contextlib.contextmanager
    def _errors(self, path: str) -> Iterator[None]:
        """Map httpx's failures to the client's errors, each naming the URL and the fix."""
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
        except httpx.TimeoutException as exc:  # read, write or pool timeout
            raise RequestTimeoutError(
                f"{url}: no data from the server for {self.timeout:g} s ({type(exc).__name__}). "
                "Raise timeout= for long generations, or check that the server is not stuck."
            ) from exc
        except httpx.DecodingError as exc:
            raise MalformedResponseError(
                f"{url}: the body does not decode as its Content-Encoding header says ({exc}). The server "
                "or a proxy in front of it garbled the compression: disable that proxy's compression, "
                "or point base_url at the server itself."
            ) from exc
        except (httpx.RemoteProtocolError, httpx.NetworkError) as exc:  # read, write or close error
            raise ServerUnavailableError(
                f"{url}: the server dropped the connection mid-response ({exc or type(exc).__name__}). "
                "Check the server log for a crash."
            ) from exc
        except httpx.TransportError as exc:  # proxy errors and the like
            raise ServerUnavailableError(
                f"{url}: the request failed ({type(exc).__name__}: {exc}). Check the URL and any proxy "
                "settings (HTTP_PROXY, HTTPS_PROXY, NO_PROXY)."
            ) from exc


class HSpecClient(_ClientCore):
    """Synchronous client. Arguments: see ``__init__`` (base_url, timeout, retries, ...)."""

    _http_class = httpx.Client
    _transport_class = httpx.HTTPTransport
    _transport_base = httpx.BaseTransport

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HSpecClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, exchange: _Exchange[T]) -> T:
        with exchange.sending():
            exchange.response = self._http.request(exchange.method, exchange.path, json=exchange.body)
        return exchange.result

    def _stream(self, exchange: _StreamExchange[C]) -> Iterator[C]:
        with exchange.sending(), self._http.stream("POST", exchange.path, json=exchange.body) as resp:
            if not resp.is_success:
                resp.read()
            exchange.check(resp)
            for line in resp.iter_lines():
                yield from exchange.feed(line)
                if exchange.done:
                    break  # [DONE]: close the response now
        yield from exchange.end()


class AsyncHSpecClient(_ClientCore):
    """Asyncio client with the same methods as :class:`HSpecClient` (``await`` / ``async for``).

    Example (needs a running server)::

        async with AsyncHSpecClient("http://127.0.0.1:30000") as client:
            results = await asyncio.gather(*(client.generate(p, max_new_tokens=64) for p in prompts))
    """

    _http_class = httpx.AsyncClient
    _transport_class = httpx.AsyncHTTPTransport
    _transport_base = httpx.AsyncBaseTransport

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncHSpecClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, exchange: _Exchange[T]) -> T:
        with exchange.sending():
            exchange.response = await self._http.request(exchange.method, exchange.path, json=exchange.body)
        return exchange.result

    async def _stream(self, exchange: _StreamExchange[C]) -> AsyncIterator[C]:
        with exchange.sending():
            async with self._http.stream("POST", exchange.path, json=exchange.body) as resp:
                if not resp.is_success:
                    await resp.aread()
                exchange.check(resp)
                async for line in resp.aiter_lines():
                    for chunk in exchange.feed(line):
                        yield chunk
                    if exchange.done:
                        break  # [DONE]: close the response now, not when the generator is collected
        for chunk in exchange.end():
            yield chunk
