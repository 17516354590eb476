"""Parsed responses of SGLang's ``/generate`` and ``/v1/chat/completions``, with speculative stats.

Wire shapes follow SGLang 0.5.23: ``TokenizerManager`` builds ``meta_info`` (``spec_*`` keys appear
only on the final chunk of a request whose ``spec_verify_ct > 0``), and the OpenAI-compatible chat
endpoint carries the same counters under ``sglext.spec_tokens_details`` when the request sets
``return_spec_tokens_details``. Parsing is strict about types and lenient about extra keys, since
SGLang adds keys between releases. Counters that cannot all be true (negative counts, an accept rate
above 1, more tokens claimed than ids sent) raise :class:`MalformedResponseError` instead of
becoming stats.
"""

from __future__ import annotations

import math
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
    output_ids: list[int] | None = None  # None: the server sent no ids, so there is nothing to check


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


# ---------------------------------------------------------------------------------------------------
# Parsing

_NOT_SGLANG_FIX = "Check that the URL points at an SGLang server (0.5.x)."


def _convert(obj: Any, wire_type: type, what: str) -> Any:
    try:
        return msgspec.convert(obj, wire_type)
    except msgspec.ValidationError as exc:
        raise MalformedResponseError(
            f"{what}: response does not have SGLang's shape ({exc}); got {_preview(obj)}. {_NOT_SGLANG_FIX}"
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


def parse_server_info(obj: Any, *, what: str = "/server_info") -> ServerInfo:
    """Parse a ``/server_info`` body (already JSON-decoded); wrong types raise, naming the key."""
    if not isinstance(obj, dict):
        raise MalformedResponseError(
            f"{what}: expected a JSON object of server arguments, got {_preview(obj)} "
            f"({type(obj).__name__}). {_NOT_SGLANG_FIX}"
        )

    def text(key: str, value: Any) -> str | None:
        if value is not None and not isinstance(value, str):
            raise MalformedResponseError(
                f"{what}: {key} should be a string or null, got {_preview(repr(value))}. {_NOT_SGLANG_FIX}"
            )
        return value

    num_draft = _find_key(obj, "speculative_num_draft_tokens")
    if num_draft is not None:
        whole = isinstance(num_draft, int | float) and not isinstance(num_draft, bool)
        if not (whole and float(num_draft).is_integer() and num_draft >= 1):
            raise MalformedResponseError(
                f"{what}: speculative_num_draft_tokens should be a whole number >= 1 or null, got "
                f"{_preview(repr(num_draft))}. {_NOT_SGLANG_FIX}"
            )
        num_draft = int(num_draft)
    return ServerInfo(
        version=text("version", obj.get("version")),
        model_path=text("model_path", _find_key(obj, "model_path")),
        speculative_algorithm=text("speculative_algorithm", _find_key(obj, "speculative_algorithm")),
        speculative_num_draft_tokens=num_draft,
        raw=obj,
    )


def _spec_problems(spec: SpecStats, completion_tokens: int) -> list[str]:
    """What in ``spec`` cannot be true of a request that generated ``completion_tokens`` tokens.

    SGLang 0.5.23 (TokenizerManager._calculate_spec_decoding_metrics) reports accept_length =
    completion_tokens / verify_ct and one histogram entry per verify step, indexed by the drafts it
    accepted; every verify step commits at least its bonus token.
    """
    problems = []
    steps, tau, hist = spec.verify_ct, spec.accept_length, spec.correct_drafts_histogram
    if steps < 0:
        problems.append(f"spec_verify_ct={steps} is negative")
    elif steps > completion_tokens:
        problems.append(
            f"spec_verify_ct={steps} exceeds completion_tokens={completion_tokens} "
            "(every verify step commits at least one token)"
        )
    if not (math.isfinite(tau) and tau >= 1):
        problems.append(f"spec_accept_length={tau} is not a number >= 1 (a verify step commits >= 1 token)")
    elif steps > 0 and tau * steps > completion_tokens * (1 + 1e-9) + 1e-6:
        problems.append(
            f"spec_accept_length={tau} over spec_verify_ct={steps} steps is {tau * steps:g} tokens, "
            f"more than completion_tokens={completion_tokens}"
        )
    correct, proposed = spec.num_correct_drafts, spec.num_proposed_drafts
    if correct < 0 or proposed < 0:
        problems.append(
            f"spec_num_correct_drafts={correct} or spec_num_proposed_drafts={proposed} is negative"
        )
    elif correct > proposed:
        problems.append(f"spec_num_correct_drafts={correct} exceeds spec_num_proposed_drafts={proposed}")
    if spec.accept_rate is not None and not 0.0 <= spec.accept_rate <= 1.0:  # NaN fails too
        problems.append(f"spec_accept_rate={spec.accept_rate} is not a fraction in [0, 1]")
    if spec.cap_length is not None and not (math.isfinite(spec.cap_length) and spec.cap_length > 0):
        problems.append(f"spec_cap_length={spec.cap_length} is not a length > 0")
    if any(count < 0 for count in hist):
        problems.append(f"spec_correct_drafts_histogram={list(hist)} has a negative count")
    elif hist and sum(hist) != steps:
        problems.append(
            f"spec_correct_drafts_histogram counts {sum(hist)} verify steps, spec_verify_ct={steps}"
        )
    elif hist and sum(i * count for i, count in enumerate(hist)) != correct:
        problems.append(
            f"spec_correct_drafts_histogram accounts for {sum(i * c for i, c in enumerate(hist))} accepted "
            f"drafts, spec_num_correct_drafts={correct}"
        )
    return problems


def _check_counters(
    what: str,
    *,
    request_id: str,
    prompt_tokens: int,
    completion_tokens: int,
    spec: SpecStats | None,
    cached_tokens: int = 0,
    output_ids: tuple[int, ...] | None = None,
    e2e_latency: float | None = None,
) -> None:
    """Refuse a result whose counters cannot all be true, rather than return stats that are wrong."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    problems = [f"{name}={value} is negative" for name, value in counts.items() if value < 0]
    if output_ids is not None and len(output_ids) != completion_tokens:
        problems.append(
            f"completion_tokens={completion_tokens} but the response carries {len(output_ids)} output ids"
        )
    if e2e_latency is not None and not (math.isfinite(e2e_latency) and e2e_latency >= 0):
        problems.append(f"e2e_latency={e2e_latency} is not a duration >= 0")
    if spec is not None:
        problems += _spec_problems(spec, completion_tokens)
    if problems:
        raise MalformedResponseError(
            f"{what}: the server reported impossible counters for request {request_id}: "
            f"{'; '.join(problems)}. No result is returned, since its stats cannot be trusted. "
            f"{_NOT_SGLANG_FIX} If it does, report this server bug with the request id."
        )


def spec_from_meta_info(meta: _MetaInfoWire) -> SpecStats | None:
    # A negative count is kept (not read as "no speculation") so that _check_counters refuses it.
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
    if details is None or details.spec_verify_ct == 0:  # negative: kept, so _check_counters refuses it
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
    ids = None if wire.output_ids is None else tuple(wire.output_ids)
    return _generate_result(wire, wire.text or "", ids, client_latency_s, what)


def _generate_result(
    wire: _GenerateWire, text: str, output_ids: tuple[int, ...] | None, client_latency_s: float, what: str
) -> GenerateResult:
    """The final event as a result; ``output_ids`` is None when the server sent none."""
    meta = wire.meta_info
    finish_reason, matched = _finish(meta, what)
    if finish_reason == "abort":
        reason = meta.finish_reason
        raise ServerHTTPError(
            f"{what}: the server aborted the request: {reason.message}",
            status_code=reason.status_code or 500,
            body=msgspec.json.encode(reason).decode(),
        )
    spec = spec_from_meta_info(meta)
    _check_counters(
        what,
        request_id=meta.id,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        spec=spec,
        cached_tokens=meta.cached_tokens,
        output_ids=output_ids,
        e2e_latency=meta.e2e_latency,
    )
    return GenerateResult(
        request_id=meta.id,
        text=text,
        output_ids=output_ids or (),
        finish_reason=finish_reason,
        matched_stop=matched,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
        latency_s=meta.e2e_latency if meta.e2e_latency else client_latency_s,
        client_latency_s=client_latency_s,
        spec=spec,
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
        self._ids_sent = False  # whether any event carried output_ids
        self.final: GenerateResult | None = None

    def feed(self, obj: Any, *, client_latency_s: float) -> GenerateChunk:
        if self.final is not None:
            raise MalformedResponseError(f"{self._what}: event after the final one: {_preview(obj)}")
        wire = _convert(obj, _GenerateWire, self._what)
        self._ids_sent |= wire.output_ids is not None
        ids, text = wire.output_ids or [], wire.text or ""
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
            ids_seen = tuple(self._ids) if self._ids_sent else None
            result = _generate_result(wire, self._text, ids_seen, client_latency_s, self._what)
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
    return _chat_result(
        what,
        request_id=wire.id,
        model=wire.model,
        text=choice.message.content or "",
        finish_reason=choice.finish_reason,
        matched_stop=choice.matched_stop,
        usage=wire.usage,
        latency_s=client_latency_s,
        spec=_spec_from_sglext(wire.sglext),
    )


def _chat_result(what: str, *, usage: _UsageWire, spec: SpecStats | None, **fields: Any) -> ChatResult:
    completion_tokens = usage.completion_tokens or 0
    _check_counters(
        what,
        request_id=fields["request_id"],
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=completion_tokens,
        spec=spec,
    )
    return ChatResult(
        prompt_tokens=usage.prompt_tokens, completion_tokens=completion_tokens, spec=spec, **fields
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
        return _chat_result(
            self._what,
            request_id=self._id,
            model=self._model,
            text="".join(self._parts),
            finish_reason=self._finish_reason,
            matched_stop=self._matched_stop,
            usage=self._usage,
            latency_s=client_latency_s,
            spec=self._spec,
        )
