"""The helm chart renders offline, lints clean and validates against Kubernetes schemas."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import promql_parser
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tether"
KUBE_VERSION = "1.33.0"


def _render(values: dict | None = None) -> list[dict]:
    chart = helm.Chart.load(CHART)
    manifests = chart.render(values or {}, name="tether", namespace="agents")
    docs = []
    for text in manifests.values():
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def _validate(doc: dict) -> None:
    if doc["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
        return  # a CRD: kubernetes-validate has no schema for it
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_lint_is_clean():
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_service_has_a_workload_and_all_validate():
    docs = _render()
    for doc in docs:
        _validate(doc)
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert set(workloads) == {
        f"tether-{s}" for s in ("run-api", "budget", "planner", "tool-gateway", "approval", "projector")
    }
    # exactly-once processors get stable pod names (transactional.id slots)
    for s in ("budget", "planner", "tool-gateway", "approval"):
        assert workloads[f"tether-{s}"]["kind"] == "StatefulSet"


def test_scaling_a_consumer_group_is_a_values_change():
    docs = _render({"services": {"planner": {"replicas": 7}}})
    planner = next(d for d in docs if d["metadata"]["name"] == "tether-planner" and d["kind"] == "StatefulSet")
    assert planner["spec"]["replicas"] == 7


def test_autoscaling_never_exceeds_partitions():
    docs = _render({"autoscaling": {"enabled": True, "maxReplicas": 100}, "kafka": {"partitions": 12}})
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled and all(d["spec"]["maxReplicaCount"] == 12 for d in scaled)


def test_no_secret_values_in_rendered_manifests():
    docs = _render({"llm": {"apiKeySecret": "llm-keys"}})
    planner = next(d for d in docs if d["metadata"]["name"] == "tether-planner" and d["kind"] == "StatefulSet")
    container = planner["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "llm-keys"}}]
    dsn = next(e for e in container["env"] if e["name"] == "TETHER_PG_DSN")
    assert "valueFrom" in dsn and "value" not in dsn


def test_invalid_values_are_rejected():
    with pytest.raises(Exception, match="replicas"):
        _render({"services": {"planner": {"replicas": "three"}}})


def test_exactly_once_processors_keep_their_state_store_on_pod_disk():
    docs = _render({"stateVolume": {"sizeLimit": "5Gi"}})
    for s in ("budget", "planner", "tool-gateway", "approval"):
        pod = next(d for d in docs if d["metadata"]["name"] == f"tether-{s}" and d["kind"] == "StatefulSet")
        spec = pod["spec"]["template"]["spec"]
        container = spec["containers"][0]
        state_dir = next(e["value"] for e in container["env"] if e["name"].endswith("_STATE_DIR"))
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == state_dir)
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        # scratch disk, not a memory filesystem (tmpfs pages would count as the pod's memory)
        assert volume["emptyDir"] == {"sizeLimit": "5Gi"}
    run_api = next(d for d in docs if d["metadata"]["name"] == "tether-run-api" and d["kind"] == "Deployment")
    assert "volumes" not in run_api["spec"]["template"]["spec"]


def _loop_metric_names() -> set[str]:
    """Every series name the loop's metrics expose (a labelled metric with no children yet has no
    samples, so the names come from each family's type)."""
    from prometheus_client import REGISTRY

    import tether_messaging.loop  # noqa: F401 - registers the loop's metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in REGISTRY.collect() for suffix in suffixes.get(family.type, ("",))}


def test_alerts_are_off_by_default_and_use_only_metrics_the_loop_exports():
    assert not [d for d in _render() if d["kind"] == "PrometheusRule"]
    docs = _render({"monitoring": {"rules": {"enabled": True, "lagRecords": 77}}})
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    alerts = rule["spec"]["groups"][0]["rules"]
    assert {a["alert"] for a in alerts} >= {"TetherConsumerLagHigh", "TetherInputAgeHigh", "TetherCommitSlow",
                                           "TetherDeadLetters"}
    known = _loop_metric_names()
    for alert in alerts:
        promql_parser.parse(alert["expr"])  # raises ValueError on invalid PromQL
        used = set(re.findall(r"\b(tether_[a-z_]+)", alert["expr"]))
        assert used and used <= known, (alert["alert"], used - known)
        # Prometheus' own templating survives helm's.
        assert "{{ $labels" in alert["annotations"]["summary"] or "{{ $value" in alert["annotations"]["summary"]
    lag = next(a for a in alerts if a["alert"] == "TetherConsumerLagHigh")
    assert lag["expr"].endswith("> 77") and lag["for"] == "10m"


def test_alert_thresholds_are_validated():
    with pytest.raises(Exception, match="for|pattern"):
        _render({"monitoring": {"rules": {"enabled": True, "for": "ten minutes"}}})
