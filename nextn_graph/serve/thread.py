"""A server on a background thread of this process (the serving benchmark, tests):
started on an ephemeral loopback port, ready once the engine is captured. Its engine
runs where ``settings.engine`` says: a process of its own (``spawn``ed from this one: a
script that starts one keeps its top level under ``if __name__ == "__main__":``), or a
thread of this process."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Callable

from ..config import RunConfig
from ..errors import NextnGraphError
from ..runtime.engine import SpecEngine
from .command import make_server
from .front.limits import ServeSettings


class ServerThread:
    """``with ServerThread(cfg, settings) as s:`` -> ``s.url``, ``s.state`` (the app's
    ``ServerState``: its worker, its host and metrics)."""

    def __init__(self, cfg: RunConfig, settings: ServeSettings, plain: bool = False,
                 start_timeout_s: float = 300.0,
                 prepare: Callable[[SpecEngine], None] | None = None):
        if settings.host != "127.0.0.1":
            raise NextnGraphError("ServerThread serves on loopback (127.0.0.1) only")
        self.server = make_server(cfg, settings, log_level="warning", plain=plain,
                                  prepare=prepare)
        self.state = self.server.config.app.state.serve
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.start_timeout_s = start_timeout_s
        self.url = ""

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            self._wait(deadline)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while self.state.worker.info is None:
            if self.state.worker.failed:
                self.close()
                raise NextnGraphError(f"the engine failed to start: {self.state.worker.failed}")
            self._wait(deadline)
        return self

    def _wait(self, deadline: float) -> None:
        if time.monotonic() > deadline or not self._thread.is_alive():
            self.close()
            raise NextnGraphError("the server did not start in time")
        time.sleep(0.02)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(60)

    def __exit__(self, *exc) -> None:
        self.close()
