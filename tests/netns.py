"""Hosts with their own addresses on one machine, for the multi-node tests:
network namespaces joined by veth links, two of them directly, more through a
bridge in a namespace of its own (a switch).

Each host has its loopback and one end of its link, addressed in a private
/24 that exists only between the namespaces. They have no other route, so
their traffic can only go to another host's address or to their own loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Host", "hosts", "two_hosts", "unavailable"]


@dataclass(frozen=True)
class Host:
    ns: str  # the namespace's name
    addr: str  # its address on the link
    ifname: str  # its end of the link (for GLOO_SOCKET_IFNAME)

    def tx_bytes(self) -> int:
        """Bytes this host has sent over the link."""
        out = subprocess.run(self.command(["cat", f"/sys/class/net/{self.ifname}/statistics/"
                                                  "tx_bytes"]),
                             capture_output=True, text=True, check=True)
        return int(out.stdout)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) to make network namespaces with"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    name = f"zs-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    try:  # a veth pair inside the probe namespace, gone with it
        _ip("-n", name, "link", "add", "zsa", "type", "veth", "peer", "name", "zsb")
    except subprocess.CalledProcessError as e:
        return f"no veth links here: {e.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@contextlib.contextmanager
def two_hosts(rate: str | None = None) -> Iterator[list[Host]]:
    """Two hosts joined by one link (see :func:`hosts`)."""
    with hosts(2, rate) as made:
        yield made


@contextlib.contextmanager
def hosts(n: int, rate: str | None = None) -> Iterator[list[Host]]:
    """``n`` linked hosts, removed afterwards (their processes must have ended):
    two joined directly, more each linked to a bridge in a switch namespace;
    ``rate`` (``"1gbit"``) shapes each host's end of its link with a token
    bucket (what it sends)."""
    tag, subnet = f"zs{os.getpid() % 100000}", f"10.213.{os.getpid() % 250}"
    names = [f"{tag}-h{i}" for i in range(n)]
    links = [f"{tag}h{i}" for i in range(n)]
    switch = f"{tag}-sw" if n > 2 else None
    made: list[str] = []
    try:
        for ns in names + ([switch] if switch else []):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if switch is None:
            _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        else:
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, link in enumerate(links):  # each host's link, its peer on the bridge
                _ip("link", "add", link, "type", "veth", "peer", "name", f"{tag}p{i}")
                _ip("link", "set", f"{tag}p{i}", "netns", switch)
                _ip("-n", switch, "link", "set", f"{tag}p{i}", "master", "br0")
                _ip("-n", switch, "link", "set", f"{tag}p{i}", "up")
        for i, (ns, link) in enumerate(zip(names, links, strict=True)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            if rate is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link,
                                "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                                "50ms"], check=True, capture_output=True, text=True)
        yield [Host(ns, f"{subnet}.{i + 1}", link)
               for i, (ns, link) in enumerate(zip(names, links, strict=True))]
    finally:
        for ns in made:  # deleting a namespace deletes its ends of the links, and the pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
