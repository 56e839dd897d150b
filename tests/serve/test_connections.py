"""Connections cannot pile up: the request-head deadline and the concurrency cap of `astrai serve`.

The server is `astrai serve`'s own uvicorn configuration (`cli.uvicorn_config`) in a thread of
this process, talked to over raw sockets. Moments are events: a socket's recv returning b""
(the server closed it), a response's status line. Deadlines appear only as guards against a
hang, and no duration is asserted."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.live import AUTH, GUARD_S, LiveServer, serve_config

CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (recv returns b"")."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {GUARD_S} s (guard)") from None
        except ConnectionResetError:  # closed while this side was still sending: closed all the same
            return data
        if not chunk:
            return data
        data += chunk


def request_bytes(path: str = "/health") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()


def chat_bytes() -> bytes:
    body = json.dumps(CHAT).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_silent_and_trickling_connections_are_closed_and_requests_still_work(model_dir: Path):
    with LiveServer(serve_config(model_dir), header_timeout=0.5) as live:
        silent = [live.connect() for _ in range(5)]
        trickling = live.connect()
        trickling.sendall(b"GET /health HTTP/1.1\r\n")
        stop = threading.Event()

        def trickle() -> None:  # one header byte at a time, never finishing the head
            try:
                while not stop.wait(0.05):
                    trickling.sendall(b"X")
            except OSError:  # the server closed it
                pass

        worker = threading.Thread(target=trickle, daemon=True)
        worker.start()
        try:
            for sock in silent:
                assert read_until_closed(sock) == b""  # closed without a response: nothing was asked
            read_until_closed(trickling)  # closed although bytes kept arriving
        finally:
            stop.set()
            worker.join(GUARD_S)
            for sock in [*silent, trickling]:
                sock.close()
        # a normal request still works afterwards, and so does a whole chat completion
        with live.connect(request_bytes()) as sock:
            assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
        with live.connect(chat_bytes()) as sock:
            reply = read_until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in reply, reply[-500:]


def test_a_keep_alive_connection_that_goes_quiet_is_closed(model_dir: Path):
    with LiveServer(serve_config(model_dir), header_timeout=0.5) as live, \
            live.connect(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as sock:  # keep-alive
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, "closed before the response"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the deadline may have come first
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next head starts, and never ends
        assert read_until_closed(sock) == b""


def test_over_the_concurrency_cap_a_request_gets_503(model_dir: Path):
    with LiveServer(serve_config(model_dir), header_timeout=GUARD_S * 4, limit_concurrency=3) as live:
        held = [live.connect() for _ in range(3)]  # the cap: three open connections
        try:
            with live.connect() as extra:  # a fourth
                extra.sendall(request_bytes())
                assert read_until_closed(extra).startswith(b"HTTP/1.1 503")
            held[0].sendall(request_bytes())  # the connections within the cap are served
            assert read_until_closed(held[0]).startswith(b"HTTP/1.1 200")
        finally:
            for sock in held:
                sock.close()
        # once connections close, new ones are served again (uvicorn drops a closed one at once)
        deadline = time.monotonic() + GUARD_S  # guard only
        status = 0
        while time.monotonic() < deadline:
            status = httpx.get(live.base + "/health", timeout=GUARD_S).status_code
            if status == 200:
                break
            time.sleep(0.02)
        assert status == 200


@pytest.mark.parametrize("flag,value", [("--header_timeout", "0"), ("--limit_concurrency", "0"),
                                        ("--max_guide_bytes", "0")])
def test_bad_connection_flags_are_refused(model_dir: Path, capsys, flag: str, value: str):
    from astrai.serve.cli import main

    assert main(["--model", str(model_dir), flag, value]) == 2
    assert flag in capsys.readouterr().err
