"""Which address a node announces, and --network-interface."""

from __future__ import annotations

import pytest

from launcher import rendezvous
from launcher.config import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture
def clean_env(monkeypatch):
    """These variables unset now and restored after (also when the code under test sets them)."""
    for key in ("RELAY_HOST", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(key, "")  # recorded, so teardown restores the original (or its absence)
        monkeypatch.delenv(key)
    return monkeypatch


def test_a_multi_host_node_never_announces_a_loopback_address(clean_env):
    clean_env.setenv("MASTER_ADDR", "head-node")
    clean_env.setattr(rendezvous.socket, "gethostbyname", lambda _: "127.0.1.1")  # Debian's /etc/hosts
    clean_env.setattr(
        rendezvous, "interface_addresses", lambda: {"lo": "127.0.0.1", "eth0": "10.1.2.3", "ib0": "10.9.0.3"}
    )
    assert rendezvous.node_address() == "10.1.2.3"  # what `hostname -I` prints first
    clean_env.setenv("RELAY_HOST", "10.9.0.3")
    assert rendezvous.node_address() == "10.9.0.3"


def test_network_interface_sets_what_the_environment_does_not(clean_env):
    assert rendezvous.use_network_interface("lo") == "127.0.0.1"
    assert [rendezvous.os.environ[k] for k in ("RELAY_HOST", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")] == [
        "127.0.0.1",
        "lo",
        "lo",
    ]
    clean_env.setenv("NCCL_SOCKET_IFNAME", "^docker0")
    clean_env.setenv("RELAY_HOST", "10.9.0.3")
    assert rendezvous.use_network_interface("lo") == "10.9.0.3"  # the environment wins
    assert rendezvous.os.environ["NCCL_SOCKET_IFNAME"] == "^docker0"
    for bad in ("x" * 40, "lo\0junk", "", "\udcff"):  # too long, NUL, empty, not UTF-8
        with pytest.raises(ConfigError, match="no IPv4 address"):
            rendezvous.use_network_interface(bad)
