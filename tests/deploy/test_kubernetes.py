"""deploy/kubernetes/: the manifests parse, validate against Kubernetes' own schemas
(as the kubernetes-validate package ships them) and agree with the drain.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from drain.daemon import pipeline
from tests.deploy import common

EXPECTED = {
    "deployment.yaml": [("apps/v1", "Deployment")],
    "service.yaml": [("v1", "Service")],
    "poddisruptionbudget.yaml": [("policy/v1", "PodDisruptionBudget")],
    "migrate-job.yaml": [("batch/v1", "Job")],
    "secret.example.yaml": [("v1", "Secret")],
    "servicemonitor.yaml": [("monitoring.coreos.com/v1", "ServiceMonitor")],
    "kustomization.yaml": [("kustomize.config.k8s.io/v1beta1", "Kustomization")],
}


def _versions() -> tuple[str, str]:
    """The oldest and the newest Kubernetes release whose schemas kubernetes-validate
    ships (1.25 and 1.37 with kubernetes-validate 1.37): the manifests must satisfy both."""
    utils: Any = importlib.import_module("kubernetes_validate.utils")
    shipped = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return shipped[0], shipped[-1]


def _documents(name: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = common.load_yaml_documents(common.KUBERNETES / name)
    return docs


def _one(name: str) -> dict[str, Any]:
    (doc,) = _documents(name)
    return doc


def _pod_spec(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _one(name)["spec"]["template"]["spec"]
    return spec


def _container(name: str) -> dict[str, Any]:
    (container,) = _pod_spec(name)["containers"]
    result: dict[str, Any] = container
    return result


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_file_is_there_with_the_expected_kinds() -> None:
    on_disk = {p.name for p in common.KUBERNETES.glob("*.yaml")}
    assert on_disk == set(EXPECTED), "a manifest was added or removed: update EXPECTED"
    for name, kinds in EXPECTED.items():
        assert [(d["apiVersion"], d["kind"]) for d in _documents(name)] == kinds, name
    assert (common.KUBERNETES / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(n for n, kinds in EXPECTED.items()
                                        if not kinds[0][0].endswith(("coreos.com/v1",
                                                                     "config.k8s.io/v1beta1"))))
def test_the_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    validator: Any = importlib.import_module("kubernetes_validate")
    for version in _versions():
        for document in _documents(name):
            # strict: unknown fields are errors too, as kubectl's server-side validation makes them
            validator.validate(document, version, strict=True)


def test_the_schema_validation_catches_mistakes() -> None:
    validator: Any = importlib.import_module("kubernetes_validate")
    broken = _one("deployment.yaml")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(validator.ValidationError):
        validator.validate(broken, _versions()[0], strict=True)
    broken = _one("deployment.yaml")
    broken["spec"]["replicas"] = "two"
    with pytest.raises(validator.ValidationError):
        validator.validate(broken, _versions()[0], strict=True)


def test_two_replicas_and_the_lock_decides_who_publishes() -> None:
    deployment = _one("deployment.yaml")
    assert deployment["spec"]["replicas"] == 2
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    # A rollout waits for the new pod to be ready (connected, as a standby).
    assert rolling["maxUnavailable"] == 0
    pdb = _one("poddisruptionbudget.yaml")
    assert pdb["spec"]["maxUnavailable"] == 1
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    for other in ("service.yaml", "poddisruptionbudget.yaml", "servicemonitor.yaml"):
        spec = _one(other)["spec"]
        chosen = spec["selector"].get("matchLabels", spec["selector"])
        if other == "servicemonitor.yaml":  # selects the Service, by the Service's labels
            assert _one("service.yaml")["metadata"]["labels"].items() >= chosen.items()
        else:
            assert chosen == selector, other


def test_probes_and_ports_match_the_drains_metrics_server() -> None:
    container = _container("deployment.yaml")
    env = _env(container)
    port = common.metrics_port({k: v.get("value") for k, v in env.items() if "value" in v})
    assert port == common.default("run", "DRAIN_METRICS_PORT")
    assert env["DRAIN_METRICS_HOST"]["value"] == "0.0.0.0", "probes come from outside the pod"
    (declared,) = container["ports"]
    assert declared["containerPort"] == port
    probes = {kind: container[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"
    for probe in probes.values():
        assert probe["port"] in (declared["name"], port)
    annotations = _one("deployment.yaml")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    (service_port,) = _one("service.yaml")["spec"]["ports"]
    assert service_port["targetPort"] in (declared["name"], port)
    (endpoint,) = _one("servicemonitor.yaml")["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert endpoint["path"] == "/metrics"


def test_the_containers_set_only_variables_the_drain_reads_from_the_secret() -> None:
    secret = _one("secret.example.yaml")
    keys = set(secret["stringData"])
    for name, subcommand in (("deployment.yaml", "run"), ("migrate-job.yaml", "migrate")):
        container = _container(name)
        assert container["command"] == ["drain", subcommand], name
        env = _env(container)
        unknown = set(env) - common.env_names(subcommand)
        assert not unknown, f"{name} sets {unknown}, which `drain {subcommand}` never reads"
        for variable in ("DRAIN_DATABASE_URL", "DRAIN_BROKER_URL")[: 2 if subcommand == "run"
                                                                   else 1]:
            ref = env[variable]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"], variable
            assert ref["key"] in keys, f"{name}: {variable} comes from a key the Secret lacks"
        # Service links would inject DRAIN_PORT, DRAIN_SERVICE_HOST... (Service "drain").
        assert _pod_spec(name)["enableServiceLinks"] is False, name
    images = {_container(n)["image"] for n in ("deployment.yaml", "migrate-job.yaml")}
    assert len(images) == 1, "the Job migrates with the drains' own image"


def test_the_pods_have_time_to_stop_and_resources() -> None:
    worst = float(common.default("run", "DRAIN_CONFIRM_TIMEOUT")) + pipeline.SETTLE_TIMEOUT
    assert _pod_spec("deployment.yaml")["terminationGracePeriodSeconds"] > worst
    for name in ("deployment.yaml", "migrate-job.yaml"):
        container = _container(name)
        assert container["resources"]["requests"]["memory"], name
        assert container["resources"]["limits"]["memory"], name
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["readOnlyRootFilesystem"] is True, name
        assert _pod_spec(name)["securityContext"]["runAsNonRoot"] is True, name


def test_the_kustomization_lists_existing_files_and_no_secret() -> None:
    resources: list[str] = _one("kustomization.yaml")["resources"]
    for resource in resources:
        assert (common.KUBERNETES / resource).is_file(), resource
    assert "deployment.yaml" in resources
    assert not any("secret" in r for r in resources), "the example Secret is not deployed"


def test_the_readme_walks_through_every_manifest() -> None:
    readme = (common.KUBERNETES / "README.md").read_text()
    for name in EXPECTED:
        assert name in readme, f"README.md does not mention {name}"
    assert common.drain_tokens(readme) <= common.all_env_names()


def test_the_image_the_manifests_name_is_built_by_the_dockerfile() -> None:
    dockerfile = (common.DEPLOY / "Dockerfile").read_text()
    assert "USER 10001" in dockerfile, "runAsNonRoot needs a numeric non-root user"
    assert _pod_spec("deployment.yaml")["securityContext"]["runAsUser"] == 10001
    assert Path(common.DEPLOY / "Dockerfile.dockerignore").is_file()
