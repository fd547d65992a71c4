"""Logging for one `lstune` invocation, configured once here and nowhere else.

The main process logs through rich to stderr at `--log-level` (DEBUG with `--debug`); other ranks of a
launched run log warnings and errors only, as plain lines tagged with their rank, so N processes do
not print N copies of every message. The training run adds a log file in its output folder
(lstune.train.outputs), which records INFO and above whatever the terminal shows.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")
_MARK = "_lstune_cli_handler"


def setup_logging(level: str = "warning", *, debug: bool = False) -> None:
    """(Re)configure the `lstune` logger; repeated calls (tests run the CLI in-process) replace the handler."""
    logger = logging.getLogger("lstune")
    for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(handler)
    console_level = logging.DEBUG if debug else getattr(logging, level.upper())
    rank = int(os.environ.get("RANK", "0") or 0)
    handler = _main_handler(debug) if rank == 0 else _rank_handler(rank)
    handler.setLevel(console_level if rank == 0 else max(console_level, logging.WARNING))
    setattr(handler, _MARK, True)
    logger.addHandler(handler)
    logger.setLevel(min(console_level, logging.INFO))  # the run's log file keeps INFO
    logger.propagate = False
    if not debug:
        from lstune.models.quant import quiet_cpu_kernel_warning

        quiet_cpu_kernel_warning()


def _main_handler(debug: bool) -> logging.Handler:
    from rich.console import Console
    from rich.logging import RichHandler

    return RichHandler(console=Console(stderr=True), show_path=debug, markup=False, rich_tracebacks=False,
                       show_time=debug)


def _rank_handler(rank: int) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    return handler
