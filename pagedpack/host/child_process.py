"""What the child processes pagedpack starts share: dying with their parent (Linux
``prctl(PR_SET_PDEATHSIG)``) and a free local port to meet on."""
from __future__ import annotations

import ctypes
import os
import signal
import socket

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess``: the child gets ``sig`` when this process dies, from
    before its first instruction (the flag is set between fork and exec, and exec keeps it); a
    parent already gone by then ends the child at once. Elsewhere than Linux, nothing."""
    parent = os.getpid()

    def preexec() -> None:
        exit_with_parent(parent, sig)

    return preexec


def exit_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child of ``parent`` (a pid): get ``sig`` when the parent dies; a parent already gone ends
    the child at once. Elsewhere than Linux, nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the flag was set
        os._exit(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
