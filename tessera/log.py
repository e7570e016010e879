"""structlog setup shared by every daemon: JSON lines on stderr, ISO timestamps.

Call ``setup(service, **bound)`` once at start-up; get loggers with ``get(**bound)``.
Benchmarks filter their forked runtimes' info lines with ``quiet()`` / ``restore(saved)``.
Set TESSERA_LOG_LEVEL (debug|info|warning|error) to change the level; TESSERA_LOG_FORMAT=console
for human-readable lines.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def env_level(default: int = logging.INFO) -> int:
    """The logging level TESSERA_LOG_LEVEL names; ``default`` when it is unset or names none."""
    name = os.environ.get("TESSERA_LOG_LEVEL")
    return getattr(logging, name.upper(), default) if name else default


def quiet(default: int = logging.WARNING) -> dict:
    """Filter structlog's lines below the level ``TESSERA_LOG_LEVEL`` names (``default``
    when it is unset) in this process and the processes it forks, which inherit the
    configuration: for benchmarks whose forked runtime ranks log "joined" and the like at
    info, hundreds of lines that would bury their tables. Returns the configuration it
    replaced, for :func:`restore`."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(env_level(default)))
    return saved


def restore(saved: dict) -> None:
    """Put back the structlog configuration :func:`quiet` returned (a benchmark's ``main``
    called in-process, by a test, leaves the caller's logging as it found it)."""
    structlog.configure(**saved)


def setup(service: str, **bound: object) -> structlog.stdlib.BoundLogger:
    level = env_level()
    renderer = (
        structlog.dev.ConsoleRenderer()
        if os.environ.get("TESSERA_LOG_FORMAT") == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger(service=service, **bound)


def get(**bound: object):
    return structlog.get_logger(**bound)
