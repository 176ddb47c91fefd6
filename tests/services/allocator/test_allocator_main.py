"""Command-line checks of the two service entry points: bad settings exit 2 with a reason."""

import pytest

from draplane_allocator.__main__ import build_app, build_parser, main as allocator_main
from draplane_binder.__main__ import build_parser as binder_parser, main as binder_main, settings_from


def test_shard_counts_are_checked(capsys):
    assert allocator_main(["--shards", "0"]) == 2
    assert "--shards must be at least 1" in capsys.readouterr().err
    assert binder_main(["--shards", "0"]) == 2
    with pytest.raises(SystemExit, match="--shard-index 4 is outside 0..3"):
        build_app(build_parser().parse_args(["--shards", "4", "--shard-index", "4"]))


def test_binder_settings_from_flags():
    settings = settings_from(binder_parser().parse_args(
        ["--scheduler-name", "draplane", "--scheduler-name", "default-scheduler", "--no-manage-claims", "--shards", "4"]))
    assert settings.scheduler_names == ("draplane", "default-scheduler")
    assert settings.manage_claims is False and settings.shards == 4
    assert settings_from(binder_parser().parse_args([])).scheduler_names == ("draplane",)
