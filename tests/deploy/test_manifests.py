"""deploy/: Kubernetes manifests validated offline against the schemas that kubernetes-validate
bundles (pinned Kubernetes version), and the Grafana dashboard's queries checked against the
series the router registers (request, batch and layer-skip series alike)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from text_generation_router.engine.metrics import build_metrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "tgi-dashboard.json"
K8S_VERSION = "1.33.0"
# Custom resources (Prometheus Operator) have no bundled schema; checked by hand below.
CRD_KINDS = {"PodMonitor"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def by_kind(kind: str) -> dict[str, Any]:
    matches = [doc for _, doc in resources() if doc["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


@pytest.mark.parametrize("name,doc", [r for r in resources() if r[1]["kind"] not in CRD_KINDS],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_manifest_validates_strictly(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_is_real_a_misspelled_field_is_refused() -> None:
    broken = json.loads(json.dumps(by_kind("Deployment")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_deployment_probes_resources_and_scraping() -> None:
    deployment = by_kind("Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    port = next(p for p in container["ports"] if p["name"] == "http")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PORT"] == str(port["containerPort"]), "the launcher listens on $PORT"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_service_hpas_and_podmonitor_target_the_deployment() -> None:
    deployment = by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = by_kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    hpas = [doc for _, doc in resources() if doc["kind"] == "HorizontalPodAutoscaler"]
    assert {m["type"] for hpa in hpas for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployment["metadata"]["name"]}
    queue_metric = next(m["pods"]["metric"]["name"] for hpa in hpas for m in hpa["spec"]["metrics"]
                        if m["type"] == "Pods")
    assert queue_metric in router_series()
    monitor = by_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def router_series() -> set[str]:
    """Metric family names the router registers (its real registry, not a copy of the list)."""
    registry = build_metrics(max_input_tokens=64, max_total_tokens=96).registry
    return {family.name for family in registry.collect()}


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in re.findall(r"\b(tgi_[a-z_]+)", e)}


def family(metric: str, known: set[str]) -> str:
    """The family a queried series belongs to (tgi_request_count is itself a family)."""
    if metric in known:
        return metric
    for suffix in HISTOGRAM_SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def test_dashboard_is_well_formed_and_queries_only_known_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} queries nothing"
    metrics = dashboard_metrics(dashboard)
    known = router_series()
    unknown = sorted(m for m in metrics if family(m, known) not in known)
    assert not unknown, f"the dashboard queries series the router does not expose: {unknown}"
    covered = {family(m, known) for m in metrics}
    assert {"tgi_queue_size", "tgi_request_duration", "tgi_batch_current_size"} <= covered
    assert {"tgi_layer_skip_plans", "tgi_layer_skip_layers_skipped", "tgi_layer_skip_policy_loaded"} <= covered
