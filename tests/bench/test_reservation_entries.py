"""bench/reservation_entries.py: both ways read every write the same, and the script prints its lines."""

from __future__ import annotations

import subprocess
import sys

from bench_scripts import BENCH, load

from draplane.scheduling import reservations as rv


def test_both_ways_read_each_write_as_written():
    bench = load("reservation_entries")
    data = bench.writes(claims=6, pods=3)
    decoder = rv.EntryDecoder()
    for value in data:
        assert decoder.decode(value, bench.NODE) == rv.decode_entry(value, bench.NODE)
    last = rv.decode_entry(data[-1], bench.NODE)
    assert len(last.claims) == 6 and len(last.pods) <= 4
    assert all(r.confirmed for r in last.claims.values())


def test_the_script_prints_both_ways_and_refuses_bad_arguments():
    script = str(BENCH / "reservation_entries.py")
    result = subprocess.run([sys.executable, script, "--claims", "3", "--pods", "2", "--rounds", "1", "--repeat", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    assert [line.split()[2] for line in lines[:2]] == ["way=whole", "way=changed"]
    assert lines[2].startswith("BENCH name=reservation_entries_ratio whole_over_changed=")
    refused = subprocess.run([sys.executable, script, "--claims", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--claims must be at least 1" in refused.stderr
