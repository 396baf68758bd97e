"""A three-node RabbitMQ cluster on this machine, as docs/rabbitmq_cluster.md tells a user.

Each node is a host of its own to Erlang and to the network: node ``i`` is
``rabbit{i}@drainrmq{i}`` (the names differ before the ``@`` too: the nodes
register with one epmd), and an Erlang host file (``ERL_INETRC``) maps
``drainrmq{i}`` to ``127.0.0.{i+1}``. Its AMQP listener (port 569{i}) and its
distribution listener (port 2569{i}) are bound to that address, and its
distribution connections to the other nodes leave from it, so iptables can cut
one node off from the others by address alone (:meth:`Cluster.partition`)
while clients still reach every node. The nodes share one Erlang cookie, an
epmd of their own (port 4370, on the four addresses; the machine's epmd
listens on 127.0.0.1 only), and nothing of the machine's RabbitMQ: its
configuration, env file, plugins and data directory are not read, and its node
on 127.0.0.1:5672 is not touched.

Set for faults to show within a test's time: ``net_ticktime`` 4 s (a node is
declared down after about that long), ``cluster_partition_handling =
pause_minority`` (the side of a partition that has lost the majority stops
serving clients, as RabbitMQ recommends for three nodes), a default queue type
left classic (the Celery app asks for quorum queues itself), and Erlang's
``prevent_overlapping_partitions`` off: with it on (OTP 25's default), a
node paused by pause_minority hung in ``global``'s sync when it came back
after a freeze, here, and never started again.

Every node runs in a process group of its own (``rabbitmq-server`` in the
foreground), so :meth:`Cluster.kill` (kill -9), :meth:`Cluster.freeze`
(SIGSTOP) and :meth:`Cluster.thaw` reach the Erlang VM and its port programs.

``python -m tests.rabbit_cluster.cluster up DIR`` starts one and prints its
broker list; ``down DIR`` stops it (docs/rabbitmq_cluster.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika

from tests import support

#: The RabbitMQ install's own scripts (Debian's package): run as root directly,
#: not through /usr/sbin's wrapper, which switches to the rabbitmq user.
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
SIZE = 3
#: Node ``i`` listens for AMQP on AMQP_PORT + i and for its peers on DIST_PORT + i.
AMQP_PORT = 5691
DIST_PORT = 25691
EPMD_PORT = 4370
COOKIE = "DRAINCLUSTERTESTCOOKIE"
#: The iptables chain the partitions go in (flushed and removed by :meth:`Cluster.heal`).
CHAIN = "DRAIN_RMQ_PARTITION"
START_TIMEOUT = 90.0
#: How long :meth:`Cluster.restore` waits for a node before starting it afresh.
RESTART_TIMEOUT = 45.0


def address(index: int) -> str:
    return f"127.0.0.{index + 2}"


def host(index: int) -> str:
    return f"drainrmq{index + 1}"


def node_name(index: int) -> str:
    return f"rabbit{index + 1}@{host(index)}"


CONFIG = """\
listeners.tcp.1 = {address}:{amqp_port}
distribution.listener.interface = {address}
distribution.listener.port_range.min = {dist_port}
distribution.listener.port_range.max = {dist_port}
loopback_users = none
cluster_partition_handling = pause_minority
log.console = true
log.console.level = info
log.file = false
"""

ADVANCED = """\
[{{kernel, [{{net_ticktime, 4}},
            {{prevent_overlapping_partitions, false}},
            {{inet_dist_connect_options, [{{ip, {ip_tuple}}}]}}]}}].
"""


@dataclasses.dataclass
class Node:
    index: int
    home: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return node_name(self.index)

    @property
    def address(self) -> str:
        return address(self.index)

    @property
    def port(self) -> int:
        return AMQP_PORT + self.index

    @property
    def dist_port(self) -> int:
        return DIST_PORT + self.index

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.address}:{self.port}//"

    @property
    def log(self) -> Path:
        return self.home / "console.log"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        """A channel of a new connection to this node, closed after."""
        conn = pika.BlockingConnection(pika.ConnectionParameters(self.address, self.port))
        try:
            yield conn.channel()
        finally:
            conn.close()


class Cluster:
    """Three nodes under ``root`` (one directory each, and the shared files)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes = [Node(i, root / host(i)) for i in range(SIZE)]

    # -- the environment every node and every CLI call shares ---------------------

    @property
    def inetrc(self) -> Path:
        return self.root / "inetrc"

    def env(self, node: Node | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "HOME": str(self.root),  # .erlang.cookie
            "ERL_INETRC": str(self.inetrc),
            "ERL_EPMD_PORT": str(EPMD_PORT),
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_USE_LONGNAME": "false",
        })
        if node is not None:
            env.update({
                "RABBITMQ_NODENAME": node.name,
                "RABBITMQ_CONFIG_FILE": str(node.home / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.home / "advanced.config"),
                "RABBITMQ_MNESIA_BASE": str(node.home / "mnesia"),
                "RABBITMQ_LOG_BASE": str(node.home / "log"),
                "RABBITMQ_PID_FILE": str(node.home / "pid"),
                "RABBITMQ_NODE_IP_ADDRESS": node.address,
                "RABBITMQ_NODE_PORT": str(node.port),
                "RABBITMQ_DIST_PORT": str(node.dist_port),
            })
        return env

    def write_files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        cookie = self.root / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(COOKIE)
        cookie.chmod(0o400)
        hosts = "".join(
            f'{{host, {{{address(i).replace(".", ",")}}}, ["{host(i)}"]}}.\n'
            for i in range(SIZE))
        self.inetrc.write_text(hosts + "{lookup, [file, native]}.\n")
        (self.root / "rabbitmq-env.conf").write_text("")
        (self.root / "enabled_plugins").write_text("[].\n")
        for node in self.nodes:
            node.home.mkdir(parents=True, exist_ok=True)
            (node.home / "rabbitmq.conf").write_text(CONFIG.format(
                address=node.address, amqp_port=node.port, dist_port=node.dist_port))
            (node.home / "advanced.config").write_text(ADVANCED.format(
                ip_tuple="{" + node.address.replace(".", ",") + "}"))

    def ctl(self, node: Node, *args: str, timeout: float = 60.0,
            check: bool = True) -> str:
        """``rabbitmqctl -n <node> ...``; its output (raises on failure if ``check``)."""
        result = subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", node.name, *args],
            env=self.env(), capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl -n {node.name} {' '.join(args)}: "
                               f"{result.stdout}{result.stderr}".strip())
        return result.stdout

    # -- starting and stopping ------------------------------------------------------

    def start_epmd(self) -> None:
        addresses = ",".join(["127.0.0.1", *(address(i) for i in range(SIZE))])
        subprocess.run(["epmd", "-daemon", "-port", str(EPMD_PORT), "-address", addresses],
                       env=self.env(), check=True)

    def start_node(self, node: Node) -> None:
        """Start ``node`` in the background (its own process group); see :meth:`wait_up`."""
        assert not node.alive(), f"{node.name} is running already"
        with open(node.log, "ab") as log:
            node.process = subprocess.Popen(
                [str(RABBIT_BIN / "rabbitmq-server")], env=self.env(node),
                cwd=node.home, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def wait_up(self, node: Node, timeout: float = START_TIMEOUT) -> None:
        """Until the node's app is running (``rabbitmqctl await_startup``)."""
        deadline = time.monotonic() + timeout
        while True:
            if node.process is not None and node.process.poll() is not None:
                raise RuntimeError(f"{node.name} exited with {node.process.returncode}: "
                                   + node.log.read_text()[-3000:])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{node.name} did not start in {timeout:.0f} s: "
                                   + node.log.read_text()[-3000:])
            try:
                self.ctl(node, "await_startup", "--timeout", str(int(max(left, 1))),
                         timeout=left + 10)
            except (RuntimeError, subprocess.TimeoutExpired):
                time.sleep(0.5)  # the node has not registered with epmd yet
            else:
                return

    def start(self) -> None:
        """Start all three and join the second and third to the first (after
        killing what a run stopped before its end left: :func:`kill_stale`)."""
        kill_stale()
        self.write_files()
        self.start_epmd()
        for node in self.nodes:
            self.start_node(node)
        for node in self.nodes:
            self.wait_up(node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
        self.wait_clustered()

    def running_nodes(self, node: Node) -> set[str]:
        out = self.ctl(node, "eval", "rabbit_nodes:all_running().", timeout=20)
        return {part.strip(" '[]\n") for part in out.split(",") if part.strip(" '[]\n")}

    def wait_clustered(self, timeout: float = START_TIMEOUT) -> None:
        """Until every node sees all three running."""
        want = {node.name for node in self.nodes}

        def clustered() -> bool:
            try:
                return all(self.running_nodes(node) == want for node in self.nodes)
            except (RuntimeError, subprocess.TimeoutExpired):
                return False

        support.wait_for(clustered, timeout, "the cluster to form", interval=0.5)

    def stop_node(self, node: Node, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        if node.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGCONT)
            os.killpg(node.process.pid, sig)
        try:
            node.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(10)
        # What the node started in its group (port programs) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process = None

    def stop(self) -> None:
        self.heal()
        for node in self.nodes:
            self.stop_node(node)
        _kill_epmd()

    # -- faults ---------------------------------------------------------------------

    def kill(self, node: Node) -> None:
        """kill -9 of the node's VM (and what it started)."""
        self.stop_node(node, signal.SIGKILL)

    def restart(self, node: Node) -> None:
        """Start a stopped or killed node again; it rejoins from its own data."""
        self.start_node(node)
        self.wait_up(node)

    def freeze(self, node: Node) -> None:
        assert node.process is not None
        os.killpg(node.process.pid, signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        assert node.process is not None
        os.killpg(node.process.pid, signal.SIGCONT)

    def partition(self, node: Node) -> None:
        """Cut ``node`` off from the other two (both ways); clients still reach all."""
        _iptables("-N", CHAIN, check=False)
        if _iptables("-C", "INPUT", "-j", CHAIN, check=False):
            _iptables("-I", "INPUT", "-j", CHAIN)
        for other in self.nodes:
            if other is not node:
                for src, dst in ((node, other), (other, node)):
                    _iptables("-A", CHAIN, "-s", src.address, "-d", dst.address, "-j", "DROP")

    def heal(self) -> None:
        """Remove every partition (harmless when there is none)."""
        if shutil.which("iptables") is None:
            return
        _iptables("-D", "INPUT", "-j", CHAIN, check=False)
        _iptables("-F", CHAIN, check=False)
        _iptables("-X", CHAIN, check=False)

    def restore(self) -> None:
        """All three nodes running, healed and clustered again (after a fault)."""
        self.heal()
        for node in self.nodes:
            if node.process is not None and node.alive():
                self.thaw(node)
        for node in self.nodes:
            if not node.alive():
                self.start_node(node)
        for node in self.nodes:
            try:
                self.wait_up(node, RESTART_TIMEOUT)
            except (TimeoutError, RuntimeError):
                # A node paused by pause_minority was seen to hang in Erlang's
                # ``global`` sync when the partition ended (RabbitMQ 3.10 on OTP 25):
                # started afresh from its own data, it rejoins.
                self.kill(node)
                self.start_node(node)
                self.wait_up(node)
        self.rejoin()
        self.wait_clustered()

    def rejoin(self) -> None:
        """Restart the app of a node that runs cut off from the others.

        A node frozen past ``net_ticktime`` (SIGSTOP) was dropped by the other
        two but never saw itself in a minority, so pause_minority did not pause
        it: after SIGCONT it runs alone, its Mnesia partitioned from theirs
        ("cannot communicate with" in ``cluster_status``), and stays so. What
        RabbitMQ's partition guide tells an operator to do, this does:
        ``stop_app`` and ``start_app`` on that node, which then takes the
        majority's view."""
        for node in self.nodes:
            try:
                alone = self.running_nodes(node) == {node.name}
            except (RuntimeError, subprocess.TimeoutExpired):
                continue  # paused by pause_minority, or starting: it rejoins by itself
            if alone:
                self.ctl(node, "stop_app")
                self.ctl(node, "start_app")

    @property
    def broker_list(self) -> str:
        """The three nodes as a Celery/kombu failover list, first node first."""
        return ";".join(node.url for node in self.nodes)


def node_pids() -> list[int]:
    """The Erlang VMs of any cluster of this module on the machine (found by the epmd
    port in their environment), this process's or one a stopped run left."""
    marker = f"ERL_EPMD_PORT={EPMD_PORT}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and (proc / "comm").read_text().strip() == "beam.smp"
                    and marker in (proc / "environ").read_bytes().split(b"\0")):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_stale() -> None:
    """kill -9 the nodes of a cluster whose run ended without stopping it, and its epmd."""
    for pid in node_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _kill_epmd()


def _kill_epmd() -> None:
    subprocess.run(["epmd", "-port", str(EPMD_PORT), "-kill"], capture_output=True,
                   env={**os.environ, "ERL_EPMD_PORT": str(EPMD_PORT)}, check=False)


def _iptables(*args: str, check: bool = True) -> int:
    result = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True,
                            check=False)
    if check and result.returncode:
        raise RuntimeError(f"iptables {' '.join(args)}: {result.stderr.strip()}")
    return result.returncode


@contextlib.contextmanager
def running(root: Path) -> Iterator[Cluster]:
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.rabbit_cluster.cluster up|down DIR", file=sys.stderr)
        return 2
    cluster = Cluster(Path(argv[1]).resolve())
    if argv[0] == "up":
        cluster.start()
        print(cluster.broker_list)
    else:
        for node in cluster.nodes:  # started by another process: stopped through its CLI
            cluster.ctl(node, "stop", check=False)
        cluster.heal()
        kill_stale()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
