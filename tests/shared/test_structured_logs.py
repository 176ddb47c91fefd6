"""JSON log lines and the --log-format flag."""

import argparse
import io
import json
import logging

import pytest

from draplane.structured_logs import (
    JsonLineFormatter, add_log_format_argument, check_log_format, configure_logging, fields, with_fields,
)


def _json_lines(emit) -> list[dict]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLineFormatter())
    logger = logging.getLogger("draplane_test_structured_logs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_named_objects_as_fields():
    (line,) = _json_lines(lambda log: log.info("pod %s bound to node %s", "ns/p", "n1",
                                                extra=fields(pod="ns/p", node="n1", claim="ns/c", shard=0)))
    assert line["message"] == "pod ns/p bound to node n1"
    assert (line["pod"], line["node"], line["claim"], line["shard"]) == ("ns/p", "n1", "ns/c", 0)
    assert line["level"] == "info" and line["logger"] == "draplane_test_structured_logs"
    assert line["time"].endswith("Z") and len(line["time"]) == len("2026-01-01T00:00:00.000Z")


def test_fields_not_given_are_left_out_and_an_adapter_adds_its_own_to_the_call_s():
    def emit(log):
        log.info("nothing named")
        shard_log = with_fields(log, shard=3)
        shard_log.warning("placed", extra=fields(pod="ns/p"))

    plain, placed = _json_lines(emit)
    assert not {"pod", "node", "claim", "shard"} & plain.keys()
    assert (placed["shard"], placed["pod"], placed["level"]) == (3, "ns/p", "warning")


def test_a_traceback_is_one_string_field_and_an_odd_value_is_written_as_text():
    def emit(log):
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            log.exception("failed", extra={"node": object()})

    (line,) = _json_lines(emit)
    assert "RuntimeError: boom" in line["exception"] and line["message"] == "failed"
    assert line["node"].startswith("<object object")


def test_an_unknown_log_format_is_refused_with_the_choices(capsys):
    parser = argparse.ArgumentParser(prog="draplane-binder")
    add_log_format_argument(parser)
    assert parser.parse_args([]).log_format == "text"
    assert parser.parse_args(["--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--log-format", "xml"])
    assert exit_.value.code == 2
    assert "argument --log-format: invalid choice: 'xml' (choose from 'json', 'text')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown log format 'yaml': use one of json, text"):
        check_log_format("yaml")
    with pytest.raises(ValueError):
        configure_logging("yaml")


def test_configure_logging_replaces_the_root_handler():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("json", logging.DEBUG)
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonLineFormatter) and root.level == logging.DEBUG
        configure_logging("text")
        (handler,) = root.handlers
        assert not isinstance(handler.formatter, JsonLineFormatter) and root.level == logging.INFO
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_error_text_names_an_exception_that_says_nothing():
    from draplane.structured_logs import error_text

    assert error_text(TimeoutError()) == "TimeoutError"  # logged "fetching snapshots failed ()" before
    assert error_text(ConnectionRefusedError(111, "Connection refused")) == "[Errno 111] Connection refused"
