"""A real slow link: one rank in a network namespace of its own behind a rate-limited veth pair.

`slow_link(rate)` makes a namespace and a veth pair with link-local addresses (169.254.x.1 on
this side, .2 inside), limits both directions with `tc ... tbf` and yields the addresses and the
command prefix that runs a process inside. Ranks outside bind gloo to this side's address
(`GLOO_SOCKET_IFNAME`), so their traffic among themselves stays local and only the inside
rank's transfers cross the slow link. Nothing is sent anywhere but these two addresses; the
namespace and the pair are removed on exit. Needs root and iproute2 (`available()` says).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    namespace: str
    outside_dev: str
    inside_dev: str
    outside_addr: str
    inside_addr: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


def available() -> bool:
    """Root with `ip` and `tc` (and a kernel that lets us make a namespace)."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"vgl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return True


def _run(*cmd: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextlib.contextmanager
def slow_link(rate: str = "40mbit") -> Iterator[Link]:
    tag = f"{os.getpid() % 100000}"
    subnet = 64 + os.getpid() % 128  # 169.254.<subnet>.0/30, one per test process
    link = Link(
        namespace=f"vgl-slow-{tag}",
        outside_dev=f"vglo{tag}",
        inside_dev=f"vgli{tag}",
        outside_addr=f"169.254.{subnet}.1",
        inside_addr=f"169.254.{subnet}.2",
    )
    ns = ["ip", "netns", "exec", link.namespace]
    try:
        _run("ip", "netns", "add", link.namespace)
        _run("ip", "link", "add", link.outside_dev, "type", "veth", "peer", "name", link.inside_dev)
        _run("ip", "link", "set", link.inside_dev, "netns", link.namespace)
        _run("ip", "addr", "add", f"{link.outside_addr}/30", "dev", link.outside_dev)
        _run("ip", "link", "set", link.outside_dev, "up")
        _run(*ns, "ip", "addr", "add", f"{link.inside_addr}/30", "dev", link.inside_dev)
        _run(*ns, "ip", "link", "set", link.inside_dev, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        _run("tc", "qdisc", "add", "dev", link.outside_dev, *tbf)
        _run(*ns, "tc", "qdisc", "add", "dev", link.inside_dev, *tbf)
        yield link
    finally:
        subprocess.run(["ip", "link", "del", link.outside_dev], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", link.namespace], capture_output=True, check=False)
