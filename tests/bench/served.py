"""`lmd serve`'s app over a started engine, on a free local port in a background thread (uvicorn, as the command
runs it), for the HTTP benchmark tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

MODEL = "tiny"


@contextlib.contextmanager
def served(engine: Any, api_keys: tuple[str, ...] = ()) -> Iterator[str]:
    """The base URL of `engine` served as MODEL until the block ends."""
    import uvicorn

    from lmd.serve.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine, MODEL, api_keys), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
