"""What every service's entry point says to a bad --log-format, before it connects to anything."""

import pytest

from draplane_allocator.__main__ import main as allocator_main
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
