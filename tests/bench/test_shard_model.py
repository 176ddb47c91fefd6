"""bench/shard_model.py's arithmetic: F and O from a run's CPU per pod, the modelled ceiling."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "shard_model.py"


def load():
    spec = importlib.util.spec_from_file_location("shard_model_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_follow_and_own_costs_come_from_the_follower_and_the_shards_sum():
    model = load()
    cpu = {"shard-0": 0.9, "shard-1": 0.7, "follower": 0.4, "binder": 2.0, "kube-apiserver": 5.0}
    follow, own = model.split_costs(2, cpu)
    assert follow == 0.4 and own == pytest.approx(1.6 - 0.8)
    with pytest.raises(ValueError, match="follower"):
        model.split_costs(1, {"shard-0": 1.0})


def test_the_ceiling_is_one_over_f_plus_o_over_n():
    model = load()
    # the figures: F 0.4 ms and O 0.5 ms give 1,111 pods/s at one shard, under 2,500 at any
    assert model.ceiling(0.4, 0.5, 1) == pytest.approx(1000 / 0.9)
    assert model.ceiling(0.4, 0.5, 1000) < 2500
    assert model.ceiling(0.1, 0.5, 1000) == pytest.approx(1000 / 0.1005)  # F = 0.1: towards 10,000
