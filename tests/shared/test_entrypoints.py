import argparse

from draplane import entrypoints
from draplane.entrypoints import add_http_arguments, add_nats_arguments, nats_connect_options, nats_servers


def test_nats_options_carry_servers_and_the_nkey_seed():
    options = nats_connect_options("nats://a:4222, nats://b:4222", "/etc/draplane/nats/nkey.seed", name="x")
    assert options["servers"] == ["nats://a:4222", "nats://b:4222"]
    assert options["nkeys_seed"] == "/etc/draplane/nats/nkey.seed"
    assert options["max_reconnect_attempts"] == -1 and options["name"] == "x"
    assert "nkeys_seed" not in nats_connect_options("nats://a:4222", None, name="x")


def test_nats_servers_is_a_list_for_every_service_node_agent_included():
    # nats.connect() takes a comma-separated string as one (bad) URL
    assert nats_servers("nats://a:4222,nats://b:4222 ,") == ["nats://a:4222", "nats://b:4222"]
    assert nats_servers("nats://a:4222") == ["nats://a:4222"]


def test_probe_server_defaults_to_loopback_and_reads_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_http_arguments(parser, default_port=8081)
    add_nats_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 8081)
    monkeypatch.setenv("DRAPLANE_NATS_NKEY_SEED", "/seed")
    monkeypatch.setenv("DRAPLANE_HTTP_HOST", "0.0.0.0")
    parser = argparse.ArgumentParser()
    add_http_arguments(parser, default_port=1)
    add_nats_arguments(parser)
    args = parser.parse_args([])
    assert args.nkey_seed == "/seed" and args.host == "0.0.0.0"


def test_services_collect_garbage_less_often_and_skip_startup_objects():
    import gc

    before = gc.get_threshold()
    try:
        entrypoints.tune_garbage_collector()
        assert gc.get_threshold() == entrypoints.GC_THRESHOLDS
        assert gc.get_threshold()[0] > before[0]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
