"""The health checks the deployment files define, run against real drains.

Two `drain run` processes (one leader, one standby) with the environment of the
Kubernetes Deployment (its Secret's URLs replaced by this test's database and
broker; the metrics server on a free loopback port instead of 0.0.0.0:9464,
which a shared test machine cannot take): the probes' paths must answer 200 on
both, since a standby is ready by design; the compose healthcheck command must
succeed on both and fail where no drain listens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests import roles, support
from tests.deploy import common

_get = support.http_get


def _role(port: int) -> str | None:
    try:
        status, body = _get(port, "/readyz")
    except OSError:
        return None
    if status != 200:
        return None
    role: str = json.loads(body)["role"]
    return role


def _manifest_container() -> dict[str, Any]:
    deployment = common.load_yaml(common.KUBERNETES / "deployment.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = container
    return result


def _manifest_env(db_url: str, port: int) -> dict[str, str]:
    secrets = {"DRAIN_DATABASE_URL": roles.url(db_url, roles.RUNNER),
               "DRAIN_BROKER_URL": support.BROKER_URL}
    env: dict[str, str] = {}
    for item in _manifest_container()["env"]:
        env[item["name"]] = item["value"] if "value" in item else secrets[item["name"]]
    assert env["DRAIN_METRICS_HOST"] == "0.0.0.0"
    env.update(DRAIN_METRICS_HOST="127.0.0.1", DRAIN_METRICS_PORT=str(port))
    return env


def _compose_healthcheck(port: int) -> list[str]:
    compose = common.load_yaml(common.COMPOSE_FILE)
    test: list[str] = compose["services"]["drain-a"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    default = common.default("run", "DRAIN_METRICS_PORT")
    return [sys.executable, *(a.replace(f":{default}/", f":{port}/") for a in test[2:])]


def test_the_probes_pass_on_the_leader_and_on_the_standby(db_url: str, spawn: Any) -> None:
    container = _manifest_container()
    assert container["command"] == ["drain", "run"]
    ports = [support.free_port(), support.free_port()]
    for i, port in enumerate(ports):
        env = support.drain_env(db_url, **_manifest_env(db_url, port))
        spawn(support.drain_argv(*container["command"][1:]), env, f"drain-{i}")
    support.wait_for(lambda: all(_role(port) is not None for port in ports), 30,
                     "both drains connected")
    support.wait_for(lambda: sorted(str(_role(p)) for p in ports) == ["leader", "standby"], 30,
                     "one leader and one standby")

    for probe in ("readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        for port in ports:
            status, body = _get(port, path)
            assert status == 200, f"{probe} {path} on the {_role(port)}: {status} {body}"

    for port in ports:
        check = subprocess.run(_compose_healthcheck(port), capture_output=True, text=True,
                               timeout=30, check=False, stdin=subprocess.DEVNULL)
        assert check.returncode == 0, check.stderr


def test_the_compose_healthcheck_fails_where_no_drain_answers() -> None:
    port = support.free_port()  # nothing listens there
    check = subprocess.run(_compose_healthcheck(port), capture_output=True, text=True,
                           timeout=30, check=False, stdin=subprocess.DEVNULL)
    assert check.returncode != 0
