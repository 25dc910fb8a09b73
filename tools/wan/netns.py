"""Slow links between clusters: one Linux network namespace per cluster, joined through a bridge.

Layout for prefix ``P`` and ``C`` clusters (all of it inside namespaces this module creates, so
the host's own network is never touched)::

    P-hub : bridge br0, and one veth end "c<k>" per cluster attached to it
    P-c<k>: the other veth end, "wan0", address <subnet>.<k+1>; loopback up

Every cluster's uplink is shaped by a ``tbf`` qdisc on its ``wan0`` (egress towards the hub),
its downlink by a ``tbf`` on ``c<k>`` in the hub (egress towards the cluster), both to the same
rate. Ranks of one cluster share its namespace and reach each other over loopback, unshaped.
This kernel has no ``netem``, so no delay is added: the link is rate-limited, not long.
"""

import ipaddress
import json
import os
import re
import subprocess
from dataclasses import dataclass

WAN_IFNAME = "wan0"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,9}$")


class WanError(RuntimeError):
    """A one-line error for the user (bad argument, missing privilege, failed ip/tc command)."""


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as ``10mbit``, ``1gbit``, ``500kbit``."""
    match = _RATE.match(rate)
    if not match:
        raise WanError(f"--rate must look like 10mbit, 1gbit or 500kbit, got {rate!r}")
    bits = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bits < 8000:
        raise WanError(f"--rate must be at least 8kbit, got {rate!r}")
    return bits


def require_root(euid: int) -> None:
    """Namespaces, veth pairs and qdiscs need root (CAP_NET_ADMIN)."""
    if euid != 0:
        raise WanError(f"slow-link emulation needs root (network namespaces and tc); running as uid {euid}")


def check_prefix(prefix: str) -> None:
    if not _PREFIX.match(prefix):
        raise WanError(f"--prefix must be 1-10 lowercase letters/digits starting with a letter, got {prefix!r}")


@dataclass(frozen=True)
class Wan:
    """``clusters`` namespaces named ``<prefix>-c<k>`` behind ``<prefix>-hub``, links shaped to ``rate``."""

    prefix: str
    clusters: int
    rate: str
    subnet: str = "10.213.0.0/24"

    def __post_init__(self):
        check_prefix(self.prefix)
        if not 2 <= self.clusters <= 64:
            raise WanError(f"--clusters must be between 2 and 64, got {self.clusters}")
        rate_bits(self.rate)
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise WanError(f"--subnet must be an IPv4 network such as 10.213.0.0/24, got {self.subnet!r}") from None
        if net.version != 4 or net.num_addresses < self.clusters + 2:
            raise WanError(f"--subnet {self.subnet} has no room for {self.clusters} clusters")

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, k: int) -> str:
        return f"{self.prefix}-c{k}"

    def address(self, k: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[k + 1])

    @property
    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(k) for k in range(self.clusters)]


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WanError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def existing_namespaces(prefix: str) -> list[str]:
    """Namespaces whose name is this prefix's hub or one of its clusters."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
    own = re.compile(rf"^{re.escape(prefix)}-(?:hub|c(\d+))$")
    matches = [own.match(n) for n in names]
    # The hub first, then the clusters in index order (c2 before c10).
    return [m.group(0) for m in sorted(filter(None, matches), key=lambda m: int(m.group(1) or -1))]


def _tbf(namespace: str, dev: str, bits: int) -> None:
    # Burst: at least a few full frames and one 100 Hz timer tick of traffic; queue up to 200 ms
    # (shorter queues dropped packets and cost ~10% goodput under gloo's bursts).
    burst = max(32 * 1024, bits // 8 // 100)
    _run("tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(bits),
         "burst", str(burst), "latency", "200ms")


def up(wan: Wan) -> None:
    """Creates the namespaces, links and qdiscs; removes whatever it made if a step fails."""
    require_root(os.geteuid())
    taken = existing_namespaces(wan.prefix)
    if taken:
        raise WanError(f"namespaces with prefix {wan.prefix!r} already exist ({', '.join(taken)}); "
                       f"run `python tools/wan down --prefix {wan.prefix}` first")
    bits = rate_bits(wan.rate)
    prefixlen = ipaddress.ip_network(wan.subnet).prefixlen
    try:
        for ns in wan.namespaces:
            _run("ip", "netns", "add", ns)
        _run("ip", "-n", wan.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", wan.hub, "link", "set", "br0", "up")
        for k in range(wan.clusters):
            ns, hub_end = wan.namespace(k), f"c{k}"
            _run("ip", "-n", wan.hub, "link", "add", hub_end, "type", "veth", "peer", "name", WAN_IFNAME, "netns", ns)
            _run("ip", "-n", wan.hub, "link", "set", hub_end, "master", "br0")
            _run("ip", "-n", wan.hub, "link", "set", hub_end, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{wan.address(k)}/{prefixlen}", "dev", WAN_IFNAME)
            _run("ip", "-n", ns, "link", "set", WAN_IFNAME, "up")
            _tbf(ns, WAN_IFNAME, bits)
            _tbf(wan.hub, hub_end, bits)
    except BaseException:
        down(wan.prefix)
        raise


def down(prefix: str) -> list[str]:
    """Deletes every namespace of this prefix (their links and qdiscs go with them); returns them."""
    require_root(os.geteuid())
    removed = []
    for ns in existing_namespaces(prefix):
        _run("ip", "netns", "del", ns)
        removed.append(ns)
    return removed


def link_stats(namespace: str, dev: str = WAN_IFNAME) -> dict:
    """Interface byte counters and the shaping qdisc of ``dev`` in ``namespace``."""
    info = json.loads(_run("ip", "-n", namespace, "-s", "-j", "link", "show", "dev", dev))[0]
    qdisc = json.loads(_run("tc", "-n", namespace, "-j", "qdisc", "show", "dev", dev))
    shaped = [q for q in qdisc if q.get("kind") == "tbf"]
    return dict(tx_bytes=info["stats64"]["tx"]["bytes"], rx_bytes=info["stats64"]["rx"]["bytes"],
                rate_bits=shaped[0]["options"]["rate"] * 8 if shaped else None)  # tc -j reports bytes/s


def status(prefix: str) -> list[dict]:
    """One entry per cluster namespace of this prefix: address, shaped rate, byte counters."""
    out = []
    for ns in existing_namespaces(prefix):
        if ns.endswith("-hub"):
            continue
        addrs = json.loads(_run("ip", "-n", ns, "-j", "addr", "show", "dev", WAN_IFNAME))[0]["addr_info"]
        out.append(dict(namespace=ns, address=next(a["local"] for a in addrs if a["family"] == "inet"),
                        **link_stats(ns)))
    return out
