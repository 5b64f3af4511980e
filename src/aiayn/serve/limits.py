"""What one ``aiayn serve`` accepts: the limits that bound its memory and time (no web
framework here, so the command line can state them without importing one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aiayn.errors import ConfigError


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts (every field bounds memory or time).

    Attributes:
        max_body_bytes: request body size (413).
        max_lines: lines per ``/translate`` request (413).
        max_chars: characters per line or sentence (413).
        max_attention_tokens: subword tokens of an ``/attention`` source or target: the
            answer holds N * h * (S^2 + T^2 + T*S) weights (413).
        max_concurrent: requests being answered at once, queued ones included (429).
        max_queue_lines: lines waiting to be batched (429).
        max_batch_lines: lines decoded together.
        max_wait_ms: how long a request waits for others to share its batch.
        max_beam: the largest beam a request may ask for (422).
    """

    max_body_bytes: int = 65536
    max_lines: int = 32
    max_chars: int = 1000
    max_attention_tokens: int = 64
    max_concurrent: int = 64
    max_queue_lines: int = 256
    max_batch_lines: int = 64
    max_wait_ms: float = 10.0
    max_beam: int = 16

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0 and not (name == "max_wait_ms" and value == 0):
                raise ConfigError(f"serve limit {name} must be > 0, got {value}")
        if self.max_lines > self.max_queue_lines:
            raise ConfigError(f"max_lines={self.max_lines} exceeds max_queue_lines="
                             f"{self.max_queue_lines}: such a request could never be queued")
        if self.max_lines > self.max_batch_lines:
            raise ConfigError(f"max_lines={self.max_lines} exceeds max_batch_lines="
                             f"{self.max_batch_lines}: such a request would not fit one batch")
