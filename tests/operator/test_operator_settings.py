"""Operator settings from the environment, the command line, and resource quantities."""

from __future__ import annotations

from decimal import Decimal

import pytest

from naiad_operator.__main__ import parse_args
from naiad_operator.config import OperatorConfig
from naiad_operator.quantity import parse_quantity, quantity_bytes


def test_config_defaults_and_environment():
    assert OperatorConfig.from_env({}) == OperatorConfig()
    config = OperatorConfig.from_env(
        {
            "NAIAD_SERVER_IMAGE": "registry/naiad:2",
            "NAIAD_RESYNC_SECONDS": "5",
            "NAIAD_LOAD_TIMEOUT_SECONDS": "1200",
            "NAIAD_QUEUE_METRIC": "q",
            "NAIAD_SERVICE_MONITORS": "false",
            "NAIAD_INFERENCE_POOLS": "False",
            "NAIAD_LLM_WAITING_METRIC": "waiting",
            "NAIAD_UNLOAD_DELAY_SECONDS": "2.5",
        }
    )
    assert config.unload_delay_seconds == 2.5 and OperatorConfig().unload_delay_seconds == 5.0
    assert config.server_image == "registry/naiad:2" and config.resync_seconds == 5.0
    assert config.load_timeout_seconds == 1200.0 and config.queue_metric_name == "q"
    assert config.service_monitors == "false"
    assert config.inference_pools == "false" and config.llm_waiting_metric_name == "waiting"
    assert config.llm_kv_cache_metric_name == "naiad_llm_kv_cache_usage"
    assert config.llm_server_image == "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"
    assert OperatorConfig.from_env({"NAIAD_LLM_SERVER_IMAGE": "r/n:2-llm"}).llm_server_image == "r/n:2-llm"


@pytest.mark.parametrize(
    "env",
    [
        {"NAIAD_RESYNC_SECONDS": "soon"},
        {"NAIAD_RESYNC_SECONDS": "0"},
        {"NAIAD_SERVICE_MONITORS": "maybe"},
        {"NAIAD_INFERENCE_POOLS": "true"},
    ],
)
def test_config_rejects_bad_values(env):
    with pytest.raises(ValueError):
        OperatorConfig.from_env(env)


def test_command_line():
    args = parse_args(["-n", "ml", "--namespace", "team-*", "--liveness", "", "-v"])
    assert args.namespaces == ["ml", "team-*"] and args.liveness == "" and args.verbose
    assert parse_args([]).liveness == "http://0.0.0.0:8080/healthz"
    with pytest.raises(SystemExit):
        parse_args(["-n", "ml", "--all-namespaces"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("16Gi", Decimal(16 * 2**30)),
        ("500M", Decimal(500 * 10**6)),
        ("1.5e3", Decimal(1500)),
        ("250m", Decimal("0.25")),
        (1024, Decimal(1024)),
        ("2", Decimal(2)),
    ],
)
def test_quantities(text, value):
    assert parse_quantity(text) == value


def test_quantity_bytes_and_errors():
    assert quantity_bytes(None) == 0
    assert quantity_bytes("1Ki") == 1024
    assert quantity_bytes("0.5Ki") == 512
    for bad in ("lots", "1GB", "", "1.2.3"):
        with pytest.raises(ValueError):
            parse_quantity(bad)


def test_leader_election_flags_and_timing():
    from naiad_operator.elected import timing_from
    from naiad_operator.leader import ElectionTiming

    args = parse_args(["--leader-elect", "--leader-elect-namespace=ops", "--leader-elect-lease=l"])
    assert args.leader_elect and args.leader_elect_namespace == "ops" and args.leader_elect_lease == "l"
    assert parse_args([]).leader_elect is False
    assert timing_from("") == ElectionTiming(10.0, 7.0, 2.0)
    assert timing_from("4,3,1") == ElectionTiming(4.0, 3.0, 1.0)
    # the leader must stop before a standby may start: retry < renew deadline < lease duration
    for bad in ("4,5,1", "4,3,3", "a,b,c", "1,2"):
        with pytest.raises(SystemExit):
            timing_from(bad)
