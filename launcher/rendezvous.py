"""Where the processes of a job find each other: torchrun's rendezvous store (its agent's
TCPStore, at MASTER_ADDR:MASTER_PORT), or an in-process dict for a one-node ``relay train``.

Keys (all under ``relay/g<generation>/``): ``secret`` and ``job_id`` (from rank 0),
``controller`` (the controller's inbox and heartbeat addresses), ``agent/<rank>`` (each
agent's inbox).

Generations: torchrun (``--max-restarts``) restarts every node's process after any node's
failure, but its agent store keeps the keys of the previous run, and its restart counts differ
between nodes (a node restarted for a peer's failure does not count it). So each process
counts its own starts in the store (``relay/starts/<rank>``): every global restart starts every
node exactly once, so all the processes of one run agree on the count, and a new run's keys
never meet an old run's values. One node (``relay train``): the generation is
``RELAY_JOB_GENERATION``, set by the fault-tolerance supervisor (``launcher/supervisor.py``), else 1.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
from dataclasses import dataclass

from .config import ConfigError
from .supervisor import GENERATION_ENV


@dataclass
class Rank:
    rank: int
    world_size: int


def torchrun_rank() -> Rank | None:
    """This process's node rank under torchrun (--nproc-per-node 1), or None outside it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_PORT" not in os.environ:
        return None
    if os.environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        raise SystemExit(
            "relay: run torchrun with --nproc-per-node 1 (one agent per node; it spawns the per-GPU workers)"
        )
    return Rank(int(os.environ.get("GROUP_RANK", os.environ.get("RANK", "0"))), int(os.environ.get("WORLD_SIZE", "1")))


def node_address() -> str:
    """The address other nodes reach this one at: RELAY_HOST (set from --network-interface,
    see :func:`use_network_interface`), else loopback for a single-host job, else this host's
    resolved address unless that is a loopback one, else the first non-loopback IPv4 address
    of its interfaces (what ``hostname -I`` prints first)."""
    if os.environ.get("RELAY_HOST"):
        return os.environ["RELAY_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = "127.0.0.1"
    if not resolved.startswith("127."):
        return resolved
    others = [a for a in interface_addresses().values() if not a.startswith("127.")]
    return others[0] if others else "127.0.0.1"


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None if it has none."""
    import fcntl
    import struct

    raw = os.fsencode(name)
    if not 0 < len(raw) < 16 or b"\0" in raw:  # not an interface name (IFNAMSIZ is 16 with the NUL)
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", raw))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> dict[str, str]:
    """{interface: IPv4 address} for every interface of this host that has one."""
    out = {}
    for _, name in socket.if_nameindex():
        addr = interface_address(name)
        if addr:
            out[name] = addr
    return out


def use_network_interface(name: str) -> str:
    """``--network-interface NAME``: this process and the workers it starts use interface
    ``NAME``: RELAY_HOST becomes its IPv4 address, NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
    become ``NAME`` (each unless already set in the environment, which wins). Returns
    RELAY_HOST; raises ConfigError naming this host and its interfaces if ``NAME`` has no address."""
    addr = interface_address(name)
    if addr is None:
        have = ", ".join(f"{n} ({a})" for n, a in interface_addresses().items()) or "none"
        raise ConfigError(
            f"--network-interface {name!r}: that interface has no IPv4 address on {socket.gethostname()}; "
            f"interfaces with one: {have}"
        )
    os.environ.setdefault("RELAY_HOST", addr)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    return os.environ["RELAY_HOST"]


class Rendezvous:
    """The key-value store of one run of the job; ``generation`` is 1 for the first run and
    one more for each restart (see the module docstring)."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self._local: dict[str, str] | None = None
        self._store = None
        self.generation = int(os.environ.get(GENERATION_ENV, "1"))
        if "MASTER_PORT" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from torch.distributed import TCPStore

            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            rank = int(os.environ.get("RANK", "0"))
            self._store = TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                int(os.environ["WORLD_SIZE"]),
                is_master=(rank == 0 and not agent_store),
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
            self.generation = int(self._store.add(f"relay/starts/{rank}", 1))
        else:
            self._local = {}

    def set(self, key: str, value: dict) -> None:
        data = json.dumps(value)
        if self._local is not None:
            self._local[key] = data
        else:
            self._store.set(self._key(key), data)

    def _get(self, key: str, timeout: float) -> dict:
        if self._local is not None:
            if key not in self._local:
                raise TimeoutError(f"rendezvous: no value for {key!r}")
            return json.loads(self._local[key])
        self._store.wait([self._key(key)], datetime.timedelta(seconds=timeout))
        return json.loads(self._store.get(self._key(key)).decode())

    def refuse(self, message: str) -> None:
        """The controller will not run the job: this run's agents read ``message`` instead of
        the secret and stop, and so does every later run that torchrun starts (see ``refused``)."""
        self.set("secret", {"stop": message})
        if self._store is not None:
            self._store.set("relay/refused", message)

    def refused(self) -> str | None:
        """Why an earlier run of this job refused to run it, if one did (torchrun only)."""
        if self._store is None or not self._store.check(["relay/refused"]):
            return None
        return self._store.get("relay/refused").decode()

    def _key(self, key: str) -> str:
        return f"relay/g{self.generation}/{key}"

    async def get(self, key: str, timeout: float | None = None) -> dict:
        """Wait (without blocking the event loop) for another process to publish ``key``."""
        t = self.timeout if timeout is None else timeout
        try:
            return await asyncio.to_thread(self._get, key, t)
        except Exception as e:
            raise TimeoutError(f"rendezvous: {key!r} was not published within {t:g} s ({e})") from None
