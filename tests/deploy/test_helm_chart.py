"""The helm chart renders offline, lints clean and validates against Kubernetes schemas."""

from __future__ import annotations

import os
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
    # a stateless Deployment has no state store, only the /tmp every pod gets
    assert [v["name"] for v in run_api["spec"]["template"]["spec"]["volumes"]] == ["tmp"]


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


def _workloads(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix("tether-"): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_topic_replication_and_declaration_are_values():
    for name, workload in _workloads(_render()).items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        assert env["TETHER_TOPIC_REPLICATION_FACTOR"]["value"] == "3", name
        assert [v["value"] for k, v in env.items() if k.endswith("_DECLARE_TOPICS")] == ["true"], name
    docs = _render({"kafka": {"replicationFactor": 1, "declareTopics": False}})
    for name, workload in _workloads(docs).items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        assert env["TETHER_TOPIC_REPLICATION_FACTOR"]["value"] == "1", name
        assert [v["value"] for k, v in env.items() if k.endswith("_DECLARE_TOPICS")] == ["false"], name
    with pytest.raises(Exception, match="replicationFactor"):
        _render({"kafka": {"replicationFactor": 0}})


def test_autoscaled_workloads_leave_the_replica_count_to_keda():
    assert {n: w["spec"].get("replicas") for n, w in _workloads(_render()).items()} == {
        "run-api": 2, "budget": 2, "planner": 3, "tool-gateway": 3, "approval": 1, "projector": 2}
    docs = _render({"autoscaling": {"enabled": True}})
    for doc in docs:
        _validate(doc)
    scaled = {d["spec"]["scaleTargetRef"]["name"].removeprefix("tether-"): d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"planner", "tool-gateway", "budget"}
    for name, workload in _workloads(docs).items():
        if name in scaled:
            # an upgrade must not reset what KEDA chose; KEDA starts from the configured count
            assert "replicas" not in workload["spec"], name
        else:
            assert workload["spec"]["replicas"] >= 1, name
    planner = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "tether-planner")
    assert planner["spec"]["minReplicaCount"] == 3


def _restricted_violations(pod: dict) -> list[str]:
    """The checks of the Kubernetes "restricted" Pod Security Standard (v1.33) that a pod spec can fail."""
    found = []
    pod_ctx = pod.get("securityContext", {})
    for c in pod["containers"] + pod.get("initContainers", []):
        ctx = c.get("securityContext", {})
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        if ctx.get("privileged"):
            found.append(f"{c['name']}: privileged")
        if ctx.get("capabilities", {}).get("drop") != ["ALL"]:
            found.append(f"{c['name']}: capabilities.drop must be [ALL]")
        if set(ctx.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']}: capabilities added")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            found.append(f"{c['name']}: runAsNonRoot")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            found.append(f"{c['name']}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{c['name']}: seccompProfile {seccomp}")
        if ctx.get("procMount", "Default") != "Default":
            found.append(f"{c['name']}: procMount")
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= allowed_volumes:
            found.append(f"volume {volume['name']}: {set(volume) - {'name'}}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(key)
    return found


def test_every_pod_meets_the_restricted_pod_security_standard():
    for name, workload in _workloads(_render({"autoscaling": {"enabled": True}})).items():
        pod = workload["spec"]["template"]["spec"]
        assert _restricted_violations(pod) == [], name
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        # the only writable places: /tmp (every pod) and the processors' state store
        tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
        assert next(v for v in pod["volumes"] if v["name"] == tmp["name"])["emptyDir"] == {"sizeLimit": "256Mi"}
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert writable == ({"/tmp", "/var/lib/tether/state"} if workload["kind"] == "StatefulSet" else {"/tmp"})


def test_a_service_can_override_its_security_context():
    # the tool-gateway's bubblewrap sandbox needs more than "restricted" allows (docs/configuration.md)
    docs = _render({"services": {"tool-gateway": {
        "hostUsers": False,
        "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/tether-sandbox.json"},
                            "procMount": "Unmasked", "appArmorProfile": {"type": "Unconfined"}},
    }}})
    for doc in docs:
        _validate(doc)
    workloads = _workloads(docs)
    gateway = workloads["tool-gateway"]["spec"]["template"]["spec"]
    ctx = gateway["containers"][0]["securityContext"]
    assert ctx["seccompProfile"] == {"type": "Localhost", "localhostProfile": "profiles/tether-sandbox.json"}
    assert ctx["procMount"] == "Unmasked" and gateway["hostUsers"] is False
    # the keys it did not name keep the chart-wide values
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert gateway["securityContext"]["runAsNonRoot"] is True
    for name, workload in workloads.items():
        if name != "tool-gateway":
            pod = workload["spec"]["template"]["spec"]
            assert _restricted_violations(pod) == [] and "hostUsers" not in pod, name


def test_services_take_their_own_env_and_secrets():
    webhook = {"name": "TETHER_APPROVAL_WEBHOOK_URL",
               "valueFrom": {"secretKeyRef": {"name": "approval-webhook", "key": "url"}}}
    docs = _render({
        "llm": {"apiKeySecret": "llm-keys"},
        "services": {
            "approval": {"env": [webhook, {"name": "TETHER_APPROVAL_WEBHOOK_TIMEOUT_S", "value": "5"}]},
            "tool-gateway": {"envFrom": [{"secretRef": {"name": "gateway-secrets"}},
                                         {"configMapRef": {"name": "gateway-policy"}}]},
            "planner": {"envFrom": [{"secretRef": {"name": "planner-extra"}}]},
        },
    })
    for doc in docs:
        _validate(doc)
    containers = {n: w["spec"]["template"]["spec"]["containers"][0] for n, w in _workloads(docs).items()}
    approval_env = _env(containers["approval"])
    assert approval_env["TETHER_APPROVAL_WEBHOOK_URL"] == webhook
    assert approval_env["TETHER_APPROVAL_WEBHOOK_TIMEOUT_S"]["value"] == "5"
    assert "TETHER_KAFKA_BOOTSTRAP" in approval_env  # the chart's own entries stay
    assert containers["tool-gateway"]["envFrom"] == [{"secretRef": {"name": "gateway-secrets"}},
                                                     {"configMapRef": {"name": "gateway-policy"}}]
    assert containers["planner"]["envFrom"] == [{"secretRef": {"name": "llm-keys"}},
                                                {"secretRef": {"name": "planner-extra"}}]
    assert "envFrom" not in containers["budget"]
    with pytest.raises(Exception, match="name"):
        _render({"services": {"approval": {"env": [{"value": "x"}]}}})


def test_the_prometheus_operator_scrapes_every_pod_and_selects_by_extra_labels():
    assert not [d for d in _render() if d["kind"] == "PodMonitor"]
    docs = _render({"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                                   "rules": {"enabled": True, "labels": {"release": "kps", "team": "agents"}}}})
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["labels"]["release"] == "kps" and rule["metadata"]["labels"]["team"] == "agents"
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tether"  # the chart's own stay
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["agents"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name, workload in _workloads(docs).items():
        template = workload["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert "metrics" in ports, name
    with pytest.raises(Exception, match="labels|type"):
        _render({"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": 1}}}})


def test_autoscaling_refuses_a_minimum_above_its_maximum():
    # KEDA refuses minReplicaCount > maxReplicaCount, and the workload has no replica count then
    with pytest.raises(Exception, match="minReplicaCount.*maxReplicaCount"):
        _render({"autoscaling": {"enabled": True}, "services": {"planner": {"replicas": 16}}})
    with pytest.raises(Exception, match="maxReplicaCount"):
        _render({"autoscaling": {"enabled": True, "maxReplicas": 2}})  # planner: 3 replicas
    docs = _render({"autoscaling": {"enabled": True}, "services": {"planner": {"replicas": 12}}})
    planner = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "tether-planner")
    assert planner["spec"]["minReplicaCount"] == planner["spec"]["maxReplicaCount"] == 12


def test_a_consumer_group_never_gets_more_replicas_than_partitions():
    for service in ("planner", "budget", "tool-gateway", "approval", "projector"):
        with pytest.raises(Exception, match=f"services.{service}.replicas .*kafka.partitions"):
            _render({"services": {service: {"replicas": 25}}})
    # run-api is no consumer group member: it scales past the partitions
    assert _workloads(_render({"services": {"run-api": {"replicas": 30}}}))["run-api"]["spec"]["replicas"] == 30
    assert _workloads(_render({"services": {"planner": {"replicas": 24}}}))["planner"]["spec"]["replicas"] == 24


def _redis_readers() -> set[str]:
    """The services whose code reads settings.redis_url."""
    services = CHART.parents[2] / "services"
    return {d.name for d in services.iterdir()
            if any("redis_url" in f.read_text() for f in d.glob("src/**/*.py"))}


def test_the_redis_url_reaches_only_its_readers_and_from_a_secret():
    readers = _redis_readers()
    assert readers == {"projector", "run-api", "tool-gateway"}, readers
    plain = {n: _env(w["spec"]["template"]["spec"]["containers"][0]).get("TETHER_REDIS_URL")
             for n, w in _workloads(_render()).items()}
    assert {n for n, e in plain.items() if e} == readers
    assert all(plain[n] == {"name": "TETHER_REDIS_URL", "value": "redis://redis:6379/0"} for n in readers)
    docs = _render({"redis": {"urlSecret": "tether-redis", "url": "redis://:unused@redis:6379/0"}})
    for doc in docs:
        _validate(doc)
    for name, workload in _workloads(docs).items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        if name in readers:
            assert env["TETHER_REDIS_URL"] == {"name": "TETHER_REDIS_URL",
                                               "valueFrom": {"secretKeyRef": {"name": "tether-redis", "key": "url"}}}
        else:
            assert "TETHER_REDIS_URL" not in env, name
    assert "unused" not in yaml.safe_dump_all(docs)
    # a password in clear is refused, not rendered into the pods
    for url in ("redis://:s3cret@redis:6379/0", "rediss://user:s3cret@redis:6380/0"):
        with pytest.raises(Exception, match="redis.urlSecret") as refused:
            _render({"redis": {"url": url}})
        assert "s3cret" not in str(refused.value)


def test_the_grace_period_is_a_value_per_service():
    graces = {n: w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for n, w in _workloads(_render()).items()}
    # the gateway lets a 15-minute tool call end; the others commit, hand over and close within it
    assert graces == {"run-api": 45, "budget": 45, "planner": 45, "tool-gateway": 930, "approval": 45, "projector": 45}
    docs = _render({"terminationGracePeriodSeconds": 60,
                    "services": {"planner": {"terminationGracePeriodSeconds": 660},
                                 "tool-gateway": {"terminationGracePeriodSeconds": 0}}})
    for doc in docs:
        _validate(doc)
    graces = {n: w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for n, w in _workloads(docs).items()}
    assert graces == {"run-api": 60, "budget": 60, "planner": 660, "tool-gateway": 0, "approval": 60, "projector": 60}
    with pytest.raises(Exception, match="terminationGracePeriodSeconds"):
        _render({"services": {"planner": {"terminationGracePeriodSeconds": -1}}})


def test_keda_watches_every_topic_a_scaled_service_consumes():
    from tether_messaging.topics import COMMANDS, RUN_EVENTS, RUN_INTAKE

    docs = _render({"autoscaling": {"enabled": True}})
    topics = {d["metadata"]["name"].removeprefix("tether-"): [t["metadata"]["topic"] for t in d["spec"]["triggers"]]
              for d in docs if d["kind"] == "ScaledObject"}
    # the processors' inputs (budget: entrypoint.py; planner, tool-gateway: the run log)
    assert {k: set(v) for k, v in topics.items()} == {
        "budget": {COMMANDS, RUN_INTAKE}, "planner": {RUN_EVENTS}, "tool-gateway": {RUN_EVENTS}}
    assert len(topics["budget"]) == 2
    budget = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "tether-budget")
    assert {t["metadata"]["consumerGroup"] for t in budget["spec"]["triggers"]} == {"budget"}
    # one topic may still be given as a string
    docs = _render({"autoscaling": {"enabled": True, "targets": {"approval": COMMANDS}}})
    approval = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "tether-approval")
    assert [t["metadata"]["topic"] for t in approval["spec"]["triggers"]] == [COMMANDS]


def _satisfies(constraint: str, version: str) -> bool:
    """`version` against a `>=X.Y.Z-0` constraint as helm reads it (the -0 admits pre-releases
    such as cloud builds, v1.28.3-eks-1234)."""
    floor = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.(\d+)-0", constraint)
    assert floor, constraint
    have = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version)
    return tuple(map(int, have.groups())) >= tuple(map(int, floor.groups()))


def test_the_chart_requires_the_kubernetes_that_labels_pods_with_their_index():
    # INSTANCE_ID comes from apps.kubernetes.io/pod-index, set on pods from Kubernetes 1.28
    planner = _workloads(_render())["planner"]["spec"]["template"]["spec"]["containers"][0]
    assert "pod-index" in _env(planner)["TETHER_PLANNER_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    constraint = helm.Chart.load(CHART).metadata.get("kubeVersion", "")
    assert constraint, "Chart.yaml names no kubeVersion"
    assert not _satisfies(constraint, "v1.27.9") and not _satisfies(constraint, "v1.27.3-eks-1234")
    assert _satisfies(constraint, "v1.28.0") and _satisfies(constraint, "v1.28.3-gke.100")
    assert _satisfies(constraint, KUBE_VERSION)


def test_a_schema_write_release_reaches_every_workload_only_when_set():
    for name, workload in _workloads(_render()).items():
        assert "TETHER_SCHEMA_WRITE_RELEASE" not in _env(workload["spec"]["template"]["spec"]["containers"][0]), name
    docs = _render({"schemaWriteRelease": "v1"})
    workloads = _workloads(docs)
    assert len(workloads) == 6
    for name, workload in workloads.items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        assert env["TETHER_SCHEMA_WRITE_RELEASE"] == {"name": "TETHER_SCHEMA_WRITE_RELEASE", "value": "v1"}, name
    with pytest.raises(Exception, match="schemaWriteRelease"):
        _render({"schemaWriteRelease": "1.0"})


def test_cap_ceilings_reach_run_api_and_the_budget_alike(monkeypatch: pytest.MonkeyPatch):
    # run-api refuses an agent above a ceiling the budget would reject (CapCeilingSettings): a ceiling
    # raised for the budget alone left run-api at the default, refusing every agent above it.
    for name, workload in _workloads(_render()).items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        assert not [k for k in env if k.startswith("TETHER_BUDGET_CEILING_")], name  # the code's defaults
    docs = _render({"capCeilings": {"maxSteps": 5000, "maxWallClockMs": 1_209_600_000}})
    for doc in docs:
        _validate(doc)
    rendered = {}
    for name, workload in _workloads(docs).items():
        env = _env(workload["spec"]["template"]["spec"]["containers"][0])
        rendered[name] = {k: v["value"] for k, v in env.items() if k.startswith("TETHER_BUDGET_CEILING_")}
    expected = {"TETHER_BUDGET_CEILING_MAX_STEPS": "5000", "TETHER_BUDGET_CEILING_MAX_WALL_CLOCK_MS": "1209600000"}
    assert rendered == {"run-api": expected, "budget": expected, "planner": {}, "tool-gateway": {},
                        "approval": {}, "projector": {}}

    # What each service's settings read from that env: the same ceilings.
    from tether_budget.settings import BudgetSettings
    from tether_run_api.settings import RunApiSettings

    for name, settings_cls in (("run-api", RunApiSettings), ("budget", BudgetSettings)):
        with monkeypatch.context() as env:
            for key in [k for k in os.environ if k.startswith("TETHER_BUDGET_CEILING_")]:
                env.delenv(key)
            for key, value in rendered[name].items():
                env.setenv(key, value)
            settings = settings_cls()
            assert (settings.ceiling_max_steps, settings.ceiling_max_wall_clock_ms) == (5000, 1_209_600_000), name
            assert settings.ceiling_max_tokens == 50_000_000  # a key left out keeps the default


def test_a_cap_ceiling_in_one_services_env_is_refused():
    for service in ("budget", "run-api", "planner"):
        with pytest.raises(Exception, match="capCeilings"):
            _render({"services": {service: {"env": [{"name": "TETHER_BUDGET_CEILING_MAX_STEPS", "value": "5000"}]}}})
    with pytest.raises(Exception, match="capCeilings"):
        _render({"capCeilings": {"maxStep": 5000}})  # not a ceiling
    with pytest.raises(Exception, match="capCeilings"):
        _render({"capCeilings": {"maxSteps": 0}})


def test_the_approval_expiry_grace_must_outlast_run_apis_delivery_timeout():
    # A decision run-api took by the expiry reaches the commands topic within its delivery timeout; the
    # approval service waits the grace past the expiry for it. A grace at or below that timeout lets a
    # decision run-api answered APPROVED be read after EXPIRED decided (DECISION_AFTER_EXPIRY).
    from tether_approval.settings import ApprovalSettings
    from tether_run_api.settings import RunApiSettings

    grace, delivery = ApprovalSettings().expiry_grace_ms, RunApiSettings().delivery_timeout_ms
    assert grace > delivery  # the services' defaults agree

    def env(name: str, value: int | None = None, secret: bool = False) -> list[dict]:
        if secret:
            return [{"name": name, "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
        return [{"name": name, "value": str(value)}]

    def values(grace_env: list[dict] | None = None, delivery_env: list[dict] | None = None) -> dict:
        services = {}
        if grace_env is not None:
            services["approval"] = {"env": grace_env}
        if delivery_env is not None:
            services["run-api"] = {"env": delivery_env}
        return {"services": services}

    _render(values(env("TETHER_APPROVAL_EXPIRY_GRACE_MS", delivery + 1)))
    _render(values(delivery_env=env("TETHER_RUN_API_DELIVERY_TIMEOUT_MS", grace - 1)))
    _render(values(env("TETHER_APPROVAL_EXPIRY_GRACE_MS", 5_000), env("TETHER_RUN_API_DELIVERY_TIMEOUT_MS", 4_000)))
    for bad in (values(env("TETHER_APPROVAL_EXPIRY_GRACE_MS", delivery)),
                values(delivery_env=env("TETHER_RUN_API_DELIVERY_TIMEOUT_MS", grace)),
                values(env("TETHER_APPROVAL_EXPIRY_GRACE_MS", 5_000), env("TETHER_RUN_API_DELIVERY_TIMEOUT_MS", 60_000))):
        with pytest.raises(Exception, match="TETHER_APPROVAL_EXPIRY_GRACE_MS"):
            _render(bad)
    # A value from a Secret is not known when rendering: the chart checks the default in its place.
    _render(values(env("TETHER_APPROVAL_EXPIRY_GRACE_MS", secret=True)))


def test_a_blocked_partition_and_a_restarting_pod_are_alerted():
    docs = _render({"monitoring": {"rules": {"enabled": True}}})
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    groups = {g["name"]: {a["alert"]: a for a in g["rules"]} for g in rule["spec"]["groups"]}
    blocked = groups["tether.loop"]["TetherPartitionBlocked"]
    promql_parser.parse(blocked["expr"])
    assert "tether_loop_blocked" in blocked["expr"] and "tether_loop_blocked" in _loop_metric_names()
    assert blocked["labels"]["severity"] == "critical" and "for" not in blocked
    assert "{{ $labels.partition }}" in blocked["annotations"]["summary"]

    # kube-state-metrics' standard restart counter, scoped to this release's pods in its namespace.
    restarts = groups["tether.pods"]["TetherPodRestarting"]
    promql_parser.parse(restarts["expr"])
    assert "kube_pod_container_status_restarts_total{" in restarts["expr"]
    assert 'namespace="agents"' in restarts["expr"]
    pod_re = re.search(r'pod=~"([^"]+)"', restarts["expr"]).group(1)
    for pod in ("tether-budget-0", "tether-projector-7c9d8f6b5-x2x9q", "tether-run-api-5f7b9c-abcde",
                "tether-tool-gateway-2"):
        assert re.fullmatch(pod_re, pod), pod
    for pod in ("other-budget-0", "tether-redis-0", "tether-budget"):
        assert not re.fullmatch(pod_re, pod), pod
