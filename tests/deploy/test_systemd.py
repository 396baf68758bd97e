"""deploy/systemd/ and the settings files: what systemd-analyze and the drain's CLI say of them."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from drain.cli import common as cli_common
from drain.daemon import pipeline
from drain.settings import options
from tests.deploy import common

UNITS = ("drain.service", "drain@.service")
# Not in drain.env.example on purpose: "head" is for comparisons only.
UNDOCUMENTED = {"DRAIN_FETCH_STRATEGY"}


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows a key several times)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (common.SYSTEMD / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _settings_file(path: Path) -> dict[str, str]:
    """KEY=value lines of an EnvironmentFile, the commented-out ``#KEY=value`` ones too."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_restarts_always_and_stops_with_sigterm(name: str) -> None:
    service = _unit(name)["Service"]
    assert service["Restart"] == ["always"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert _unit(name)["Unit"]["StartLimitIntervalSec"] == ["0"], "never give up restarting"
    worst = float(common.default("run", "DRAIN_CONFIRM_TIMEOUT")) + pipeline.SETTLE_TIMEOUT
    (timeout,) = service["TimeoutStopSec"]
    assert float(timeout) > worst
    (exec_start,) = service["ExecStart"]
    assert exec_start.split()[-2:] == ["drain", "run"] or exec_start.endswith("/drain run")
    assert "/etc/drain/drain.env" in service["EnvironmentFile"]
    assert service["User"] != ["root"]


@pytest.mark.parametrize("name", UNITS)
def test_the_unit_is_hardened(name: str) -> None:
    service = _unit(name)["Service"]
    for key, value in {"NoNewPrivileges": "true", "ProtectSystem": "strict",
                       "ProtectHome": "true", "PrivateTmp": "true", "PrivateDevices": "true",
                       "RestrictSUIDSGID": "true", "CapabilityBoundingSet": ""}.items():
        assert service[key] == [value], key
    families = service["RestrictAddressFamilies"][0].split()
    assert {"AF_INET", "AF_INET6"} <= set(families), "Postgres, RabbitMQ and the metrics port"


def test_each_instance_of_the_template_has_its_own_settings_file() -> None:
    files = _unit("drain@.service")["Service"]["EnvironmentFile"]
    # Required (no leading '-'): without its own DRAIN_METRICS_PORT a second
    # instance would fail to bind the first one's port.
    assert "/etc/drain/%i.env" in files
    primary = _settings_file(common.SYSTEMD / "primary.env.example")
    standby = _settings_file(common.SYSTEMD / "standby.env.example")
    assert int(primary["DRAIN_METRICS_PORT"]) == common.default("run", "DRAIN_METRICS_PORT")
    assert int(standby["DRAIN_METRICS_PORT"]) == 9465
    text = (common.SYSTEMD / "drain@.service").read_text()
    assert "primary.env.example" in text and "standby.env.example" in text
    # The lanes example: every lane's file sets the same DRAIN_LANES and its own lane and port.
    lanes = re.findall(r"DRAIN_LANES=(\d+)", text)
    lane = re.findall(r"DRAIN_LANE=(\d+)", text)
    ports = re.findall(r"DRAIN_METRICS_PORT=(\d+)", text)
    assert lanes and len(set(lanes)) == 1
    assert sorted(map(int, lane)) == list(range(int(lanes[0])))
    assert len(ports) == len(set(ports)) >= 2


def test_every_setting_in_the_settings_files_is_read_by_the_drain() -> None:
    known = common.env_names("run")
    files = [common.DEPLOY / "drain.env.example", *sorted(common.SYSTEMD.glob("*.env.example"))]
    for path in files:
        keys = set(_settings_file(path))
        assert keys, path
        assert keys <= known, f"{path.name}: {keys - known} are not `drain run` settings"
    documented = set(_settings_file(common.DEPLOY / "drain.env.example"))
    assert known - UNDOCUMENTED <= documented, "drain.env.example lacks a setting"


def test_the_settings_file_shows_the_defaults() -> None:
    for key, value in _settings_file(common.DEPLOY / "drain.env.example").items():
        if key in ("DRAIN_DATABASE_URL", "DRAIN_BROKER_URL"):
            continue
        action = common.env_actions("run")[key]
        shown: object = (cli_common.switch(value) if action.nargs == 0
                         else action.type(value) if callable(action.type) else value)
        assert shown == common.default("run", key), key


def test_every_drain_variable_the_deployment_files_name_exists() -> None:
    """Comments and docs included: no setting is misspelt or made up."""
    known = common.all_env_names()
    paths = [*common.SYSTEMD.iterdir(), common.DEPLOY / "drain.env.example",
             common.COMPOSE_FILE, common.DEPLOY / "Dockerfile",
             *common.KUBERNETES.iterdir(), common.ROOT / "README.md",
             *(common.ROOT / "docs" / name for name in ("running.md", "operations.md"))]
    for path in paths:
        unknown = common.drain_tokens(path.read_text()) - known
        assert not unknown, f"{path.relative_to(common.ROOT)} names {unknown}"


def test_every_variable_the_help_names_is_really_read() -> None:
    """`env DRAIN_X` in the help is not just prose: setting it changes the option."""
    for command in ("run", "migrate"):
        for name, action in common.env_actions(command).items():
            before = getattr(common.parsed_with_env(command, {}), action.dest)
            if action.nargs == 0:  # a switch: any of 1/true/yes sets it
                probe = "1"
            elif action.choices:
                probe = next(str(c) for c in action.choices if c != before)
            elif action.type in (int, float) or isinstance(action.type, options.Number):
                probe = "7"
            else:
                probe = "probe-value"
            after = getattr(common.parsed_with_env(command, {name: probe}), action.dest)
            expected: object = (True if action.nargs == 0
                                else action.type(probe) if callable(action.type) else probe)
            assert after == expected != before, f"drain {command}: {name}"


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian's systemd package)")
    drain_bin = Path(sys.executable).with_name("drain")
    assert drain_bin.is_file(), "the venv's drain script"
    for name, as_name in (("drain.service", "drain.service"),
                          ("drain@.service", "drain@standby.service")):
        text = (common.SYSTEMD / name).read_text()
        # verify checks that ExecStart's program exists: point it at this venv's drain.
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={drain_bin}", text, flags=re.MULTILINE)
        unit = tmp_path / as_name
        unit.write_text(text)
        result = common.run([analyze, "verify", str(unit)], cwd=tmp_path)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        # Unknown or misspelt settings are only warnings: fail on them too.
        assert "Unknown" not in output and "ignoring" not in output.lower(), output


def test_systemd_analyze_reports_a_misspelt_setting(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian's systemd package)")
    unit = tmp_path / "drain.service"
    text = (common.SYSTEMD / "drain.service").read_text()
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", text, flags=re.MULTILINE)
    unit.write_text(text.replace("KillSignal=", "KilSignal="))
    result = common.run([analyze, "verify", str(unit)], cwd=tmp_path)
    assert "KilSignal" in result.stdout + result.stderr
