"""resource.Quantity as Kubernetes' CEL quantity library sees it: forms, arithmetic, parsing."""

from __future__ import annotations

import pytest

from draplane.api.quantity import QuantityError, parse_quantity
from draplane.cel.kube_quantity import kube_quantity_of, parse_kube_quantity


@pytest.mark.parametrize(
    "text, as_int64",
    [
        ("1", 1), ("1k", 1000), ("1.5k", 1500), ("12.345k", 12345), ("1Ki", 1024), ("1e3", 1000),
        ("1.23456789e10", 12345678900), ("8E", 8 * 10**18), ("0", 0), ("-1", -1), ("k", 0),
        ("1.0", None), ("1000m", None), ("1.5", None), ("100n", None), ("0.5Ki", None), ("0.0", None),
        ("9223372036854775807", None), ("16Ei", None),
    ],
)
def test_integer_answers_follow_the_representation(text, as_int64):
    assert parse_kube_quantity(text).as_int64() == as_int64


def test_add_and_sub_keep_the_smaller_scale_and_return_pointers():
    one_and_half = parse_kube_quantity("1.5")
    total = one_and_half.add(one_and_half)
    assert total.value == 3 and total.as_int64() is None and total.pointer
    assert parse_kube_quantity("1").add(parse_kube_quantity("1")).as_int64() == 2
    assert parse_kube_quantity("1k").sub(parse_kube_quantity("1")).as_int64() == 999
    # int64 overflow moves to the arbitrary-precision form, which is never an integer.
    assert parse_kube_quantity("9223372036854775807").add(parse_kube_quantity("1")).as_int64() is None


def test_approximate_float_multiplies_like_go():
    assert parse_kube_quantity("0.3").as_approximate_float() == 3 * 0.1  # 0.30000000000000004
    assert parse_kube_quantity("1.5").as_approximate_float() == 1.5
    assert parse_kube_quantity("1Gi").as_approximate_float() == 2.0**30


def test_binary_values_above_int64_are_clamped():
    assert parse_kube_quantity("16Ei").value == 2**63 - 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "quantities must match the regular expression"),
        ("1 ", "quantities must match the regular expression"),
        ("1..2", "quantities must match the regular expression"),
        ("1ki", "unable to parse quantity's suffix"),
        ("1e", "unable to parse quantity's suffix"),
        ("Ei", "unable to parse numeric part of quantity"),
    ],
)
def test_parse_errors_have_kubernetes_messages(text, message):
    with pytest.raises(QuantityError, match=message):
        parse_kube_quantity(text)


def test_capacity_values_use_the_canonical_form_the_apiserver_stores():
    # "1000m" written in a ResourceSlice is stored, and read by the scheduler, as "1".
    assert kube_quantity_of(parse_quantity("1000m")).as_int64() == 1
    assert kube_quantity_of(parse_quantity("1500m")).as_int64() is None
    assert kube_quantity_of(parse_quantity("80Gi")).as_int64() == 80 * 2**30
