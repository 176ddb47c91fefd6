"""The services' logs: one JSON object per line in a cluster, plain text on a developer's terminal.

Every service takes `--log-format json|text` (default text; deploy/ sets json). A line about one
claim, pod, node, shard or gang (a PodGroup) carries it as a field of its own, so a log pipeline
can select all that happened to `ns/pod` without parsing sentences:

    log.info("pod %s bound to node %s", key, node, extra=fields(pod=key, node=node, shard=3))
    {"time": "2026-05-01T12:00:00.123Z", "level": "info", "logger": "draplane_binder.service",
     "message": "pod ns/p bound to node n1", "pod": "ns/p", "node": "n1", "shard": 3}

`with_fields(logger, shard=3)` gives a logger that adds the same fields to every line (a shard's
logs all name their shard). The text format leaves the fields out: its messages already name them.
"""

from __future__ import annotations

import argparse
import datetime
import logging
from typing import Any

import msgspec

LOG_FORMATS = ("json", "text")
# The fields a line may carry beside its message, in the order a JSON line lists them.
FIELDS = ("claim", "pod", "node", "shard", "gang")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A field holding something JSON has no word for is still written, as its text.
_encoder = msgspec.json.Encoder(enc_hook=str)


def fields(*, claim: str | None = None, pod: str | None = None, node: str | None = None,
           shard: int | None = None, gang: str | None = None) -> dict[str, Any]:
    """`extra=` for a log call: the named objects (`gang`: a PodGroup's namespace/name), leaving out
    those not given."""
    given = {"claim": claim, "pod": pod, "node": node, "shard": shard, "gang": gang}
    return {name: value for name, value in given.items() if value is not None}


class FieldsAdapter(logging.LoggerAdapter):
    """A logger that adds fixed fields to every line; a call's own `extra=` adds to them (the
    standard LoggerAdapter would replace the call's with its own)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return msg, kwargs


def error_text(exc: BaseException) -> str:
    """An exception as a log line says it: its message, or its type where it has none (a bare
    TimeoutError printed "failed (); retrying")."""
    return str(exc) or type(exc).__name__


def with_fields(logger: logging.Logger, **given: Any) -> FieldsAdapter:
    return FieldsAdapter(logger, fields(**given))


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, milliseconds), level, logger, message, the fields
    the record carries, and the traceback as one string under `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return _encoder.encode(line).decode()


def _utc_time(created: float) -> str:
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def add_log_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="json: one JSON object per line, with claim, pod, node and shard as fields "
                             "(deploy/ sets it); text: for a terminal (default %(default)s)")


def check_log_format(value: str) -> str:
    """The format, or a ValueError naming the choices (argparse checks the flag itself)."""
    if value not in LOG_FORMATS:
        raise ValueError(f"unknown log format {value!r}: use one of {', '.join(LOG_FORMATS)}")
    return value


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """The root logger writes to stderr in `log_format`, replacing any handler already there: a
    library that logged while the service started has given the root a WARNING-level one, which
    would silently drop every INFO line."""
    check_log_format(log_format)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
