"""The HTTP edge (runtime/server/edge.py): a 500 leaves the keep-alive connection usable, body size
limit, JSON parsed off the event loop, a deadline for request heads, client disconnects counted as
499 not 500, latency histograms in /metrics."""
import socket
import threading

import httpx
import pytest

from k3compile.runtime.server import edge

from .conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": "ok", "max_tokens": 2, "temperature": 0}


def metric(server, name: str, label: str = "") -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + label + " ") or (not label and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def test_a_500_keeps_the_connection_usable(server, monkeypatch):
    """Two requests over one keep-alive connection: the first hits a bug (500), the second succeeds."""
    def broken(*a, **k):
        raise RuntimeError("injected tokenizer bug")
    before = metric(server, "k3compile_request_errors_total", '{status="500"}')
    with httpx.Client(base_url=server.base_url, headers=AUTH) as client:
        monkeypatch.setattr(server.front.tokenizer, "encode", broken)
        r = client.post("/v1/completions", json=OK)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        monkeypatch.undo()
        conn = r.extensions["network_stream"]
        r2 = client.post("/v1/completions", json=OK)
        assert r2.status_code == 200
        assert r2.extensions["network_stream"] is conn   # the same connection carried both
    assert metric(server, "k3compile_request_errors_total", '{status="500"}') == before + 1


def test_a_body_over_the_limit_is_413(server, monkeypatch):
    monkeypatch.setattr(edge, "MAX_BODY_BYTES", 1000)
    monkeypatch.setattr(edge.json_body, "__defaults__", (1000,))
    big = {**OK, "prompt": "x" * 2000}
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():   # no Content-Length: the limit holds while reading
        yield b'{"model": "k3-tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}'
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, content=chunks())
    assert r.status_code == 413


def test_json_is_parsed_off_the_event_loop(server, monkeypatch):
    seen = []
    parse = edge.parse_json

    def recording(raw):
        seen.append(threading.current_thread())
        return parse(raw)
    monkeypatch.setattr(edge, "parse_json", recording)
    assert httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=OK).status_code == 200
    assert seen and seen[0] is not server.thread   # uvicorn's loop runs on server.thread


@pytest.mark.parametrize("raw, code", [
    (b"[" * 100_000, "invalid_json"),
    (b"[" * 65 + b"]" * 65, "invalid_json"),
    (b'{"model": "k3-tiny", "prompt": "\\ud800", "max_tokens": 2}', "invalid_unicode"),
    (b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "invalid_unicode"),
    (b'{"model": "k3-tiny", "prompt": "\xc3("}', "invalid_json"),
])
def test_bodies_that_cannot_be_decoded_are_400(server, raw, code):
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, content=raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_a_connection_that_never_sends_a_request_head_is_closed(server, monkeypatch):
    monkeypatch.setattr(edge.HeadTimeoutH11Protocol, "head_timeout", 0.3)
    for opening in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):   # silent, and a head never finished
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            if opening:
                s.sendall(opening)
            assert s.recv(1024) == b""   # closed by the server (a timeout here raises instead)


def test_a_client_that_leaves_mid_body_is_not_a_500(server):
    before_500 = metric(server, "k3compile_request_errors_total", '{status="500"}')
    before_499 = metric(server, "k3compile_request_errors_total", '{status="499"}')
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    for _ in range(200):   # the server notices the disconnect on its own time
        if metric(server, "k3compile_request_errors_total", '{status="499"}') == before_499 + 1:
            break
        threading.Event().wait(0.05)
    assert metric(server, "k3compile_request_errors_total", '{status="499"}') == before_499 + 1
    assert metric(server, "k3compile_request_errors_total", '{status="500"}') == before_500


def test_latency_histograms(server):
    names = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
             "request_queue_time_seconds")
    before = {n: metric(server, f"k3compile_{n}_count") for n in names}
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json={**OK, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    server.wait_idle()
    after = {n: metric(server, f"k3compile_{n}_count") for n in names}
    assert after["time_to_first_token_seconds"] == before["time_to_first_token_seconds"] + 1
    assert after["inter_token_latency_seconds"] == before["inter_token_latency_seconds"] + 2
    assert after["e2e_request_latency_seconds"] == before["e2e_request_latency_seconds"] + 1
    assert after["request_queue_time_seconds"] == before["request_queue_time_seconds"] + 1
