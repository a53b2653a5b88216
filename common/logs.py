"""Logging set-up shared by the CLI and the long-lived actors (the supervisor, whose messages an operator reads
in `kvgrid serve`'s output): records to stderr, kvgrid's own loggers from INFO, other libraries' from WARNING
(httpx logs every request at INFO)."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
KVGRID_LOGGERS = ("router", "worker", "common", "kvgrid")


def configure_logging() -> None:
    """Once per process: a root logger that has handlers already is left alone."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    for name in KVGRID_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
