"""``aiayn serve``: translations and attention over HTTP, batched, bounded, with a web page."""

from aiayn.serve.app import ServeLimits, create_app

__all__ = ["ServeLimits", "create_app"]
