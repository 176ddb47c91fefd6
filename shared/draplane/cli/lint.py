"""`draplane lint FILE...`: check DRA objects as the resource.k8s.io/v1 apiserver would.

For each problem it prints the object, the field and a fix. Exit 0 when every object is valid, 1 when
problems were found, 2 when a file cannot be read or parsed at all (the other files are still checked).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any, TextIO

import msgspec
import yaml

from draplane.api.codec import load_yaml_documents
from draplane.validation import Problem, is_checked, object_identity, validate_objects


class UnreadableFile(Exception):
    """A file that is missing, unreadable, or not YAML/JSON at all."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lint",
        help="check DRA objects as the v1 apiserver would, with fixes",
        description="Check DeviceClass, ResourceSlice, ResourceClaim, ResourceClaimTemplate and DeviceTaintRule "
        "objects (and the DRA parts of Pods) the way the resource.k8s.io/v1 apiserver validates them: schema, names, limits, "
        "CEL compile and type errors. Objects of other API groups (Namespaces, Deployments) are passed over; a "
        "Namespace labeled resource.kubernetes.io/admin-access=true allows adminAccess for its claims. Each problem names the object and the field and suggests a fix. "
        "Exit 0: no problems; 1: problems found; 2: a file could not be read or parsed.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="YAML or JSON files (multi-document, List kinds allowed), folders of them, or - for stdin")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text for people (default), json for scripts: a list of problems")
    parser.add_argument("--admin-access", action="store_true",
                        help="the claims' namespace is labeled resource.kubernetes.io/admin-access=true, "
                             "so adminAccess: true is allowed")
    parser.set_defaults(handler=run)


MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def expand_paths(paths: list[str]) -> list[str]:
    """Folders stand for the manifests directly in them, in name order; everything else as given."""
    expanded = []
    for path in paths:
        folder = Path(path)
        if path != "-" and folder.is_dir():
            expanded.extend(str(p) for p in sorted(folder.iterdir()) if p.suffix in MANIFEST_SUFFIXES and p.is_file())
        else:
            expanded.append(path)
    return expanded


def read_documents(path: str) -> list[tuple[str, Any]]:
    """(source, raw document) pairs; `List` kinds are flattened so each item is checked on its own."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UnreadableFile(f"{path}: cannot read: {reason}") from None
    if path == "-":
        path = "<stdin>"
    try:
        documents = load_yaml_documents(text)
    except yaml.YAMLError as exc:
        raise UnreadableFile(f"{path}: not valid YAML or JSON: {' '.join(str(exc).split())}") from None
    pairs: list[tuple[str, Any]] = []
    for index, document in enumerate(documents):
        source = path if len(documents) == 1 else f"{path} (document {index + 1})"
        items = document.get("items") if isinstance(document, dict) else None
        if isinstance(document, dict) and str(document.get("kind", "")).endswith("List") and isinstance(items, list):
            pairs.extend((f"{source} items[{i}]", item) for i, item in enumerate(items))
        else:
            pairs.append((source, document))
    return pairs


def lint_files(paths: list[str], *, admin_access: bool = False) -> tuple[list[Problem], list[str], int]:
    """(problems, unreadable-file messages, number of objects checked)."""
    problems, unreadable, checked, _ = lint_files_with_skipped(paths, admin_access=admin_access)
    return problems, unreadable, checked


def lint_files_with_skipped(paths: list[str], *, admin_access: bool = False):
    """(problems, unreadable-file messages, objects checked, "Kind name" of the objects passed over:
    kinds outside DRA, Pods and Nodes, such as the Namespaces and Deployments of a manifest folder)."""
    documents: list[tuple[str, Any]] = []
    unreadable: list[str] = []
    for path in expand_paths(paths):
        try:
            documents.extend(read_documents(path))
        except UnreadableFile as exc:
            unreadable.append(str(exc))
    skipped = [" ".join(object_identity(raw)) for _, raw in documents if not is_checked(raw)]
    # Every document goes in: a Namespace among them can allow adminAccess for its claims.
    problems = validate_objects(documents, admin_access=admin_access)
    return problems, unreadable, len(documents) - len(skipped), skipped


def format_problems(problems: list[Problem], out: TextIO) -> None:
    """Grouped by object: a header naming source, kind and name, then field, reason, message and fix."""
    current = None
    for problem in problems:
        header = (problem.source, problem.kind, problem.name)
        if header != current:
            if current is not None:
                out.write("\n")
            where = f"{problem.source}: " if problem.source else ""
            name = f" {problem.name}" if problem.name else ""
            out.write(f"{where}{problem.kind}{name}\n")
            current = header
        field = problem.field or "(document)"
        out.write(f"  {field}: {problem.reason}\n")
        out.write(_indent(problem.message, "    "))
        if problem.fix:
            lines = problem.fix.splitlines() or [""]
            out.write(f"    fix: {lines[0]}\n")
            for line in lines[1:]:
                out.write(f"         {line}\n")


def _indent(text: str, prefix: str, width: int = 100) -> str:
    lines = []
    for line in text.splitlines() or [""]:
        # CEL's caret display (" | ...") must keep its columns; prose is wrapped.
        if line.startswith(" |") or len(line) <= width:
            lines.append(f"{prefix}{line}\n")
        else:
            lines.extend(f"{prefix}{part}\n" for part in textwrap.wrap(line, width, break_on_hyphens=False))
    return "".join(lines)


def run(args: argparse.Namespace) -> int:
    problems, unreadable, checked, skipped = lint_files_with_skipped(args.files, admin_access=args.admin_access)
    for message in unreadable:
        print(f"draplane lint: {message}", file=sys.stderr)
    if args.output == "json":
        sys.stdout.write(msgspec.json.encode(problems).decode() + "\n")
    else:
        format_problems(problems, sys.stdout)
        objects_with_problems = len({(p.source, p.kind, p.name) for p in problems})
        if problems:
            print(f"\n{len(problems)} problem{'s' * (len(problems) != 1)} in {objects_with_problems} of "
                  f"{checked} object{'s' * (checked != 1)}")
        elif checked:
            print(f"{checked} object{'s' * (checked != 1)} checked: no problems")
        if skipped:
            shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            print(f"{len(skipped)} object{'s' * (len(skipped) != 1)} of other kinds not checked: {shown}")
    if unreadable:
        return 2
    return 1 if problems else 0
