"""Semantic versions with blang/semver's rules, as Kubernetes' CEL semver library uses them."""

from __future__ import annotations

import pytest

from draplane.cel.semver import SemverError, parse_semver, parse_semver_normalized


@pytest.mark.parametrize(
    "lower, higher",
    [
        ("1.0.0", "2.0.0"),
        ("1.9.0", "1.10.0"),
        ("1.0.9", "1.0.10"),
        ("1.0.0-alpha", "1.0.0"),
        ("1.0.0-alpha", "1.0.0-alpha.1"),
        ("1.0.0-alpha.1", "1.0.0-alpha.beta"),
        ("1.0.0-alpha.beta", "1.0.0-beta"),
        ("1.0.0-beta.2", "1.0.0-beta.11"),
        ("1.0.0-beta.11", "1.0.0-rc.1"),
        ("1.0.0-2", "1.0.0-a"),
    ],
)
def test_ordering(lower, higher):
    assert parse_semver(lower) < parse_semver(higher)
    assert parse_semver(lower).compare(parse_semver(higher)) == -1
    assert parse_semver(higher).compare(parse_semver(lower)) == 1


def test_build_metadata_is_ignored_by_equality_and_hash():
    assert parse_semver("1.0.0+a") == parse_semver("1.0.0+b") == parse_semver("1.0.0")
    assert hash(parse_semver("1.0.0+a")) == hash(parse_semver("1.0.0"))
    assert str(parse_semver("1.2.3-rc.1+build.5")) == "1.2.3-rc.1+build.5"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "Version string empty"),
        ("1.2", "No Major.Minor.Patch elements found"),
        ("v1.2.3", 'Invalid character(s) found in major number "v1"'),
        ("01.2.3", 'Major number must not contain leading zeroes "01"'),
        ("1.02.3", 'Minor number must not contain leading zeroes "02"'),
        ("1.2.03", 'Patch number must not contain leading zeroes "03"'),
        ("1.2.3-", "Prerelease is empty"),
        ("1.2.3-01", 'Numeric PreRelease version must not contain leading zeroes "01"'),
        ("1.2.3-a_b", 'Invalid character(s) found in prerelease "a_b"'),
        ("1.2.3+", "Build meta data is empty"),
        ("1.2.3+a_b", 'Invalid character(s) found in build meta data "a_b"'),
        ("1.2.x", 'Invalid character(s) found in patch number "x"'),
    ],
)
def test_parse_errors_have_blang_messages(text, message):
    with pytest.raises(SemverError) as caught:
        parse_semver(text)
    assert str(caught.value) == message


def test_normalized_parsing():
    assert parse_semver_normalized("v1.2") == parse_semver("1.2.0")
    assert parse_semver_normalized("01.02.03") == parse_semver("1.2.3")
    assert parse_semver_normalized("1") == parse_semver("1.0.0")
    with pytest.raises(SemverError, match="short version cannot contain PreRelease/Build meta data"):
        parse_semver_normalized("1.2-rc")
