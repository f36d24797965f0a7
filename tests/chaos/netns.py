"""A network namespace of the test's own, joined to this one by a veth pair, whose network can be cut with
an nftables drop rule (packets vanish: no refusal, no reset, like a real partition) and restored.
Needs root, iproute2 and nftables; the addresses are private to the pair and reach nothing else."""

from __future__ import annotations

import random
import subprocess


def _run(*args: str, stdin: str | None = None) -> None:
    subprocess.run(args, input=stdin, text=True, check=True, capture_output=True)


class NetNamespace:
    def __init__(self) -> None:
        self.index = random.randint(1, 250)
        self.name = f"postbox-test-{self.index}"
        self.host_if, self.ns_if = f"pbh{self.index}", f"pbn{self.index}"
        self.host_ip, self.ns_ip = f"10.201.{self.index}.1", f"10.201.{self.index}.2"

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def create(self) -> NetNamespace:
        self.destroy()  # a namespace of the same name left by an interrupted run would make `add` fail
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run(*self.exec_prefix, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        _run(*self.exec_prefix, "ip", "link", "set", self.ns_if, "up")
        _run(*self.exec_prefix, "ip", "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        """Drop every packet arriving in the namespace from outside it (its own loopback still works)."""
        _run(
            *self.exec_prefix,
            "nft",
            "-f",
            "-",
            stdin=(
                "table inet postbox_cut {\n"
                "  chain input {\n"
                "    type filter hook input priority 0; policy drop;\n"
                "    iif lo accept\n"
                "  }\n"
                "}\n"
            ),
        )

    def restore(self) -> None:
        _run(*self.exec_prefix, "nft", "delete", "table", "inet", "postbox_cut")

    def destroy(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], check=False, capture_output=True)
