"""deploy/docker-compose.yml, without Docker: the Compose Specification's JSON schema
(as check-jsonschema ships it) and consistency with the drain, celery_app and the repo.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from celery import Celery

from drain.daemon import pipeline
from tests.deploy import common

LOOPBACK = "127.0.0.1"


def _schema() -> dict[str, Any]:
    # check-jsonschema vendors the Compose Specification's schema (compose-spec.json,
    # kept in step with github.com/compose-spec/compose-spec) for its check-compose-spec hook.
    schema_file = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema: dict[str, Any] = json.loads(schema_file.read_text())
    return schema


def _errors(document: Any) -> list[str]:
    schema = _schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(document)]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = common.load_yaml(common.COMPOSE_FILE)
    return document


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def _drain_services(compose: dict[str, Any], subcommand: str = "run") -> dict[str, dict[str, Any]]:
    found = {name: s for name, s in _services(compose).items()
             if _command(s)[:2] == ["drain", subcommand]}
    return found


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _ports(service: dict[str, Any]) -> list[tuple[str | None, str, int]]:
    """(host ip, host port, container port) of each published port, short or long syntax."""
    found: list[tuple[str | None, str, int]] = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            found.append((port.get("host_ip"), str(port.get("published", "")),
                          int(port["target"])))
            continue
        spec = str(port).split("/", 1)[0]
        # "ip:host:container", "host:container" or "container"; ${VAR:-default} may contain ':'
        parts = re.findall(r"\$\{[^}]*\}|[^:]+", spec)
        container = int(parts[-1])
        host = parts[-2] if len(parts) >= 2 else ""
        ip = parts[-3] if len(parts) >= 3 else None
        found.append((ip, host, container))
    return found


def _interpolated_default(value: str) -> str:
    """``${VAR:-default}`` -> ``default`` (what compose uses when VAR is unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


# -- the schema -----------------------------------------------------------------------------


def test_the_compose_file_is_valid_against_the_compose_specification(
    compose: dict[str, Any],
) -> None:
    assert _errors(compose) == []


def test_the_schema_check_catches_a_broken_file(compose: dict[str, Any]) -> None:
    """The validation above is not vacuous: typical mistakes are reported."""
    broken = copy.deepcopy(compose)
    broken["servcies"] = broken.pop("services")
    assert any("servcies" in e for e in _errors(broken))
    broken = copy.deepcopy(compose)
    broken["services"]["drain-a"]["healthcheck"]["intervall"] = "5s"
    assert any("intervall" in e for e in _errors(broken))
    broken = copy.deepcopy(compose)
    broken["services"]["drain-a"]["depends_on"]["postgres"]["condition"] = "service_ready"
    assert _errors(broken) != []


# -- services ---------------------------------------------------------------------------------


def test_every_service_named_exists(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name, service in services.items():
        depends = service.get("depends_on", [])
        named = list(depends) + [link.split(":", 1)[0] for link in service.get("links", [])]
        network_mode = service.get("network_mode", "")
        if network_mode.startswith("service:"):
            named.append(network_mode.split(":", 1)[1])
        for other in named:
            assert other in services, f"{name} names the service {other!r}, which is not defined"
            assert other != name, f"{name} depends on itself"


def test_it_runs_what_the_issue_asks_for(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert {"postgres", "rabbitmq", "prometheus"} <= set(services)
    assert len(_drain_services(compose)) == 2, "two drains: one active, one hot standby"
    assert len(_drain_services(compose, "migrate")) == 1
    workers = [s for s in services.values() if _command(s)[:1] == ["celery"]]
    assert len(workers) == 1


def test_the_drains_wait_for_the_schema_and_both_services(compose: dict[str, Any]) -> None:
    (migrate,) = _drain_services(compose, "migrate")
    assert _services(compose)[migrate].get("restart") == "no"
    for name, service in _drain_services(compose).items():
        depends = service["depends_on"]
        assert depends[migrate]["condition"] == "service_completed_successfully", name
        assert depends["postgres"]["condition"] == "service_healthy", name
        assert depends["rabbitmq"]["condition"] == "service_healthy", name
        assert service["restart"] in ("always", "unless-stopped"), name


def test_the_drains_form_one_lock_group(compose: dict[str, Any]) -> None:
    """Same database, broker and lock key: one active, the other its hot standby."""
    envs = [_environment(s) for s in _drain_services(compose).values()]
    for key in ("DRAIN_DATABASE_URL", "DRAIN_BROKER_URL", "DRAIN_LOCK_KEY", "DRAIN_LANES"):
        assert len({env.get(key) for env in envs}) == 1, key


def test_the_services_the_drains_connect_to_are_the_compose_services(
    compose: dict[str, Any],
) -> None:
    services = _services(compose)
    database_user = services["postgres"]["environment"]["POSTGRES_USER"]
    database = services["postgres"]["environment"]["POSTGRES_DB"]
    broker_user = services["rabbitmq"]["environment"]["RABBITMQ_DEFAULT_USER"]
    for name, service in services.items():
        for key, url in _environment(service).items():
            if key.endswith("DATABASE_URL"):
                assert url == f"postgresql://{database_user}@postgres:5432/{database}", name
            if key.endswith("BROKER_URL"):
                assert url.startswith(f"amqp://{broker_user}:"), name
                assert url.endswith("@rabbitmq:5672//"), name


def test_the_drains_set_only_variables_the_drain_reads(compose: dict[str, Any]) -> None:
    for subcommand in ("run", "migrate"):
        known = common.env_names(subcommand)
        for name, service in _drain_services(compose, subcommand).items():
            unknown = {k for k in _environment(service) if k.startswith("DRAIN_")} - known
            assert not unknown, f"{name} sets {unknown}, which `drain {subcommand}` never reads"


def test_the_worker_runs_an_app_that_exists_with_variables_it_reads(
    compose: dict[str, Any],
) -> None:
    (worker,) = [s for s in _services(compose).values() if _command(s)[:1] == ["celery"]]
    command = _command(worker)
    assert "worker" in command
    app_name = command[command.index("-A") + 1]
    module_name, _, attribute = app_name.partition(":")
    module = importlib.import_module(module_name)
    if attribute:
        app = getattr(module, attribute)
    else:  # celery -A pkg looks for pkg.app, then pkg.celery
        app = getattr(module, "app", None) or getattr(module, "celery", None)
    assert isinstance(app, Celery), f"celery -A {app_name} names no Celery app"
    # The variables celery_app reads (os.environ.get("NAME"...) in its sources).
    sources = "".join(p.read_text() for p in (common.ROOT / module_name.split(".")[0]).glob("*.py"))
    read = set(re.findall(r"os\.environ(?:\.get\(|\[)\s*\"([A-Z0-9_]+)\"", sources))
    assert set(_environment(worker)) <= read, f"celery_app reads only {sorted(read)}"
    # The threads pool, as celery_app.app's docstring recommends (not solo).
    assert command[command.index("-P") + 1] in ("threads", "prefork")


# -- ports and health -----------------------------------------------------------------------


def test_every_port_is_published_on_loopback_only(compose: dict[str, Any]) -> None:
    host_ports: list[str] = []
    for name, service in _services(compose).items():
        for ip, host, _container in _ports(service):
            assert ip == LOOPBACK, f"{name} publishes a port on {ip or 'every interface'}"
            host_ports.append(_interpolated_default(host))
    assert len(host_ports) == len(set(host_ports)), f"a host port is published twice: {host_ports}"


def test_the_drains_serve_metrics_where_they_are_published_and_checked(
    compose: dict[str, Any],
) -> None:
    for name, service in _drain_services(compose).items():
        env = _environment(service)
        port = common.metrics_port(env)
        assert port == common.default("run", "DRAIN_METRICS_PORT")
        # Inside the container, the drain must listen on every interface to be published.
        assert env.get("DRAIN_METRICS_HOST") == "0.0.0.0", name
        assert [container for _, _, container in _ports(service)] == [port], name
        probe = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/healthz" in probe, name


def test_the_ensure_services_fallback_still_finds_postgres_and_rabbitmq(
    compose: dict[str, Any],
) -> None:
    """deploy/ensure-services.sh runs `up -d postgres` / `up -d rabbitmq` from this file."""
    script = (common.DEPLOY / "ensure-services.sh").read_text()
    assert "docker-compose.yml" in script
    services = _services(compose)
    ports = {name: [(_interpolated_default(h), c) for _, h, c in _ports(services[name])]
             for name in ("postgres", "rabbitmq")}
    assert ("5432", 5432) in ports["postgres"]
    assert ("5672", 5672) in ports["rabbitmq"]
    assert "${DRAIN_PG_PORT:-5432}" in str(services["postgres"]["ports"])
    assert "${DRAIN_AMQP_PORT:-5672}" in str(services["rabbitmq"]["ports"])
    assert services["postgres"]["environment"]["POSTGRES_HOST_AUTH_METHOD"] == "trust"
    assert services["postgres"]["environment"]["POSTGRES_USER"] == "postgres"
    assert "build" not in services["postgres"] and "depends_on" not in services["postgres"]
    assert "depends_on" not in services["rabbitmq"]


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in _services(compose).items():
        if service.get("restart") == "no":
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_stopping_gives_the_drain_time_to_finish_its_batch(compose: dict[str, Any]) -> None:
    worst = float(common.default("run", "DRAIN_CONFIRM_TIMEOUT")) + pipeline.SETTLE_TIMEOUT
    for name, service in _drain_services(compose).items():
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM", name
        grace = service["stop_grace_period"]
        match = re.fullmatch(r"(\d+)s", grace)
        assert match, f"{name}: stop_grace_period {grace!r} is not in seconds"
        assert int(match.group(1)) > worst, name


# -- files --------------------------------------------------------------------------------------


def test_every_mounted_file_and_volume_exists(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    mounts = 0
    for name, service in _services(compose).items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                source, kind = str(volume.get("source", "")), volume.get("type")
            else:
                source = str(volume).split(":", 1)[0]
                kind = "bind" if source.startswith((".", "/")) else "volume"
            if kind == "bind":
                assert not source.startswith("/"), f"{name} mounts an absolute path {source}"
                path = (common.COMPOSE_FILE.parent / source).resolve()
                assert path.exists(), f"{name} mounts {source}, which is not in the repository"
                assert common.ROOT in path.parents, f"{name} mounts {source} outside the repository"
                mounts += 1
            elif kind == "volume" and source:
                assert source in declared, f"{name} uses the undeclared volume {source}"
    assert mounts >= 2, "Prometheus mounts its configuration and the alert rules"


def test_every_image_built_comes_from_the_repository(compose: dict[str, Any]) -> None:
    built = {name: s for name, s in _services(compose).items() if "build" in s}
    assert set(built) >= set(_drain_services(compose)) | set(_drain_services(compose, "migrate"))
    for name, service in built.items():
        context = (common.COMPOSE_FILE.parent / service["build"]["context"]).resolve()
        assert context == common.ROOT, name
        dockerfile = context / service["build"]["dockerfile"]
        assert dockerfile.is_file(), name
        _check_dockerfile(dockerfile, context)
    assert len({s["image"] for s in built.values()}) == 1, "one image for drain and the worker"


def _check_dockerfile(dockerfile: Path, context: Path) -> None:
    text = dockerfile.read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    for line in instructions:
        keyword, _, rest = line.partition(" ")
        if keyword == "COPY" and not rest.startswith("--from"):
            *sources, _target = rest.split()
            for source in sources:
                assert (context / source).exists(), f"{dockerfile.name}: COPY {source}: missing"
        if keyword == "ENV":
            names = set(re.findall(r"\b(DRAIN_[A-Z0-9_]+)=", rest))
            assert names <= common.env_names("run"), f"{dockerfile.name}: ENV {names}"
        if keyword == "EXPOSE":
            assert [int(p.split("/")[0]) for p in rest.split()] == [
                common.default("run", "DRAIN_METRICS_PORT")]
    # The package's own files are what pyproject builds the wheel from.
    assert "staging_schema.sql" in text and "pip install ." in text
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), "a .dockerignore keeps .venv out of the build context"
    for needed in ("pyproject.toml", "README.md", "staging_schema.sql", "drain/", "celery_app/"):
        assert f"!{needed}" in ignore.read_text(), needed


# -- Prometheus in compose -------------------------------------------------------------------


def _prometheus_mounts(compose: dict[str, Any]) -> dict[str, Path]:
    """Container path -> repository file, for the Prometheus service."""
    mounts: dict[str, Path] = {}
    for volume in _services(compose)["prometheus"]["volumes"]:
        source, target = str(volume).split(":")[:2]
        mounts[target] = (common.COMPOSE_FILE.parent / source).resolve()
    return mounts


def test_prometheus_scrapes_every_drain_by_service_name(compose: dict[str, Any]) -> None:
    prometheus = _services(compose)["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    mounts = _prometheus_mounts(compose)
    config = common.load_yaml(mounts[config_path])
    targets = {t for job in config["scrape_configs"] for static in job.get("static_configs", [])
               for t in static["targets"]}
    drains = _drain_services(compose)
    expected = {f"{name}:{common.metrics_port(_environment(s))}" for name, s in drains.items()}
    assert expected <= targets
    for target in targets:
        assert target.split(":")[0] in _services(compose), f"{target} is not a compose service"
    # Every rule file it loads is mounted, relative to the configuration file's directory.
    config_dir = config_path.rsplit("/", 1)[0]
    for rule_file in config["rule_files"]:
        in_container = rule_file if rule_file.startswith("/") else f"{config_dir}/{rule_file}"
        assert in_container in mounts, f"{rule_file} is not mounted into the container"
        assert mounts[in_container] == common.PROMETHEUS / "alerts.yml"


def test_promtool_accepts_the_compose_prometheus_configuration() -> None:
    promtool = common.promtool()
    if promtool is None:
        pytest.skip("promtool not installed (Debian's prometheus package; "
                    "deploy/ensure-services.sh installs it)")
    # Rule files resolve next to the configuration, as they are mounted in the container.
    result = common.run([promtool, "check", "config", "prometheus-compose.yml"],
                        cwd=common.PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
