"""A sample as everything after reading sees it: chat messages, the scalar columns carried into the
output, or why its row could not be read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    index: int
    messages: list[dict[str, str]]
    carried: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the row could not be read (on_error="skip")
