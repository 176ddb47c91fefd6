from fractions import Fraction

import pytest

from draplane.api.quantity import QuantityError, parse_quantity


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("40Gi", "40Gi"),
        ("1.5Gi", "1536Mi"),
        ("2048Ki", "2Mi"),
        ("0.5", "500m"),
        ("1.5", "1500m"),
        ("1000", "1k"),
        ("1500", "1500"),
        ("100m", "100m"),
        ("512", "512"),  # binary quantities under 1024 are written in decimal
        ("0", "0"),
        ("-1Gi", "-1Gi"),
        ("1e3", "1e3"),
        ("80G", "80G"),
    ],
)
def test_canonical_form_matches_kubernetes(text, canonical):
    assert str(parse_quantity(text)) == canonical


def test_comparison_is_exact_across_suffixes():
    assert parse_quantity("1Gi") == parse_quantity("1024Mi")
    assert parse_quantity("1k") == parse_quantity("1000")
    assert parse_quantity("40Gi") > parse_quantity("40G")
    assert parse_quantity("80Gi") > parse_quantity("40Gi")
    assert parse_quantity("100m").value == Fraction(1, 10)


def test_precision_beyond_nano_rounds_up():
    assert parse_quantity("0.0000000001").value == Fraction(1, 10**9)


@pytest.mark.parametrize("bad", ["", "Gi", "1.2.3", "10 Gi", "1Gb", "abc", " 1"])
def test_invalid_quantities_are_rejected(bad):
    with pytest.raises(QuantityError):
        parse_quantity(bad)


@pytest.mark.parametrize("text, words", [
    ("3" * 12_000, "12000 digits"),  # int()'s conversion limit: a ValueError escaped validation
    ("1e1001", "exponent"),
    ("1e-1001", "exponent"),
    ("1e99999999999", "exponent"),  # 1e9999999 took 12 s
])
def test_quantities_too_large_to_handle_exactly_are_refused(text, words):
    with pytest.raises(QuantityError, match=words):
        parse_quantity(text)


def test_the_largest_quantities_read_still_format():
    assert str(parse_quantity("1e1000")) == "10e999"  # exponents in multiples of three, as Kubernetes writes them
    assert len(str(parse_quantity("9" * 1000 + "E"))) == 1001
