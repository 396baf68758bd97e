"""The Prometheus files in deploy/prometheus: alert rules, their unit tests, the scrape config.

promtool (Debian's ``prometheus`` package, which ``deploy/ensure-services.sh``
installs) checks the rules and the config and runs ``alerts_test.yml``; the pure
Python tests check what promtool does not: every alert has a runbook and a
severity, uses only metrics the drain exposes, is documented in the thresholds
block and has a test that makes it fire.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from drain.daemon.metrics import Metrics
from tests.deploy.common import METRIC, alert_rules

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
ALERTS_TEST = PROMETHEUS / "alerts_test.yml"
CONFIG = PROMETHEUS / "prometheus.yml"

#: The series names the drain exposes (the contract of issue 6), as Prometheus
#: sees them: counters with _total, histograms as _bucket/_sum/_count.
CONTRACT_COUNTERS = {
    "drain_published_total",
    "drain_deleted_total",
    "drain_dead_lettered_total",
    "drain_expired_total",
    "drain_unroutable_total",
    "drain_nacked_total",
    "drain_publish_refused_total",
    "drain_declare_refused_total",
    "drain_reconnects_total",
    "drain_unsettled_rows_total",
    "drain_conflicted_rows_total",
    "drain_stale_batches_total",
}
CONTRACT_HISTOGRAMS = {
    "drain_batch_rows",
    "drain_cycle_seconds",
    "drain_fetch_seconds",
    "drain_publish_seconds",
    "drain_confirm_seconds",
    "drain_job_wait_seconds",
}
CONTRACT_GAUGES = {
    "drain_lock_held",
    "drain_lock_held_seconds",
    "drain_lanes",
    "drain_delete_pending_rows",
    "drain_last_cycle_timestamp_seconds",
    "drain_up",
    "drain_broker_blocked",
    "drain_backlog_rows",
    "drain_backlog_estimated",
    "drain_backlog_group_rows",
    "drain_backlog_oldest_age_seconds",
    "drain_dead_jobs_rows",
    "drain_operator_paused",
    "drain_oldest_transaction_age_seconds",
    "drain_staged_jobs_dead_tuples",
    "drain_sample_timestamp_seconds",
}
EXPOSED = (
    CONTRACT_COUNTERS
    | CONTRACT_GAUGES
    | {f"{h}_{suffix}" for h in CONTRACT_HISTOGRAMS for suffix in ("bucket", "sum", "count")}
)
SEVERITIES = {"page", "ticket"}


# -- promtool -------------------------------------------------------------------------


def promtool() -> str:
    """promtool's path; fails where it could be installed, skips only where it cannot."""
    path = shutil.which("promtool")
    if path is not None:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        pytest.fail(
            "promtool is missing, yet this machine can install it: run "
            "`bash deploy/ensure-services.sh` (it installs Debian's prometheus package, "
            "which ships promtool)"
        )
    pytest.skip(
        "promtool is missing and cannot be installed here (Debian's prometheus package "
        "ships it; installing it needs root and apt-get: see deploy/ensure-services.sh)"
    )


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    argv = [promtool(), *(str(a) for a in args)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{' '.join(result.args)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert_ok(result)
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout + result.stderr


def test_promtool_check_config() -> None:
    assert_ok(run_promtool("check", "config", "deploy/prometheus/prometheus.yml"))


def test_promtool_test_rules() -> None:
    assert_ok(run_promtool("test", "rules", "deploy/prometheus/alerts_test.yml"))


# Each of these breaks one thing a rule is careful about; alerts_test.yml must notice.
MUTATIONS = {
    "publish rate without the no-drain fallback": ("            or on() vector(0)\n", ""),
    "backlog summed over instances": (
        "max by (job) (drain_backlog_rows)",
        "sum by (job) (drain_backlog_rows)",
    ),
    "unroutable with delta (blind after a counter reset)": (
        "sum by (job) (increase(drain_unroutable_total[15m]))",
        "sum by (job) (delta(drain_unroutable_total[15m]))",
    ),
    "lock alert without its grace period": (
        "sum by (job) (drain_lock_held) < max by (job) (drain_lanes)\n        for: 2m",
        "sum by (job) (drain_lock_held) < max by (job) (drain_lanes)\n        for: 0m",
    ),
    "stall alert on standbys too": ("          and\n          (drain_lock_held == 1)\n", ""),
    "stall alert during a broker alarm": (
        "          unless on(job, instance)\n          (drain_broker_blocked == 1)\n", ""),
    "broker alarm alert without its grace period": (
        "max by (job) (drain_broker_blocked) == 1\n        for: 2m",
        "max by (job) (drain_broker_blocked) == 1\n        for: 0m",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_promtool_tests_catch_a_broken_rule(name: str, tmp_path: Path) -> None:
    old, new = MUTATIONS[name]
    text = ALERTS.read_text("utf-8")
    assert text.count(old) == 1, f"the mutation {name!r} no longer applies to alerts.yml"
    (tmp_path / "alerts.yml").write_text(text.replace(old, new), "utf-8")
    shutil.copy(ALERTS_TEST, tmp_path / "alerts_test.yml")
    result = run_promtool("check", "rules", tmp_path / "alerts.yml")
    assert_ok(result)  # still valid rules: only the tests can tell
    result = run_promtool("test", "rules", tmp_path / "alerts_test.yml")
    assert result.returncode != 0, f"alerts_test.yml did not notice: {name}\n{result.stdout}"
    assert "FAILED" in result.stdout + result.stderr


# -- the rules, read as data ----------------------------------------------------------------


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text("utf-8"))


def alert_names() -> list[str]:
    return [rule["alert"] for rule in alert_rules()]


def test_one_group_named_drain_of_alerts_only() -> None:
    groups = load(ALERTS)["groups"]
    assert [group["name"] for group in groups] == ["drain"]
    rules = alert_rules()
    assert rules, "no rules"
    assert all("alert" in rule for rule in rules), "recording rules do not belong here"
    names = alert_names()
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"


@pytest.mark.parametrize("rule", alert_rules(), ids=alert_names())
def test_alert_has_for_severity_and_runbook(rule: dict[str, Any]) -> None:
    assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), "every alert needs a for:"
    assert rule.get("labels", {}).get("severity") in SEVERITIES
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook"):
        assert str(annotations.get(key, "")).strip(), f"annotation {key!r} missing or empty"
    runbook = annotations["runbook"]
    # A runbook names something to run: a drain command, a query or a shell command.
    assert re.search(r"`drain |psql|SELECT|journalctl|systemctl|rabbitmqctl|curl", runbook), (
        f"the runbook says nothing concrete to check: {runbook!r}"
    )


@pytest.mark.parametrize("rule", alert_rules(), ids=alert_names())
def test_alert_uses_only_exposed_metrics(rule: dict[str, Any]) -> None:
    used = set(METRIC.findall(rule["expr"]))
    assert used <= EXPOSED, f"not exposed by the drain: {sorted(used - EXPOSED)}"
    # Runbooks may name histogram families (drain_cycle_seconds) as well.
    text = " ".join(str(v) for v in rule["annotations"].values())
    mentioned = set(METRIC.findall(text))
    allowed = EXPOSED | CONTRACT_HISTOGRAMS
    assert mentioned <= allowed, f"annotations name unknown metrics: {mentioned - allowed}"


def test_contract_list_is_what_drain_metrics_exposes() -> None:
    """The list above against drain.daemon.metrics: a renamed metric fails here first."""
    exposed: set[str] = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            exposed.add(f"{family.name}_total")
        elif family.type == "histogram":
            exposed |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
        else:
            exposed.add(family.name)
    assert exposed == EXPOSED


def test_every_alert_is_in_the_thresholds_block() -> None:
    header = ALERTS.read_text("utf-8").split("\ngroups:", 1)[0]
    missing = [name for name in alert_names() if not re.search(rf"#\s+{name}\s", header)]
    assert not missing, f"document these in the thresholds block of alerts.yml: {missing}"


def firing_in_tests() -> set[str]:
    """Alert names some test in alerts_test.yml expects to fire."""
    fired: set[str] = set()
    for group in load(ALERTS_TEST)["tests"]:
        for case in group.get("alert_rule_test", []):
            if case.get("exp_alerts"):
                fired.add(case["alertname"])
        for case in group.get("promql_expr_test", []):
            for sample in case.get("exp_samples") or []:
                labels = sample["labels"]
                match = re.search(r'alertname="([^"]+)"', labels)
                if labels.startswith("ALERTS{") and match and 'alertstate="firing"' in labels:
                    fired.add(match.group(1))
    return fired


def test_every_alert_has_a_test_that_makes_it_fire() -> None:
    assert load(ALERTS_TEST)["rule_files"] == ["alerts.yml"]
    missing = sorted(set(alert_names()) - firing_in_tests())
    assert not missing, f"no test in alerts_test.yml makes these fire: {missing}"


def test_scrape_config_covers_both_drains_and_loads_the_rules() -> None:
    config = load(CONFIG)
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # DrainNotRunning and DrainTargetDown select job="drain".
    assert "drain" in jobs
    for rule in alert_rules():
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, f"{rule['alert']} selects job {job!r}, which nothing scrapes"
    targets = [t for static in jobs["drain"]["static_configs"] for t in static["targets"]]
    assert targets == ["127.0.0.1:9464", "127.0.0.1:9465"]
    assert jobs["drain"].get("metrics_path", "/metrics") == "/metrics"
