"""Parsed responses of SGLang's ``/generate`` and ``/v1/chat/completions``, with speculative stats.

Wire shapes follow SGLang 0.5.23: ``TokenizerManager`` builds ``meta_info`` (``spec_*`` keys appear
only on the final chunk of a request whose ``spec_verify_ct > 0``), and the OpenAI-compatible chat
endpoint carries the same counters under ``sglext.spec_tokens_details`` when the request sets
``return_spec_tokens_details``. Parsing is strict about types and lenient about extra keys, since
SGLang adds keys between releases.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import MalformedResponseError, ServerHTTPError

# ---------------------------------------------------------------------------------------------------
# Wire shapes (private): decoded with msgspec, then turned into the public frozen structs below.


class _FinishReasonWire(msgspec.Struct):
    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


class _MetaInfoWire(msgspec.Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: _FinishReasonWire | None = None
    cached_tokens: int = 0
    e2e_latency: float | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_verify_ct: int | None = None
    spec_num_correct_drafts: int | None = None
    spec_num_proposed_drafts: int | None = None
    spec_cap_length: float | None = None
    spec_correct_drafts_histogram: list[int] | None = None


class _GenerateWire(msgspec.Struct):
    meta_info: _MetaInfoWire
    text: str | None = None
    output_ids: list[int] = []


class _SpecDetailsWire(msgspec.Struct):
    spec_accept_length: float = 0.0
    spec_accept_rate: float = 0.0
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    spec_cap_length: float = 0.0
    spec_correct_drafts_histogram: list[int] = []


class _SglExtWire(msgspec.Struct):
    spec_tokens_details: _SpecDetailsWire | list[_SpecDetailsWire] | None = None


class _UsageWire(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0


class _MessageWire(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _ChatChoiceWire(msgspec.Struct):
    index: int
    message: _MessageWire
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class _ChatWire(msgspec.Struct):
    id: str
    model: str
    choices: list[_ChatChoiceWire]
    usage: _UsageWire
    sglext: _SglExtWire | None = None


class _ChatStreamChoiceWire(msgspec.Struct):
    index: int
    delta: _MessageWire
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class _ChatChunkWire(msgspec.Struct):
    id: str
    model: str
    choices: list[_ChatStreamChoiceWire]
    usage: _UsageWire | None = None
    sglext: _SglExtWire | None = None


# ---------------------------------------------------------------------------------------------------
# Public results


class SpecStats(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request speculative decoding counters, as the server reports them.

    ``tau`` (= SGLang's ``spec_accept_length``) is the mean number of tokens committed per verify
    step, bonus token included. ``verify_width`` is the mean number of positions the target verified
    per step: the scheduler's budget ``spec_cap_length`` when the server reports it (DSpark/H-Spec
    ragged verify), else the fixed ``speculative_num_draft_tokens``. Every verified position that was
    not committed is a wasted verify token.

    >>> s = SpecStats(accept_length=3.0, verify_ct=4, num_correct_drafts=8, num_proposed_drafts=24)
    >>> s.tau, s.verify_width, s.verified_tokens, s.wasted_verify_tokens
    (3.0, 7.0, 28, 16)
    """

    accept_length: float
    verify_ct: int
    num_correct_drafts: int
    num_proposed_drafts: int
    accept_rate: float | None = None
    cap_length: float | None = None
    correct_drafts_histogram: tuple[int, ...] = ()

    @property
    def tau(self) -> float:
        return self.accept_length

    @property
    def verify_width(self) -> float:
        if self.cap_length:
            return self.cap_length
        # Each step verifies the proposed drafts plus the anchor position.
        return self.num_proposed_drafts / self.verify_ct + 1.0

    @property
    def verified_tokens(self) -> int:
        return round(self.verify_width * self.verify_ct)

    @property
    def wasted_verify_tokens(self) -> int:
        # Committed per step: the accepted drafts plus one bonus token.
        return max(self.verified_tokens - self.num_correct_drafts - self.verify_ct, 0)


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished ``/generate`` request.

    ``latency_s`` is the server's ``e2e_latency`` when present (it excludes network and queueing in
    the client), else the client's wall time; ``client_latency_s`` is always the client's wall time.
    """

    request_id: str
    text: str
    output_ids: tuple[int, ...]
    finish_reason: str
    matched_stop: int | str | tuple[int, ...] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_s: float
    client_latency_s: float
    spec: SpecStats | None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed ``/generate`` event: the new text and token ids; ``result`` on the last one."""

    text_delta: str
    output_ids_delta: tuple[int, ...]
    result: GenerateResult | None = None


class ChatResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished ``/v1/chat/completions`` request (first choice). ``latency_s`` is client wall time."""

    request_id: str
    model: str
    text: str
    finish_reason: str
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    spec: SpecStats | None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed chat event: the content delta; ``result`` on the last one."""

    text_delta: str
    result: ChatResult | None = None


# ---------------------------------------------------------------------------------------------------
# Parsing


def _convert(obj: Any, wire_type: type, what: str) -> Any:
    try:
        return msgspec.convert(obj, wire_type)
    except msgspec.ValidationError as exc:
        raise MalformedResponseError(
            f"{what}: response does not have SGLang's shape ({exc}); got {_preview(obj)}. "
            "Check that the URL points at an SGLang server (0.5.x)."
        ) from None


def _preview(obj: Any, limit: int = 300) -> str:
    text = obj if isinstance(obj, str) else repr(obj)
    return text if len(text) <= limit else text[:limit] + "..."


def decode_json(body: bytes | str, what: str) -> Any:
    """JSON-decode a response body, or raise :class:`MalformedResponseError` quoting it."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raw = body.decode(errors="replace") if isinstance(body, bytes) else body
        raise MalformedResponseError(f"{what}: body is not valid JSON ({exc}): {_preview(raw)!r}") from None


def spec_from_meta_info(meta: _MetaInfoWire) -> SpecStats | None:
    if not meta.spec_verify_ct or meta.spec_accept_length is None:
        return None
    return SpecStats(
        accept_length=meta.spec_accept_length,
        verify_ct=meta.spec_verify_ct,
        num_correct_drafts=meta.spec_num_correct_drafts or 0,
        num_proposed_drafts=meta.spec_num_proposed_drafts or 0,
        accept_rate=meta.spec_accept_rate,
        cap_length=meta.spec_cap_length or None,
        correct_drafts_histogram=tuple(meta.spec_correct_drafts_histogram or ()),
    )


def _spec_from_sglext(sglext: _SglExtWire | None) -> SpecStats | None:
    details = sglext.spec_tokens_details if sglext is not None else None
    if isinstance(details, list):  # n > 1: one entry per choice; the client asks for n = 1
        details = details[0] if details else None
    if details is None or details.spec_verify_ct <= 0:
        return None
    return SpecStats(
        accept_length=details.spec_accept_length,
        verify_ct=details.spec_verify_ct,
        num_correct_drafts=details.spec_num_correct_drafts,
        num_proposed_drafts=details.spec_num_proposed_drafts,
        accept_rate=details.spec_accept_rate,
        cap_length=details.spec_cap_length or None,
        correct_drafts_histogram=tuple(details.spec_correct_drafts_histogram),
    )


def _finish(meta: _MetaInfoWire, what: str) -> tuple[str, int | str | tuple[int, ...] | None]:
    reason = meta.finish_reason
    if reason is None:
        raise MalformedResponseError(f"{what}: final response has no finish_reason: {_preview(meta)}")
    matched = tuple(reason.matched) if isinstance(reason.matched, list) else reason.matched
    return reason.type, matched


def parse_generate(obj: Any, *, client_latency_s: float, what: str = "/generate") -> GenerateResult:
    """Parse a non-streaming ``/generate`` body (already JSON-decoded) into a result."""
    if isinstance(obj, list):
        raise MalformedResponseError(f"{what}: got a batch (list) response; send one prompt per call")
    wire = _convert(obj, _GenerateWire, what)
    return _generate_result(wire, wire.text or "", tuple(wire.output_ids), client_latency_s, what)


def _generate_result(
    wire: _GenerateWire, text: str, output_ids: tuple[int, ...], client_latency_s: float, what: str
) -> GenerateResult:
    meta = wire.meta_info
    finish_reason, matched = _finish(meta, what)
    if finish_reason == "abort":
        reason = meta.finish_reason
        raise ServerHTTPError(
            f"{what}: the server aborted the request: {reason.message}",
            status_code=reason.status_code or 500,
            body=msgspec.json.encode(reason).decode(),
        )
    return GenerateResult(
        request_id=meta.id,
        text=text,
        output_ids=output_ids,
        finish_reason=finish_reason,
        matched_stop=matched,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
        latency_s=meta.e2e_latency if meta.e2e_latency else client_latency_s,
        client_latency_s=client_latency_s,
        spec=spec_from_meta_info(meta),
    )


class GenerateStreamAssembler:
    """Turns SGLang's ``/generate`` SSE events into :class:`GenerateChunk` deltas.

    SGLang streams cumulative text and ids by default and disjoint segments under
    ``--incremental-streaming-output``. The two are told apart per event: in cumulative mode the
    event's ``output_ids`` has exactly ``meta_info.completion_tokens`` ids and extends what was seen
    (on the first event both readings coincide).
    """

    def __init__(self, what: str = "/generate stream") -> None:
        self._what = what
        self._text = ""
        self._ids: list[int] = []
        self.final: GenerateResult | None = None

    def feed(self, obj: Any, *, client_latency_s: float) -> GenerateChunk:
        if self.final is not None:
            raise MalformedResponseError(f"{self._what}: event after the final one: {_preview(obj)}")
        wire = _convert(obj, _GenerateWire, self._what)
        ids, text = wire.output_ids, wire.text or ""
        cumulative = len(ids) == wire.meta_info.completion_tokens and ids[: len(self._ids)] == self._ids
        if cumulative:
            ids_delta, text_delta = ids[len(self._ids) :], text[len(self._text) :]
            self._ids, self._text = list(ids), text
        else:
            ids_delta, text_delta = ids, text
            self._ids.extend(ids)
            self._text += text
        result = None
        if wire.meta_info.finish_reason is not None:
            result = _generate_result(wire, self._text, tuple(self._ids), client_latency_s, self._what)
            self.final = result
        return GenerateChunk(text_delta=text_delta, output_ids_delta=tuple(ids_delta), result=result)


def parse_chat(obj: Any, *, client_latency_s: float, what: str = "/v1/chat/completions") -> ChatResult:
    """Parse a non-streaming chat completion body (already JSON-decoded) into a result."""
    wire = _convert(obj, _ChatWire, what)
    if not wire.choices:
        raise MalformedResponseError(f"{what}: response has no choices: {_preview(obj)}")
    choice = wire.choices[0]
    if choice.finish_reason is None:
        raise MalformedResponseError(f"{what}: choice has no finish_reason: {_preview(obj)}")
    _raise_if_chat_abort(choice.finish_reason, what, obj)
    return ChatResult(
        request_id=wire.id,
        model=wire.model,
        text=choice.message.content or "",
        finish_reason=choice.finish_reason,
        matched_stop=choice.matched_stop,
        prompt_tokens=wire.usage.prompt_tokens,
        completion_tokens=wire.usage.completion_tokens or 0,
        latency_s=client_latency_s,
        spec=_spec_from_sglext(wire.sglext),
    )


def _raise_if_chat_abort(finish_reason: str, what: str, obj: Any) -> None:
    if finish_reason == "abort":
        raise ServerHTTPError(
            f"{what}: the server aborted the request (finish_reason 'abort')",
            status_code=500,
            body=_preview(obj),
        )


class ChatStreamAssembler:
    """Turns SGLang's chat SSE chunks into :class:`ChatChunk` deltas.

    SGLang sends content chunks, then one chunk per choice with ``finish_reason``, then (when asked)
    an ``sglext`` chunk with ``choices == []`` and a usage chunk with ``choices == []``, then
    ``[DONE]``. The result is complete only at ``[DONE]``, so :meth:`finish` builds it.
    """

    def __init__(self, what: str = "/v1/chat/completions stream") -> None:
        self._what = what
        self._parts: list[str] = []
        self._id: str | None = None
        self._model = ""
        self._finish_reason: str | None = None
        self._matched_stop: int | str | None = None
        self._usage: _UsageWire | None = None
        self._spec: SpecStats | None = None

    def feed(self, obj: Any) -> ChatChunk | None:
        wire = _convert(obj, _ChatChunkWire, self._what)
        self._id, self._model = wire.id, wire.model
        if wire.usage is not None:
            self._usage = wire.usage
        if wire.sglext is not None:
            self._spec = _spec_from_sglext(wire.sglext) or self._spec
        delta = ""
        for choice in wire.choices:
            if choice.index != 0:
                continue
            delta += choice.delta.content or ""
            if choice.finish_reason is not None:
                self._finish_reason, self._matched_stop = choice.finish_reason, choice.matched_stop
        self._parts.append(delta)
        return ChatChunk(text_delta=delta) if delta else None

    def finish(self, *, client_latency_s: float) -> ChatResult:
        if self._id is None or self._finish_reason is None:
            raise MalformedResponseError(f"{self._what}: stream ended before a finish_reason was sent")
        _raise_if_chat_abort(self._finish_reason, self._what, "".join(self._parts))
        if self._usage is None:
            raise MalformedResponseError(
                f"{self._what}: stream carried no usage chunk although stream_options.include_usage was set"
            )
        return ChatResult(
            request_id=self._id,
            model=self._model,
            text="".join(self._parts),
            finish_reason=self._finish_reason,
            matched_stop=self._matched_stop,
            prompt_tokens=self._usage.prompt_tokens,
            completion_tokens=self._usage.completion_tokens or 0,
            latency_s=client_latency_s,
            spec=self._spec,
        )
