"""Errors raised by the client SDK.

Every error names the server URL and says what to do about it; all derive from
:class:`HSpecClientError`, so ``except HSpecClientError`` catches any client failure.
"""

from __future__ import annotations


class HSpecClientError(Exception):
    """Base class of every error the client raises."""


class InvalidArgumentError(HSpecClientError, ValueError):
    """A client or call argument is invalid (bad base URL, port, timeout, ...); raised before any request.

    Also a ``ValueError``, so code that checks arguments with ``except ValueError`` keeps working.
    """


class ServerUnavailableError(HSpecClientError):
    """The server refused or dropped the connection, after all connection retries."""


class RequestTimeoutError(HSpecClientError):
    """The server did not answer (or stopped streaming) within the configured timeout."""


class ServerHTTPError(HSpecClientError):
    """The server answered with a non-2xx status, or sent an error object inside a stream."""

    def __init__(self, message: str, *, status_code: int, body: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class MalformedResponseError(HSpecClientError):
    """The server answered 2xx but the body is not the SGLang shape the client expects."""


class NotSpeculativeError(HSpecClientError):
    """Speculative stats were required but the server reported none."""
