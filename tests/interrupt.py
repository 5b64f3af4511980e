"""Stopping a command the way Ctrl-C does, once it has reached a given point."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable


def interrupted_once(ready: Callable[[], bool], run: Callable[[], int]) -> int:
    """``run()`` while a thread sends this process SIGINT as soon as ``ready()`` holds (polled
    every 10 ms, for at most 120 s); ``run()``'s exit code."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if ready():
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = run()
    watcher.join()
    return code
