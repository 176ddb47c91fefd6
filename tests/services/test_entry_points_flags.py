"""What every service's entry point says to bad flags, and to missing NATS credentials, before it
connects to anything."""

import argparse
import os
import subprocess
import sys

import pytest

from draplane import natsauth
from draplane.entrypoints import nats_credentials_problem

from draplane_allocator.__main__ import main as allocator_main
from draplane_audit.__main__ import main as audit_main
from draplane_binder.__main__ import main as binder_main
from draplane_inventory.__main__ import main as inventory_main
from draplane_node_agent.__main__ import main as node_agent_main


@pytest.mark.parametrize("main", [allocator_main, binder_main, inventory_main, node_agent_main],
                         ids=["allocator", "binder", "inventory", "node-agent"])
def test_an_unknown_log_format_exits_2_naming_the_choices(main, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--node", "n1", "--log-format", "yaml"] if main is node_agent_main else ["--log-format", "yaml"])
    assert exit_.value.code == 2
    assert "argument --log-format: invalid choice: 'yaml' (choose from 'json', 'text')" in capsys.readouterr().err


ENTRY_POINTS = {
    "draplane_inventory": [],
    "draplane_allocator": [],
    "draplane_binder": [],
    "draplane_audit": [],
    "draplane_node_agent": ["--node", "gpu-1", "--profile", "l4"],
}


def _start_all(extra: list[str], env: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    # All at once: each is an interpreter start of a second or two on this machine.
    processes = {module: subprocess.Popen([sys.executable, "-m", module, "--nats=nats://127.0.0.1:9", *args, *extra],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for module, args in ENTRY_POINTS.items()}
    done = {}
    for module, process in processes.items():
        out, err = process.communicate(timeout=60)
        done[module] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def _environment_without_nats_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DRAPLANE_NATS")}


def test_a_service_without_nats_credentials_does_not_start():
    """Each entry point, as a process: exit 2 before connecting, naming the flags and variables."""
    for module, result in _start_all([], _environment_without_nats_settings()).items():
        prog = module.replace("_", "-")
        assert result.returncode == 2, (module, result.stderr)
        assert (f"{prog}: error: refusing to connect to NATS without credentials: --nkey-seed FILE (or "
                "DRAPLANE_NATS_NKEY_SEED) and TLS: --nats-ca FILE (or DRAPLANE_NATS_CA), or tls:// URLs in --nats; "
                "pass --insecure-dev to run against a development NATS without them") in result.stderr, module


MAINS = {"allocator": allocator_main, "audit": audit_main, "binder": binder_main, "inventory": inventory_main,
         "node-agent": node_agent_main}


@pytest.mark.parametrize("service", sorted(MAINS))
def test_a_seed_without_tls_or_a_missing_seed_file_is_refused_too(service, tmp_path, monkeypatch, capsys):
    for name in [k for k in os.environ if k.startswith("DRAPLANE_NATS")]:
        monkeypatch.delenv(name)
    seed = tmp_path / "service.seed"
    seed.write_bytes(natsauth.new_user_key().seed)
    args = ["--node", "gpu-1", "--profile", "l4"] if service == "node-agent" else []
    with pytest.raises(SystemExit) as exit_:
        MAINS[service]([*args, "--nkey-seed", str(seed)])
    assert exit_.value.code == 2
    assert "refusing to connect to NATS without TLS: --nats-ca FILE (or DRAPLANE_NATS_CA)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        MAINS[service]([*args, "--nkey-seed", str(tmp_path / "missing.seed"), "--nats-ca", str(seed)])
    assert exit_.value.code == 2
    assert f"--nkey-seed {tmp_path / 'missing.seed'}: no readable file there" in capsys.readouterr().err


def test_insecure_dev_is_the_explicit_way_past_the_check():
    args = argparse.Namespace(insecure_dev=True, nkey_seed=None, nats_ca=None, nats="nats://127.0.0.1:4222")
    assert nats_credentials_problem(args) is None
    args.insecure_dev = False
    assert "--insecure-dev" in nats_credentials_problem(args)


@pytest.mark.parametrize("value", ["-1", "1001", "nan"])
def test_a_feed_coalescing_window_out_of_range_exits_2_naming_the_flag(value, capsys):
    assert binder_main(["--insecure-dev", "--feed-coalesce-ms", value]) == 2
    assert "--feed-coalesce-ms must be between 0 and 1000" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "3601", "nan"])
def test_a_new_claim_hold_out_of_range_exits_2_naming_the_flag(value, capsys):
    assert binder_main(["--insecure-dev", "--feed-new-claim-hold-seconds", value]) == 2
    assert "--feed-new-claim-hold-seconds must be between 0 and 3600" in capsys.readouterr().err
