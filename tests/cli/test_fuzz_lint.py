"""Fuzzing `draplane lint` with the files a user could give it.

Property: exit 0, 1 or 2 with the problems printed (as text and as JSON); never an exception, never
a hang. Counts: see tests/fuzzing.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

from hypothesis import example, given

from draplane.cli import lint
from fuzzing import bounded, fuzz, manifest_files


def lint_files(contents: list[bytes], output: str) -> int:
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i, data in enumerate(contents):
            path = Path(folder) / f"input-{i}.yaml"
            path.write_bytes(data)
            paths.append(str(path))
        args = argparse.Namespace(files=paths, output=output, admin_access=False)
        out, err = io.StringIO(), io.StringIO()
        with bounded(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = lint.run(args)
    assert code in (0, 1, 2)
    if output == "json":
        problems = json.loads(out.getvalue())
        assert all(p["message"] and p["kind"] for p in problems)
        assert (code == 1) == bool(problems) or code == 2
    if code == 2:
        assert "draplane lint: " in err.getvalue()
    return code


@fuzz(60)
@given(manifest_files())
@example([b"\xff\xfe not UTF-8"])
@example([b"kind: List\napiVersion: v1\nitems: 5"])
@example([b"apiVersion: resource.k8s.io/v1\nkind: [ResourceClaim]\nmetadata: {name: x}"])
@example([b"apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  resourceClaims: [{name: c, resourceClaimName: c}]\n"
          b"  containers: [{name: x, resources: {claims: [{name: [c]}]}}]"])  # TypeError: unhashable list
def test_lint_answers_every_input_in_text(contents):
    lint_files(contents, "text")


@fuzz(40)
@given(manifest_files())
def test_lint_answers_every_input_in_json(contents):
    lint_files(contents, "json")
