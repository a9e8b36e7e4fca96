"""The one place qpipe itself sends a request to a server: every way it can fail is one error.

A request fails in many shapes: refused or reset connections and timeouts (``OSError``), a
connection that closes mid-answer (``http.client.IncompleteRead``) or before any answer
(``RemoteDisconnected``), a malformed status line (``HTTPException``), an error status
(``HTTPError``). :func:`request` catches the whole family and raises :class:`RequestFailed`,
whose ``detail`` says in words what happened; the caller adds who and when.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

# What a request can raise: socket errors and timeouts are OSErrors (URLError and HTTPError
# too); a connection closed mid-answer or a malformed answer is an HTTPException.
REQUEST_ERRORS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)

USER_AGENT = "qpipe"  # a server's log (and a fault-injecting proxy) tells qpipe's requests apart


class RequestFailed(Exception):
    """No complete, successful answer; ``detail`` says how (``status`` for an error status)."""

    def __init__(self, detail: str, status: int | None = None, timed_out: bool = False
                 ) -> None:
        super().__init__(detail)
        self.detail, self.status, self.timed_out = detail, status, timed_out


def request(url: str, timeout: float, body: dict[str, Any] | None = None,
            allow_empty: bool = False) -> bytes:
    """GET ``url`` (POST ``body`` as JSON) and return the whole answer's body. An empty body
    fails unless ``allow_empty`` (a connection closed inside the headers reads as one)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"User-Agent": USER_AGENT, **({"Content-Type": "application/json"}
                                            if data is not None else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                    timeout=timeout) as response:
            answer = response.read()
    except REQUEST_ERRORS as err:
        raise RequestFailed(describe(err, timeout),
                            getattr(err, "code", None) if isinstance(
                                err, urllib.error.HTTPError) else None,
                            timed_out=_timed_out(err)) from None
    if not answer and not allow_empty:
        raise RequestFailed("an empty answer (the connection closed before a body)")
    return answer


def request_json(url: str, timeout: float, body: dict[str, Any] | None = None) -> Any:
    """:func:`request`, the answer parsed as JSON (an answer that is not JSON fails too)."""
    answer = request(url, timeout, body)
    try:
        return json.loads(answer)
    except ValueError:
        raise RequestFailed(f"the answer is not JSON ({answer[:120]!r})") from None


def _timed_out(err: BaseException) -> bool:
    """Whether no answer came in time (urllib wraps a connect timeout in a URLError)."""
    reason = getattr(err, "reason", None) if isinstance(err, urllib.error.URLError) else None
    return isinstance(err, TimeoutError) or isinstance(reason, TimeoutError)


def describe(err: BaseException, timeout: float) -> str:
    """A request error in words: what the connection did."""
    if isinstance(err, urllib.error.HTTPError):
        try:
            text = err.read().decode(errors="replace").strip()
        except REQUEST_ERRORS:
            text = ""
        return f"HTTP {err.code} {err.reason}" + (f": {text[:300]}" if text else "")
    if isinstance(err, urllib.error.URLError):
        reason = err.reason
        if isinstance(reason, BaseException):
            return describe(reason, timeout)
        return f"could not connect ({reason})"
    if isinstance(err, http.client.IncompleteRead):
        expected = f", {err.expected:,} more expected" if err.expected is not None else ""
        return (f"the connection closed mid-answer ({len(err.partial):,} bytes read"
                f"{expected})")
    if isinstance(err, http.client.RemoteDisconnected):
        return "the connection closed before any answer"
    if isinstance(err, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(err, ConnectionRefusedError):
        return "the connection was refused (nothing listening)"
    if isinstance(err, ConnectionResetError):
        return "the connection was reset"
    if isinstance(err, http.client.HTTPException):
        return f"a malformed answer ({type(err).__name__}: {err})"
    return f"{type(err).__name__}: {err}"
