"""The HTTP edge: what stands between a client's bytes and the routes.

* Request bodies are read with a size limit (413 past `max_body_bytes`) and a per-chunk read
  timeout (408), and parsed as JSON on a worker thread, so a 50 MB body never stalls the event
  loop (and /health with it). Parsing never raises anything but an ApiError with a 4xx: invalid
  UTF-8, lone surrogates escaped in strings ("\\ud800", which no tokenizer can encode) and nesting
  deeper than MAX_JSON_DEPTH are 400s.
* `CatchAll`: an exception that escapes a route becomes a JSON 500 here, inside Starlette's
  ServerErrorMiddleware, which would re-raise it after answering and so make uvicorn drop the
  client's keep-alive connection. A client that hung up (ClientGone) is logged, not counted as a 500.
* `server_config`: uvicorn's settings: keep-alive idle timeout, a cap on the request head size, and
  the h11 protocol with a deadline for the request head, so connections that open and never send
  a complete request (half-open, slowloris) are closed instead of held forever.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from starlette.concurrency import run_in_threadpool
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import protocol as P

log = logging.getLogger("k3compile.server")

MAX_BODY_BYTES = 32 << 20      # a 1M-token prompt as ids is ~8 MB of JSON
BODY_READ_TIMEOUT_S = 30.0     # between two chunks of one body
MAX_JSON_DEPTH = 64            # far deeper than any OpenAI request
REQUEST_HEAD_TIMEOUT_S = 10.0  # from connecting (or the previous response) to a complete request head
KEEP_ALIVE_TIMEOUT_S = 5       # idle keep-alive connections (uvicorn's default)
MAX_HEAD_BYTES = 64 << 10      # request line + headers


class ClientGone(Exception):
    """The client disconnected before we could answer."""


async def read_body(receive, limit: int = MAX_BODY_BYTES, timeout: float = BODY_READ_TIMEOUT_S) -> bytes:
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            raise P.ApiError(408, f"the request body did not arrive within {timeout:g} s",
                             code="request_timeout") from None
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise P.ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def json_body(request, limit: int = MAX_BODY_BYTES):
    """The request's JSON body, read within the limits and parsed off the event loop."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.ApiError(413, f"the request body ({declared} bytes) is larger than {limit} bytes",
                         code="request_too_large")
    raw = await read_body(request.receive, limit)
    return await run_in_threadpool(parse_json, raw)


def parse_json(raw: bytes):
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise P.ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                         code="invalid_json") from None
    _check_tree(obj)
    return obj


def _check_tree(obj) -> None:
    """Depth within MAX_JSON_DEPTH and every string encodable as UTF-8 (iterative: no recursion limit)."""
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise P.ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k)
                stack.append((x, depth + 1))
        else:
            stack.extend((x, depth + 1) for x in v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start:e.end].encode("unicode_escape").decode("ascii")
        raise P.ApiError(400, f"the request body holds invalid Unicode ({bad}: a lone surrogate) in a string",
                         code="invalid_unicode") from None


class CatchAll:
    """Pure ASGI middleware: unhandled exceptions become a JSON 500 without closing the connection."""

    def __init__(self, app, on_status=None):
        self.app, self.on_status = app, on_status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientGone:
            log.info("client disconnected before the answer to %s", scope.get("path"))
            self._count("499")
        except Exception as e:
            if started:   # a stream already under way: nothing to send a status with
                log.exception("error after the response started (%s)", scope.get("path"))
                self._count("500")
                return
            log.exception("unhandled error serving %s", scope.get("path"))
            self._count("500")
            body = json.dumps(P.ApiError(500, f"internal server error: {e!r}", "server_error").body()).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    def _count(self, status: str) -> None:
        if self.on_status is not None:
            self.on_status(status)


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for the request head (see the module docstring)."""

    head_timeout = REQUEST_HEAD_TIMEOUT_S
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(app, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info", **kw):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=HeadTimeoutH11Protocol,
                          timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          **kw)
