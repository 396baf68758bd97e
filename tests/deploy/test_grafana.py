"""deploy/grafana/drain.json: loads, is well formed, and asks only for metrics the drain exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from drain.daemon.metrics import Metrics
from tests.deploy import common

# PromQL's own words: aggregations, functions, keywords (what may stand in an
# expression besides metric and label names).
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_quantile", "holt_winters", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear",
    "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time",
    "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time",
    "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "and", "or", "unless", "atan2", "inf", "nan"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


def _families() -> dict[str, tuple[str, set[str]]]:
    """Every metric family the drain exports: name -> (type, label names)."""
    metrics = Metrics()
    found: dict[str, tuple[str, set[str]]] = {}
    for value in vars(metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)):
            found[value._name] = (value._type, set(value._labelnames))
    collected = {family.name for family in metrics.registry.collect()}
    assert set(found) == collected, "every metric of the registry is an attribute of Metrics"
    return found


def _series_by_family() -> dict[str, dict[str, set[str]]]:
    """family -> {series name as exposed (counters' _total, histograms' _bucket...): labels}."""
    found: dict[str, dict[str, set[str]]] = {}
    for name, (kind, labels) in _families().items():
        if kind == "counter":
            found[name] = {f"{name}_total": labels}
        elif kind == "histogram":
            found[name] = {f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels,
                           f"{name}_count": labels}
        else:
            found[name] = {name: labels}
    return found


def _series() -> dict[str, set[str]]:
    """Every series name as exposed -> its label names."""
    return {series: labels for family in _series_by_family().values()
            for series, labels in family.items()}


def parse_promql(expr: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """A light reading of a PromQL expression: enough to check the names it uses.

    Returns ({metric: label names matched on it}, label names of by/without/on/ignoring
    clauses, identifiers that are neither PromQL's words nor followed by a selector).
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selectors: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}", text):
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
        if name:
            selectors.setdefault(name, set()).update(labels)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    grouping: set[str] = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                             text):
        grouping.update(n.strip() for n in clause.split(",") if n.strip())
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", " ", text)
    others: set[str] = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = match.group()
        called = text[match.end():].lstrip().startswith("(")
        if called and word in AGGREGATIONS | FUNCTIONS:
            continue
        if word in KEYWORDS or word in AGGREGATIONS:
            continue
        selectors.setdefault(word, set())
        if called:
            others.add(word)
    return selectors, grouping, others


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(common.GRAFANA_DASHBOARD.read_text())
    return loaded


def test_it_is_a_grafana_dashboard_with_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    # Every query goes through the variable, so the dashboard imports into any Grafana.
    for node in common.walk(dashboard):
        if isinstance(node, dict) and "datasource" in node and isinstance(node["datasource"],
                                                                          dict):
            if node["datasource"].get("type") == "grafana":
                continue  # the built-in annotations
            assert node["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_panel_ids_are_unique_and_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    panels = common.dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    cells: dict[tuple[int, int], int] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]
    for panel in panels:
        if panel["type"] != "row":
            assert panel.get("targets"), f"panel {panel['title']!r} has no query"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def test_every_metric_and_label_queried_is_one_the_drain_exports(
    dashboard: dict[str, Any],
) -> None:
    series = _series()
    for where, expr in common.dashboard_exprs(dashboard):
        selectors, grouping, others = parse_promql(expr)
        assert not others, f"{where}: unknown functions {others} in {expr}"
        assert selectors, f"{where}: no metric in {expr}"
        allowed_grouping = set(TARGET_LABELS)
        for name, labels in selectors.items():
            assert name in series, f"{where}: {name} is not a metric the drain exports ({expr})"
            unknown = labels - series[name] - TARGET_LABELS
            assert not unknown, f"{where}: {name} has no label {unknown}"
            allowed_grouping |= series[name]
        assert grouping <= allowed_grouping, f"{where}: grouping by {grouping - allowed_grouping}"


def test_the_dashboard_covers_every_metric(dashboard: dict[str, Any]) -> None:
    used = {name for _, expr in common.dashboard_exprs(dashboard) for name in parse_promql(expr)[0]}
    missing = {name for name, series in _series_by_family().items() if not used & set(series)}
    assert not missing, f"no panel shows {sorted(missing)}"


def test_the_promql_reader_notices_mistakes() -> None:
    """The checks above can fail: a misspelt metric, label or function is reported."""
    selectors, grouping, others = parse_promql(
        'sum by (queue) (rate(drain_publishd_total{job=~"$job", reason="x"}[5m])) '
        "/ on(instance) histogram_quantil(0.5, drain_up)")
    assert selectors == {"drain_publishd_total": {"job", "reason"}, "drain_up": set(),
                         "histogram_quantil": set()}
    assert grouping == {"queue", "instance"}
    assert others == {"histogram_quantil"}
    assert "drain_publishd_total" not in _series()


def test_promtool_parses_every_expression(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = common.promtool()
    if promtool is None:
        pytest.skip("promtool not installed (Debian's prometheus package; "
                    "deploy/ensure-services.sh installs it)")
    rules = []
    for i, (where, expr) in enumerate(common.dashboard_exprs(dashboard)):
        concrete = (expr.replace("$__rate_interval", "1m").replace("$job", ".*")
                    .replace("$instance", ".*"))
        assert "$" not in concrete, f"{where}: an unknown Grafana variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = common.run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
