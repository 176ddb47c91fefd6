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


@pytest.mark.parametrize("pace", ["-1", "501", "nan"])
def test_follow_pace_out_of_range_exits_2_naming_the_flag(capsys, pace):
    assert allocator_main(["--follow-pace-ms", pace]) == 2
    assert f"--follow-pace-ms {float(pace):g} is outside 0..500" in capsys.readouterr().err


def test_follow_pace_is_off_by_default_and_a_pace_is_taken():
    assert build_parser().parse_args([]).follow_pace_ms == 0.0
    assert build_parser().parse_args(["--follow-pace-ms", "150"]).follow_pace_ms == 150.0


def test_binder_settings_from_flags():
    settings = settings_from(binder_parser().parse_args(
        ["--scheduler-name", "draplane", "--scheduler-name", "default-scheduler", "--no-manage-claims", "--shards", "4"]))
    assert settings.scheduler_names == ("draplane", "default-scheduler")
    assert settings.manage_claims is False and settings.shards == 4
    assert settings_from(binder_parser().parse_args([])).scheduler_names == ("draplane",)


def test_follow_pace_from_the_environment_is_checked_as_the_flag_is(monkeypatch, capsys):
    monkeypatch.setenv("DRAPLANE_FOLLOW_PACE_MS", "5")
    assert build_parser().parse_args([]).follow_pace_ms == 5.0
    monkeypatch.setenv("DRAPLANE_FOLLOW_PACE_MS", "fast")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([])
    assert exit_.value.code == 2
    assert "--follow-pace-ms: invalid float value: 'fast'" in capsys.readouterr().err
