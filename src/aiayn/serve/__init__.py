"""``aiayn serve``: translations and attention over HTTP, batched, bounded, with a web page.

``create_app`` is imported on first use, so that ``ServeLimits`` (and the command line that
states them) does not need the web framework."""

from __future__ import annotations

from typing import Any

from aiayn.serve.limits import ServeLimits

__all__ = ["ServeLimits", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from aiayn.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'aiayn.serve' has no attribute {name!r}")
