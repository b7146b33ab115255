"""A server in a child process, for tests and benchmarks (as vLLM's tests' ``RemoteOpenAIServer``):
started on 127.0.0.1 and a free port, ready once ``/health`` answers 200, stopped with SIGTERM
(SIGKILL after ``stop_s``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pagedpack.host.child_process import free_port


def pagedpack_serve_command(*args: str, port: int, log_level: str = "warning") -> list[str]:
    """``pagedpack serve ARGS`` on 127.0.0.1:``port``, run by this Python."""
    return [sys.executable, "-m", "pagedpack.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", log_level]


class RemoteServer:
    """``command(port)`` (the argument list of a server listening on 127.0.0.1:``port``) in a child
    process whose output goes to ``log_path``; ``url``, ``log``. ``with RemoteServer(...) as s``
    waits until ``/health`` answers 200 (at most ``start_s``; ``RuntimeError`` with the log's end if
    the server exits or never answers) and stops it on leaving."""

    def __init__(self, command: Callable[[int], list[str]], *, log_path, start_s: float = 300.0,
                 env: dict | None = None, stop_s: float = 30.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.start_s, self.stop_s = Path(log_path), start_s, stop_s
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def __enter__(self) -> "RemoteServer":
        import httpx

        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {self.start_s} s:\n{self.log[-3000:]}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGTERM, SIGKILL after ``stop_s``; the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode
