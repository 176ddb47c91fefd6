"""Fuzzing `draplane allocate` with the files a user could give it.

Property: exit 0 (allocated) or 1 (cannot be allocated), or an InputError of one line that becomes
exit 2; never the "internal error" fallback, which is draplane failing on input it should have
named. Counts: see tests/fuzzing.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from pathlib import Path

from hypothesis import example, given

from draplane.cli import allocate
from fuzzing import bounded, fuzz, manifest_files


def allocate_files(contents: list[bytes], output: str = "yaml") -> int | str:
    """The exit code, or the InputError's line."""
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i, data in enumerate(contents):
            path = Path(folder) / f"input-{i}.yaml"
            path.write_bytes(data)
            paths.append(str(path))
        args = argparse.Namespace(files=paths, node=None, policy="draplane", output=output)
        out, err = io.StringIO(), io.StringIO()
        with bounded(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = allocate._run(args)  # run() would turn a bug into "internal error"; let it show
            except allocate.InputError as exc:
                message = str(exc)
                assert message and "\n" not in message and "Traceback" not in message
                return message
    assert code in (allocate.EXIT_ALLOCATED, allocate.EXIT_UNALLOCATABLE)
    return code


def test_the_valid_set_allocates():
    assert allocate_files(manifest_files_valid()) == allocate.EXIT_ALLOCATED


def manifest_files_valid() -> list[bytes]:
    from fuzzing import manifests, render

    return ["---\n".join(render(o, "yaml") for o in manifests()).encode()]


@fuzz(100)
@given(manifest_files())
@example([b"\xff\xfe not UTF-8"])  # UnicodeDecodeError reached the "internal error" fallback
@example([b"kind: List\napiVersion: v1\nitems: 5"])
def test_allocate_answers_every_input(contents):
    allocate_files(contents)
