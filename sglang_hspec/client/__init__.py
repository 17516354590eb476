"""Python client SDK for SGLang servers running H-Spec (or any) speculative decoding.

``HSpecClient`` / ``AsyncHSpecClient`` talk to SGLang's native ``/generate`` and its
OpenAI-compatible ``/v1/chat/completions``; every result carries the request's speculative stats
(``result.spec``: tau, verify count, wasted verify tokens) and its tokens/s. ``bench`` is the
closed-loop serving benchmark behind ``hspec bench serve``. See docs/client.md.
"""

from .client import AsyncHSpecClient, HSpecClient
from .errors import (
    HSpecClientError,
    InvalidArgumentError,
    MalformedResponseError,
    NotSpeculativeError,
    RequestTimeoutError,
    ServerHTTPError,
    ServerUnavailableError,
)
from .types import ChatChunk, ChatResult, GenerateChunk, GenerateResult, ServerInfo, SpecStats

__all__ = [
    "AsyncHSpecClient",
    "ChatChunk",
    "ChatResult",
    "GenerateChunk",
    "GenerateResult",
    "HSpecClient",
    "HSpecClientError",
    "InvalidArgumentError",
    "MalformedResponseError",
    "NotSpeculativeError",
    "RequestTimeoutError",
    "ServerHTTPError",
    "ServerInfo",
    "ServerUnavailableError",
    "SpecStats",
]
