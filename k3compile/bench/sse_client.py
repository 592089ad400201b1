"""A minimal asyncio HTTP/1.1 client for `bench serve`: POST a JSON body, iterate the response's
lines as they arrive (server-sent events), chunked or not. Standard library only, so the load
generator runs on machines without httpx/aiohttp (the device image). One connection per request
(`Connection: close`), plain http:// only; the connect time counts in the TTFT, as for any client.
"""
from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    pass


async def post_lines(url: str, body: dict, headers: dict | None = None):
    """Yields (status, None) first, then each line of the body (str, without the line end)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise HTTPError(f"only http:// URLs are supported, got {url!r}")
    host, port = parts.hostname, parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            "Accept: text/event-stream", f"Content-Length: {len(payload)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").strip()
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise HTTPError(f"bad status line {status_line!r}") from None
        chunked = False
        while True:
            line = (await reader.readline()).decode("latin-1").strip()
            if not line:
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        yield status, None
        pending = b""
        async for data in (_chunks(reader) if chunked else _until_eof(reader)):
            pending += data
            *lines, pending = pending.split(b"\n")
            for ln in lines:
                yield None, ln.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield None, pending.decode("utf-8", "replace")
    finally:
        writer.close()


async def _chunks(reader):
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)   # CRLF after each chunk
        yield data


async def _until_eof(reader):
    while True:
        data = await reader.read(65536)
        if not data:
            return
        yield data
