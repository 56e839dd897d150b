"""Live servers for the server tests, in a thread of the test process: `LiveApp` (`create_app` on
plain uvicorn, so a test can hook the engine loader) and `LiveServer` (`create_app` under `astrai
serve`'s own uvicorn settings, with a connection whose request is in the socket buffer before the
server sees it); the header for the test key, and the guard bound on every wait."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from astrai.serve.app import ServeConfig, create_app, load_engine
from astrai.serve.cli import uvicorn_config
from tests.serve.conftest import API_KEY, free_port

GUARD_S = 30.0  # a bound against a hang, never a measured duration
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_ENGINE = {"max_model_len": 64, "kv_cache_tokens": 2048, "long_prefill_token_threshold": 0}


class LiveApp:
    """`create_app` on uvicorn in a thread of this process (so tests can hook the loader)."""

    def __init__(self, config: ServeConfig, loader=load_engine):
        import uvicorn

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.app = create_app(config, loader)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveApp:
        self.thread.start()
        deadline = time.monotonic() + 30  # guard only
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def wait_status(self, status: str) -> None:
        state = self.app.state.serve
        deadline = time.monotonic() + 60  # guard only
        while state.status != status and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state.status == status, state.error

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class LiveServer:
    """`create_app` under `astrai serve`'s uvicorn settings, in a thread, on a free port."""

    def __init__(self, config: ServeConfig, **settings: Any):
        import uvicorn

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn_config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", log_config=None, **settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60  # guard only
        state = self.app.state.serve
        while (not self.server.started or state.status == "loading") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started and state.status == "ready", state.error
        return self

    def connect(self, head: bytes | None = None) -> socket.socket:
        """A connection; with `head`, one whose request is already in the server's socket buffer
        when the server first sees the connection: the server's event loop is held while the
        client connects and sends, so a short header deadline can never fire on a client that is
        merely slow to be scheduled (an event, not a race against the clock)."""
        if head is None:
            return socket.create_connection(("127.0.0.1", self.port), timeout=GUARD_S)
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # runs on the server's loop: nothing there runs until released
            held.set()
            release.wait(GUARD_S)

        self.server.servers[0].get_loop().call_soon_threadsafe(hold)
        assert held.wait(GUARD_S), "the server's event loop never ran the hold (guard)"
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=GUARD_S)  # the kernel's backlog
            sock.sendall(head)
        finally:
            release.set()
        return sock

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve_config(model_dir: Path, **fields: Any) -> ServeConfig:
    return ServeConfig(str(model_dir), api_key=API_KEY, engine_kwargs=dict(SERVER_ENGINE), **fields)
