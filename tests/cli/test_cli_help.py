import subprocess
import sys

from draplane.cli import SUBCOMMANDS, build_parser, main


def test_help_lists_the_subcommands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: draplane" in out


def test_every_registered_subcommand_has_help():
    parser = build_parser()
    actions = [a for a in parser._actions if a.dest == "command"]
    registered = set(actions[0].choices)
    assert {"servers", "up", "demo", "allocate", "lint"} <= registered
    # every module listed registers exactly one command (module names use _, commands may use -)
    assert len(registered) == len(SUBCOMMANDS)


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "draplane.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "COMMAND" in result.stdout
