"""A Spark standalone cluster on this machine, started as docs/spark.md tells a user.

A master and ``workers`` workers from pyspark's own ``bin/spark-class``
(``org.apache.spark.deploy.master.Master`` / ``...deploy.worker.Worker``), on
free ports, each worker with its own cores, memory and work directory, and
its own loopback address (worker ``i`` on ``127.0.0.{i+1}``): to Spark they
are two hosts, as speculative execution needs (it never runs a task's copy on
a host that already runs that task). Every
JVM runs in its own process group, so that stopping (or killing) a worker
takes its executors and their Python workers with it. Used by the
``spark_cluster`` tests and by ``bench/bench_spark.py --masters cluster``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from drain.spark import bundle, session
from tests import support

HOST = "127.0.0.1"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclasses.dataclass
class Daemon:
    """One JVM (master or worker), leader of its own process group."""

    name: str
    argv: list[str]
    log_path: Path
    #: Variables of this daemon only (a worker's SPARK_LOCAL_IP).
    own_env: dict[str, str] = dataclasses.field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, env={**env, **self.own_env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the JVM and everything it started (executors, Python workers)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.kill_group(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill_group(signal.SIGKILL)
                self.proc.wait(15)
            # Executors outlive a worker stopped by SIGTERM for a moment: none may stay.
            self.kill_group(signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Cluster:
    """A master and workers on free ports; :meth:`stop` leaves no JVM behind."""

    def __init__(self, root: Path, workers: int = 2, cores: int = 1,
                 memory: str = "1g") -> None:
        self.root = root
        self.port, self.web_port = support.free_port(), support.free_port()
        self.master_url = f"spark://{HOST}:{self.port}"
        self.env = {
            **os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": HOST,
            "SPARK_DAEMON_MEMORY": "256m", "SPARK_NO_DAEMONIZE": "1",
            "PYSPARK_PYTHON": sys.executable,
        }
        spark_class = str(spark_home() / "bin" / "spark-class")
        root.mkdir(parents=True, exist_ok=True)
        self.master = Daemon("master", [
            spark_class, "org.apache.spark.deploy.master.Master", "--host", HOST,
            "--port", str(self.port), "--webui-port", str(self.web_port),
        ], root / "master.log")
        self.worker_hosts = [f"127.0.0.{i + 1}" for i in range(workers)]
        self.workers = [
            Daemon(f"worker{i}", [
                spark_class, "org.apache.spark.deploy.worker.Worker", "--host", host,
                "--port", str(support.free_port()), "--webui-port", str(support.free_port()),
                "--cores", str(cores), "--memory", memory,
                "--work-dir", str(root / f"worker{i}"), self.master_url,
            ], root / f"worker{i}.log", own_env={"SPARK_LOCAL_IP": host})
            for i, host in enumerate(self.worker_hosts)
        ]

    # -- life cycle --------------------------------------------------------------

    def start(self, timeout: float = 90) -> None:
        self.master.start(self.env)
        support.wait_for(lambda: self.state() is not None or not self.master.alive(), timeout,
                 "the Spark master's status page")
        if not self.master.alive():
            raise AssertionError("the Spark master exited:\n" + self.master.output()[-3000:])
        for worker in self.workers:
            worker.start(self.env)
        self.wait_for_workers(len(self.workers), timeout)

    def stop(self) -> None:
        for daemon in [*self.workers, self.master]:
            daemon.stop()

    def restart_worker(self, index: int, timeout: float = 90) -> None:
        """Start worker ``index`` again (after it was killed); wait until it registered."""
        worker = self.workers[index]
        worker.stop()
        worker.start(self.env)
        self.wait_for_workers(len(self.workers), timeout)

    # -- state ---------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The master's JSON status (workers, applications); None while it is not up."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.web_port}/json/",
                                        timeout=5) as resp:
                parsed: dict[str, Any] = json.loads(resp.read())
                return parsed
        except (OSError, ValueError):
            return None

    def alive_workers(self) -> int:
        state = self.state() or {}
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def wait_for_workers(self, count: int, timeout: float = 90) -> None:
        support.wait_for(lambda: self.alive_workers() >= count, timeout,
                 f"{count} ALIVE workers at {self.master_url}")

    def executor_pids(self, index: int) -> list[int]:
        """Worker ``index``'s executor JVMs (CoarseGrainedExecutorBackend children)."""
        worker = self.workers[index]
        if not worker.alive():
            return []
        return [pid for pid in _children(worker.pid)
                if "CoarseGrainedExecutorBackend" in _cmdline(pid)]

    # -- faults --------------------------------------------------------------------

    def kill_executor(self, index: int) -> int:
        """kill -9 worker ``index``'s executor JVM (the worker lives on); its pid."""
        pids = self.executor_pids(index)
        assert len(pids) == 1, f"worker{index} runs {len(pids)} executors"
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def kill_worker(self, index: int) -> None:
        """kill -9 worker ``index`` with its executor and Python workers: a lost node."""
        worker = self.workers[index]
        worker.kill_group(signal.SIGKILL)
        assert worker.proc is not None
        worker.proc.wait(15)

    # -- submitting ----------------------------------------------------------------

    def submit_argv(self, bundle_dir: Path, *args: str, conf: dict[str, str] | None = None,
                    executor_memory: str = "512m") -> list[str]:
        """``spark-submit`` of drain's Spark command ``args``, as docs/spark.md shows it."""
        archive, script = bundle.write(bundle_dir)
        confs = {
            "spark.pyspark.python": sys.executable,
            "spark.driver.host": HOST,
            "spark.ui.enabled": "false",
            # Spark's 200 shuffle partitions are 200 tasks per join on 2 cores.
            "spark.sql.shuffle.partitions": "8",
            **(conf or {}),
        }
        jar = session.jdbc_jar()
        argv = [str(spark_home() / "bin" / "spark-submit"), "--master", self.master_url,
                "--driver-memory", "512m", "--executor-memory", executor_memory,
                "--py-files", str(archive)]
        if jar is not None:
            argv += ["--jars", str(jar)]
        for key, value in confs.items():
            argv += ["--conf", f"{key}={value}"]
        return [*argv, str(script), *args]


@contextlib.contextmanager
def running(root: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> Iterator[Cluster]:
    cluster = Cluster(root, workers=workers, cores=cores, memory=memory)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
