"""How the training loop tells the outside world what it does, without knowing about terminals.

The CLI implements `Reporter` with rich; tests and library users can pass `LogReporter` or their own.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

log = logging.getLogger("lstune")


class Reporter(Protocol):
    def start(self, plan: dict[str, Any]) -> None:
        """The resolved run: model, data summary, techniques, steps, output folder."""

    def note(self, text: str) -> None:
        """Something the user should know (a fallback taken, a checkpoint written)."""

    def step(self, metrics: dict[str, Any]) -> None:
        """One optimizer step's metrics (the same record as metrics.jsonl)."""

    def end(self, result: Any) -> None:
        """The run is over (finished or interrupted)."""


class LogReporter:
    """Reports through the `lstune` logger; the default for library use."""

    def start(self, plan: dict[str, Any]) -> None:
        log.info("plan: %s", plan)

    def note(self, text: str) -> None:
        log.info("%s", text)

    def step(self, metrics: dict[str, Any]) -> None:
        log.info("step %s loss %.4f", metrics["step"], metrics["loss"])

    def end(self, result: Any) -> None:
        log.info("done: %s", result)
