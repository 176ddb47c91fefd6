"""Semantic versions as Kubernetes' CEL semver library sees them (github.com/blang/semver/v4).

Version attributes of devices and `semver("...")` in selectors are compared with these rules:
major, minor and patch numerically, a release above any of its pre-releases, pre-release
identifiers numerically when both are numeric, numeric below alphanumeric, and build metadata
ignored — also by equality.
"""

from __future__ import annotations

from functools import lru_cache, total_ordering

_NUMBERS = frozenset("0123456789")
_ALPHANUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789")
_MAX_UINT64 = 2**64 - 1


class SemverError(ValueError):
    pass


def _only(text: str, allowed: frozenset[str]) -> bool:
    return all(ch in allowed for ch in text)


def _number(text: str, what: str) -> int:
    if not _only(text, _NUMBERS):
        raise SemverError(f"Invalid character(s) found in {what} number {_go_quote(text)}")
    if len(text) > 1 and text[0] == "0":
        raise SemverError(f"{what.capitalize()} number must not contain leading zeroes {_go_quote(text)}")
    if not text:
        # strconv.ParseUint on an empty string.
        raise SemverError('strconv.ParseUint: parsing "": invalid syntax')
    value = int(text)
    if value > _MAX_UINT64:
        raise SemverError(f'strconv.ParseUint: parsing "{text}": value out of range')
    return value


def _go_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@total_ordering
class Semver:
    """An immutable, hashable semantic version. Equal when blang/semver's Compare says 0."""

    __slots__ = ("major", "minor", "patch", "pre", "build", "_key", "_hash")

    def __init__(self, major: int, minor: int, patch: int, pre: tuple[int | str, ...] = (), build: tuple[str, ...] = ()):
        self.major = major
        self.minor = minor
        self.patch = patch
        self.pre = pre
        self.build = build
        # A release sorts above its pre-releases; numeric identifiers sort below alphanumeric ones.
        pre_key = tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in pre)
        self._key = (major, minor, patch, 0 if pre else 1, pre_key)
        self._hash = hash(self._key)

    @classmethod
    def parse(cls, text: str) -> "Semver":
        return parse_semver(text)

    def compare(self, other: "Semver") -> int:
        return (self._key > other._key) - (self._key < other._key)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Semver):
            return self._key == other._key
        return NotImplemented

    def __lt__(self, other: "Semver") -> bool:
        return self._key < other._key

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.pre:
            text += "-" + ".".join(str(p) for p in self.pre)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self) -> str:
        return f"Semver({str(self)!r})"


@lru_cache(maxsize=4096)
def parse_semver(text: str) -> Semver:
    """Strict semver 2.0.0, with blang/semver's error messages."""
    if not isinstance(text, str):
        raise SemverError(f"semantic version must be a string, got {type(text).__name__}")
    if not text:
        raise SemverError("Version string empty")
    parts = text.split(".", 2)
    if len(parts) != 3:
        raise SemverError("No Major.Minor.Patch elements found")
    major = _number(parts[0], "major")
    minor = _number(parts[1], "minor")
    rest = parts[2]
    build: list[str] = []
    pre_texts: list[str] = []
    if "+" in rest:
        rest, build_text = rest.split("+", 1)
        build = build_text.split(".")
    if "-" in rest:
        rest, pre_text = rest.split("-", 1)
        pre_texts = pre_text.split(".")
    patch = _number(rest, "patch")
    pre: list[int | str] = []
    for identifier in pre_texts:
        if not identifier:
            raise SemverError("Prerelease is empty")
        if _only(identifier, _NUMBERS):
            if len(identifier) > 1 and identifier[0] == "0":
                raise SemverError(f"Numeric PreRelease version must not contain leading zeroes {_go_quote(identifier)}")
            pre.append(int(identifier))
        elif _only(identifier, _ALPHANUM):
            pre.append(identifier)
        else:
            raise SemverError(f"Invalid character(s) found in prerelease {_go_quote(identifier)}")
    for identifier in build:
        if not identifier:
            raise SemverError("Build meta data is empty")
        if not _only(identifier, _ALPHANUM):
            raise SemverError(f"Invalid character(s) found in build meta data {_go_quote(identifier)}")
    return Semver(major, minor, patch, tuple(pre), tuple(build))


def parse_semver_normalized(text: str) -> Semver:
    """`semver(text, true)`: a leading "v" dropped, leading zeroes trimmed, missing minor/patch set to 0."""
    if text.startswith("v"):
        text = text[1:]
    parts = text.split(".", 2)
    for index, part in enumerate(parts):
        if len(part.encode()) > 1:  # Go's len() counts bytes
            part = part.lstrip("0")
            if not part or part[0] not in _NUMBERS:
                part = "0" + part
            parts[index] = part
    if len(parts) < 3:
        if "+" in parts[-1] or "-" in parts[-1]:
            raise SemverError("short version cannot contain PreRelease/Build meta data")
        parts.extend(["0"] * (3 - len(parts)))
    return parse_semver(".".join(parts))
