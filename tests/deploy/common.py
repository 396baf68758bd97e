"""What the deployment files are checked against: the drain's own CLI, metrics and files.

Nothing here is a copy of a setting: the environment variables come from the
parser of ``drain run`` (the ``env DRAIN_...`` its help names, each confirmed
by setting it and parsing), the metric names from :class:`drain.daemon.metrics.Metrics`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from celery_app import demo_setup
from drain.cli import main as cli
from drain.settings import options

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
KUBERNETES = DEPLOY / "kubernetes"
GRAFANA_DASHBOARD = DEPLOY / "grafana" / "drain.json"
SYSTEMD = DEPLOY / "systemd"
PROMETHEUS = DEPLOY / "prometheus"

_ENV_MENTION = re.compile(r"\benv (DRAIN_[A-Z0-9_]+)")


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The drain's parser, built without any DRAIN_* variable of this environment."""
    return _build_parser({})


def _only_env(extra_env: Mapping[str, str]) -> Any:
    """This process's environment without its DRAIN_* variables, plus ``extra_env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
    return mock.patch.dict(os.environ, {**clean, **extra_env}, clear=True)


def _build_parser(extra_env: Mapping[str, str]) -> argparse.ArgumentParser:
    with _only_env(extra_env):
        return cli.build_parser()


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    raise AssertionError("drain's parser has no subcommands")


def env_actions(command: str) -> dict[str, argparse.Action]:
    """``{DRAIN_X: the option it sets}`` for every ``env DRAIN_X`` in ``drain COMMAND --help``."""
    found: dict[str, argparse.Action] = {}
    for action in _subparser(_parser(), command)._actions:
        for name in _ENV_MENTION.findall(action.help or ""):
            found[name] = action
    assert found, f"`drain {command} --help` names no DRAIN_* variable"
    return found


def env_names(command: str = "run") -> set[str]:
    return set(env_actions(command))


def all_env_names() -> set[str]:
    """Every DRAIN_* variable any drain command reads."""
    names: set[str] = set()
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for option in sub._actions:
                    names.update(_ENV_MENTION.findall(option.help or ""))
    return names


def parsed_with_env(command: str, env: Mapping[str, str]) -> argparse.Namespace:
    """``drain COMMAND`` parsed with no flags, only the environment ``env``, as
    ``drain.cli.main.main`` does it (numeric variables are read after parsing)."""
    with _only_env(env):
        args = cli.build_parser().parse_args([command])
        options.apply_env(args)
    return args


def default(command: str, env_name: str) -> Any:
    """The value of the option behind ``env_name`` when the variable is not set."""
    action = env_actions(command)[env_name]
    return getattr(parsed_with_env(command, {}), action.dest)


def metrics_port(env: Mapping[str, Any]) -> int:
    """The port `drain run` serves /metrics on, given its environment."""
    value = env.get("DRAIN_METRICS_PORT")
    return int(value) if value is not None else int(default("run", "DRAIN_METRICS_PORT"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


#: A metric name of the drain's, as the alert rules and the dashboard's queries name them.
METRIC = re.compile(r"\bdrain_[a-z_]+")


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of the Grafana dashboard, those inside collapsed rows too."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return panels


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel query and every query variable."""
    found = [(f"panel {p['id']} {p.get('title')!r}", t["expr"])
             for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_]\w*)\)", query)
            assert match, f"variable {variable['name']}: {query}"
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of deploy/prometheus/alerts.yml."""
    groups = load_yaml(PROMETHEUS / "alerts.yml")["groups"]
    return [rule for group in groups for rule in group["rules"]]


def queried_metrics() -> dict[str, set[str]]:
    """Every drain_* series name the Grafana dashboard and the alert rules query:
    {name: where}."""
    exprs = dashboard_exprs(json.loads(GRAFANA_DASHBOARD.read_text()))
    exprs += [(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    found: dict[str, set[str]] = {}
    for where, expr in exprs:
        for name in METRIC.findall(expr):
            found.setdefault(name, set()).add(where)
    return found


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


#: DRAIN_* words the deployment files name that are not drain settings: the
#: variables Kubernetes' service links would derive from a Service named "drain",
#: and deploy/ensure-services.sh's own (the ports compose publishes Postgres and
#: RabbitMQ on).
NOT_SETTINGS = {"DRAIN_PORT", "DRAIN_SERVICE_HOST", "DRAIN_SERVICE_PORT",
                "DRAIN_PG_PORT", "DRAIN_AMQP_PORT"}


def drain_tokens(text: str) -> set[str]:
    """Every DRAIN_* word in a text (comments included), less :data:`NOT_SETTINGS` and
    the demo's own settings (celery_app/demo_setup.py)."""
    words = set(re.findall(r"\bDRAIN_[A-Z0-9_]*[A-Z0-9]\b", text))
    return words - NOT_SETTINGS - set(demo_setup.SETTINGS)


def promtool() -> str | None:
    return shutil.which("promtool")


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=cwd or ROOT,
                          stdin=subprocess.DEVNULL, timeout=120)


def walk(value: Any) -> Iterator[Any]:
    """Every node of a nested structure of dicts and lists."""
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)
