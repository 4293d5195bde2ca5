"""The Helm chart: rendered by Helm's own Go library (helm-python-sdk, no helm binary), linted,
every manifest validated against the Kubernetes API schemas, and the rendered config file
accepted by the router that reads it."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from copy import deepcopy
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.core.redis_client import RedisTarget
from router.core.settings import (
    BackendConfig,
    DnsDiscovery,
    InferencePoolDiscovery,
    KubernetesDiscovery,
    Settings,
    load_settings,
)
from router.ops.metrics import Metrics
from router.ops.tracing import resolve
from tests.support.harness import ROOT, Cluster, stats

CHART = ROOT / "helm" / "sluicegate"
KUBE_VERSIONS = ("1.30.0", "1.33.0")

ALL_ON: dict[str, Any] = {
    "backends": [
        {
            "name": "vllm-a",
            "url": "http://vllm-a.models.svc:8000",
            "models": ["meta-llama/Llama-3.1-8B-Instruct"],
            "weight": 2,
            "max_inflight": 64,
        },
        {
            "name": "openai",
            "url": "https://api.openai.com",
            "kind": "openai",
            "models": {"gpt-4o-mini": "gpt-4o-mini"},
            "apiKeySecret": {"name": "openai-credentials", "key": "api-key"},
        },
    ],
    "adminToken": {"existingSecret": "sg-admin", "key": "token"},
    "clientKeys": {"existingSecret": "sg-clients", "key": "api_keys.yaml"},
    "extraEnv": [
        {"name": "LATER_KEY", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}
    ],
    "extraEnvFrom": [{"secretRef": {"name": "more-backend-keys"}}],
    "redis": {"enabled": True},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 3,
        "maxReplicas": 12,
        "queueDepth": {"enabled": True},
    },
    "config": {"api_keys": [{"sha256": "ab" * 32, "name": "ci"}], "admission": {"max_wait": 20}},
    "podDisruptionBudget": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "ingress": {
        "enabled": True,
        "tls": [{"hosts": ["sluicegate.example.com"], "secretName": "sg-tls"}],
    },
    "dashboard": {"enabled": True},
    "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318", "sampleRatio": 0.2},
    "podAnnotations": {"team": "ml-platform"},
    "nodeSelector": {"pool": "cpu"},
}
EXTERNAL_REDIS: dict[str, Any] = {
    "redis": {"existingSecret": "sg-redis", "existingSecretKey": "url"},
    "podDisruptionBudget": {"enabled": False},
    "serviceAccount": {"create": False, "name": "shared"},
}
DISCOVERY: dict[str, Any] = {
    "backends": [],
    "discovery": [
        {
            "kind": "kubernetes",
            "namespace": "models",
            "service": "vllm-llama",
            "port": "http",
            "models": "auto",
            "backend": {"kind": "vllm", "max_inflight": 64},
            "resync": 300,
        },
        {"kind": "kubernetes", "label_selector": "app=vllm", "port": 8000, "models": ["m"]},
        {"kind": "dns", "name": "vllm-llama-headless.models.svc", "port": 8000, "models": ["m"]},
    ],
}
SENTINEL_REDIS: dict[str, Any] = {
    "redis": {
        "url": "rediss://:pw@unused/2",
        "sentinel": {
            "hosts": ["sentinel-0.redis:26379", "sentinel-1.redis:26379", "sentinel-2.redis:26379"],
            "master": "llm-redis",
            "passwordSecret": {"name": "sg-sentinel", "key": "password"},
        },
    },
}
CLUSTER_REDIS: dict[str, Any] = {
    "redis": {"url": "redis://redis-cluster.redis:6379", "cluster": True}
}
# The endpoint picker profile, as shipped (helm install -f values-picker.yaml).
PICKER: dict[str, Any] = yaml.safe_load((CHART / "values-picker.yaml").read_text())
INFERENCEPOOL_SCHEMA = ROOT / "tests" / "support" / "data" / "inferencepool-v1.schema.json"
SCALE_FROM_ZERO: dict[str, Any] = {
    "redis": {"enabled": True},
    "scaleFromZero": {
        "enabled": True,
        "scalerPort": 9091,
        "targetPerReplica": 8,
        "models": [
            {
                "name": "llama-70b",
                "deployment": "vllm-llama-70b",
                "namespace": "models",
                "maxReplicaCount": 4,
            },
            {"name": "qwen-7b", "deployment": "vllm-qwen"},
            {"name": "declared-only"},  # held and scaled by hand: no ScaledObject
        ],
    },
}
VARIANTS = {
    "defaults": None,
    "picker": PICKER,
    "all_on": ALL_ON,
    "external_redis": EXTERNAL_REDIS,
    "discovery": DISCOVERY,
    "sentinel_redis": SENTINEL_REDIS,
    "cluster_redis": CLUSTER_REDIS,
    "scale_from_zero": SCALE_FROM_ZERO,
}
KEDA_SCHEMA = ROOT / "tests" / "support" / "data" / "keda-scaledobject-v1alpha1.schema.json"


def render(values: dict[str, Any] | None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="sg", namespace="llm", is_install=True)


def manifests(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    docs = []
    for path, text in render(values).items():
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def router_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [
        d for d in by_kind(docs, "Deployment") if not d["metadata"]["name"].endswith("-redis")
    ]
    return dep


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_manifest_is_valid_kubernetes(variant: str, kube: str) -> None:
    docs = manifests(VARIANTS[variant])
    for doc in docs:
        if doc["apiVersion"] in (
            "monitoring.coreos.com/v1",
            "inference.networking.k8s.io/v1",
            "keda.sh/v1alpha1",
        ):
            continue  # a CRD: its own test below
        kubernetes_validate.validate(doc, kube, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    if variant == "all_on":
        assert kinds == sorted(
            [
                "ConfigMap",
                "ConfigMap",
                "Deployment",
                "Deployment",
                "HorizontalPodAutoscaler",
                "Ingress",
                "PodDisruptionBudget",
                "Service",
                "Service",
                "ServiceAccount",
                "ServiceMonitor",
            ]
        )
    if variant == "defaults":
        assert kinds == sorted(
            ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
        )


def test_kubernetes_discovery_gets_read_only_rbac_in_each_watched_namespace() -> None:
    docs = manifests(DISCOVERY)
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding")}
    # The selector-based source names no namespace: the release's own ("llm").
    assert set(roles) == set(bindings) == {"models", "llm"}
    (sa,) = by_kind(docs, "ServiceAccount")
    for ns, role in roles.items():
        assert role["rules"] == [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        b = bindings[ns]
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "llm"}
        ]
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True  # the client needs the token
    config = yaml.safe_load(_rendered_config(DISCOVERY))
    assert [s.get("namespace") for s in config["discovery"]] == ["models", "llm", None]
    # Without a kubernetes source: no RBAC, and no token in the pod.
    plain = manifests(None)
    assert by_kind(plain, "Role") == [] and by_kind(plain, "RoleBinding") == []
    assert (
        router_deployment(plain)["spec"]["template"]["spec"]["automountServiceAccountToken"]
        is False
    )


def test_service_monitor_scrapes_the_router_service() -> None:
    docs = manifests(ALL_ON)
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["path"] == "/metrics"
    selector = sm["spec"]["selector"]["matchLabels"]
    services = [
        s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in services] == ["sg-sluicegate"]
    assert ep["port"] in {p["name"] for p in services[0]["spec"]["ports"]}


def test_deployment_drains_safely_and_runs_locked_down() -> None:
    docs = manifests(ALL_ON)
    dep = router_deployment(docs)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] > 30 + 5  # drain_grace + preStop
    assert "replicas" not in dep["spec"]  # the HPA owns it
    assert c["args"][c["args"].index("--workers") + 1] == "2"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert set(mounts) == {"/etc/sluicegate", "/tmp", "/etc/sluicegate/client-keys"}
    (keys_volume,) = [
        v for v in pod["volumes"] if v["name"] == mounts["/etc/sluicegate/client-keys"]
    ]
    assert keys_volume["secret"]["secretName"] == "sg-clients"
    assert c["envFrom"] == [{"secretRef": {"name": "more-backend-keys"}}]
    env = {e["name"]: e for e in c["env"]}
    refs = {n: e["valueFrom"]["secretKeyRef"] for n, e in env.items() if "valueFrom" in e}
    assert refs == {
        "BACKEND_API_KEY_1": {"name": "openai-credentials", "key": "api-key"},
        "SLUICEGATE_ADMIN_TOKEN": {"name": "sg-admin", "key": "token"},
        "LATER_KEY": {"name": "later", "key": "k"},
    }
    assert env["SLUICEGATE_API_KEYS_FILE"]["value"] == "/etc/sluicegate/client-keys/api_keys.yaml"
    assert env["SLUICEGATE_REDIS_URL"]["value"] == "redis://sg-sluicegate-redis:6379/0"
    redis = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-redis")]
    assert redis[0]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # The router's Service and PDB select router pods only, never the bundled Redis.
    router_sel = dep["spec"]["selector"]["matchLabels"]
    redis_labels = redis[0]["spec"]["template"]["metadata"]["labels"]
    assert not router_sel.items() <= redis_labels.items()


@pytest.mark.parametrize(("drain_grace", "pre_stop"), [(300, 10), (45.5, 0), (0, 5)])
def test_termination_grace_follows_drain_grace(
    drain_grace: float, pre_stop: int, tmp_path: Path
) -> None:
    """Kubernetes kills the pod terminationGracePeriodSeconds after it starts stopping it (the
    preStop sleep included): longer than the sleep plus the drain_grace the router reads from
    the rendered config, with a margin for the process to exit."""
    values = {"config": {"drain_grace": drain_grace}, "preStopSleepSeconds": pre_stop}
    docs = manifests(values)
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    path = tmp_path / "config.yaml"
    path.write_text(_rendered_config(values))
    read = load_settings(path).drain_grace
    assert read == drain_grace
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + read + 5
    (c,) = pod["containers"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]


def test_external_redis_url_from_a_secret() -> None:
    env = router_deployment(manifests(EXTERNAL_REDIS))["spec"]["template"]["spec"]
    (c,) = env["containers"]
    ref = {e["name"]: e for e in c["env"]}["SLUICEGATE_REDIS_URL"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "sg-redis", "key": "url"}


@pytest.mark.parametrize(
    ("values", "kind"),
    [(SENTINEL_REDIS, "sentinel"), (CLUSTER_REDIS, "cluster"), (EXTERNAL_REDIS, "standalone")],
)
def test_redis_topology_env_is_what_the_router_reads(
    values: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (c,) = router_deployment(manifests(values))["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"] if e["name"].startswith("SLUICEGATE_REDIS")}
    for name, e in env.items():  # a Secret's value stands in for the one Kubernetes would fill
        monkeypatch.setenv(name, e.get("value", "redis://:from-secret@redis:6379/0"))
    settings = load_settings()
    target = RedisTarget.from_settings(settings)
    assert target is not None and target.kind == kind
    if kind == "sentinel":
        assert settings.redis_sentinel_master == "llm-redis"
        assert target.sentinels == tuple(values["redis"]["sentinel"]["hosts"])
        assert env["SLUICEGATE_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "sg-sentinel",
            "key": "password",
        }


@pytest.mark.parametrize(
    "values",
    [
        {"redis": {"enabled": True, "cluster": True}},
        {"redis": {"enabled": True, "sentinel": {"hosts": ["s:26379"]}}},
        {"redis": {"cluster": True}},
        {"redis": {"url": "redis://r:6379", "cluster": True, "sentinel": {"hosts": ["s:26379"]}}},
    ],
)
def test_redis_topologies_that_cannot_work_are_refused(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError, match="redis"):
        render(values)


def test_ingress_carries_streaming_annotations() -> None:
    (ing,) = by_kind(manifests(ALL_ON), "Ingress")
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ann["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert ing["spec"]["ingressClassName"] == "nginx"


def _rendered_config(values: dict[str, Any] | None) -> str:
    (cm,) = [
        d for d in by_kind(manifests(values), "ConfigMap") if "config.yaml" in d.get("data", {})
    ]
    return str(cm["data"]["config.yaml"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_config_is_accepted_by_the_loader(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_rendered_config(VARIANTS[variant]))
    monkeypatch.setenv("BACKEND_API_KEY_1", "from-the-secret")
    settings = load_settings(path)
    wanted = (VARIANTS[variant] or {}).get("backends", [{"name": "vllm"}])
    assert [b.name for b in settings.backends] == [b["name"] for b in wanted]
    if variant == "all_on":
        assert settings.backends[1].resolved_key() == "from-the-secret"
        assert settings.backends[0].weight == 2
    assert settings.drain_grace == 30


def test_rendered_config_serves_traffic(procs: Cluster) -> None:
    """`sluicegate serve` started on the chart's config, with the key from the env the chart
    sets, routes a request to the backend with that key."""
    mock = procs.mock("chart", tokens=3)
    values = deepcopy(ALL_ON)
    values["backends"] = [
        {
            "name": "local",
            "url": mock.url,
            "models": {"m": "mock-model"},
            "apiKeySecret": {"name": "s", "key": "k"},
        },
    ]
    values["config"] = {"api_keys": [hashlib.sha256(b"client-key-for-chart").hexdigest()]}
    config = yaml.safe_load(_rendered_config(values))
    router = procs.router(config, env={"BACKEND_API_KEY_0": "key-from-secret-env"})
    assert httpx.get(router.url + "/readyz").status_code == 200
    body = {"model": "m", "max_tokens": 2}
    url = router.url + "/v1/completions"
    assert httpx.post(url, json=body).status_code == 401  # the chart's client keys apply
    r = httpx.post(url, json=body, headers={"authorization": "Bearer client-key-for-chart"})
    assert r.status_code == 200
    assert stats(mock)["recent"][-1]["authorization"] == "Bearer key-from-secret-env"


def test_tracing_values_point_the_router_at_a_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(_rendered_config(ALL_ON))
    plan = resolve(load_settings(path).tracing)
    assert plan is not None
    assert plan.endpoint == "http://otel-collector.observability:4318/v1/traces"
    assert (plan.sample_ratio, plan.service_name) == (0.2, "sluicegate")
    path.write_text(_rendered_config(None))
    assert "tracing" not in yaml.safe_load(path.read_text())  # off by default
    assert resolve(load_settings(path).tracing) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"workers": 0},
        {"logLevel": "verbose"},
        {"backends": []},
        {"backends": [{"name": "a", "models": ["m"]}]},
        {"backends": [{"name": "a", "url": "http://a", "models": ["m"], "api_key": "inline"}]},
        {"backends": [{"name": "bad name", "url": "http://a", "models": ["m"]}]},
        {"replicas": 3},
        {"ingress": {"enabled": "yes"}},
        {"redis": {"url": "http://not-redis"}},
        {"redis": {"sentinel": {"hosts": ["no-port"]}}},
        {"redis": {"cluster": "yes"}},
        {"config": {"drain_grace": -1}},
        {"backends": [], "discovery": [{"kind": "kubernetes", "port": "http"}]},
        {"discovery": [{"kind": "kubernetes", "service": "s", "label_selector": "a=b", "port": 1}]},
        {"discovery": [{"kind": "dns", "name": "x", "port": "http"}]},
        {"discovery": [{"kind": "dns", "name": "x", "port": 1, "backend": {"url": "http://x"}}]},
        {"tracing": {"otlpEndpoint": "otel-collector:4318"}},
        {"tracing": {"sampleRatio": 1.5}},
    ],
)
def test_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values(bad))


def test_bundled_and_external_redis_together_is_refused() -> None:
    with pytest.raises(helm.HelmError, match="redis"):
        render({"redis": {"enabled": True, "url": "redis://elsewhere:6379/0"}})


def test_dashboard_covers_every_metric_and_only_real_ones() -> None:
    (cm,) = [
        d
        for d in by_kind(manifests(ALL_ON), "ConfigMap")
        if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["sluicegate.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(bucket|count|sum)$", "", n)
        for e in exprs
        for n in re.findall(r"\bsluicegate_[a-z_]+", e)
    }
    defined = set()
    for family in Metrics().registry.collect():
        defined.add(family.name + ("_total" if family.type == "counter" else ""))
    assert used <= defined, used - defined
    assert defined <= used, defined - used


def test_schema_names_only_settings_the_router_knows() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    config_keys = set(schema["properties"]["config"]["properties"])
    assert config_keys <= set(Settings.model_fields), config_keys - set(Settings.model_fields)
    backend_keys = set(schema["properties"]["backends"]["items"]["properties"]) - {"apiKeySecret"}
    assert backend_keys <= set(BackendConfig.model_fields)
    assert "api_key" not in backend_keys  # keys only through Secrets
    for source in schema["properties"]["discovery"]["items"]["oneOf"]:
        kind = source["properties"]["kind"]["const"]
        model = {
            "kubernetes": KubernetesDiscovery,
            "inferencepool": InferencePoolDiscovery,
            "dns": DnsDiscovery,
        }[kind]
        assert set(source["properties"]) <= set(model.model_fields)


def test_autoscaling_can_follow_the_admission_queue() -> None:
    (hpa,) = by_kind(manifests(ALL_ON), "HorizontalPodAutoscaler")
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "sluicegate_queue_depth"
    assert metrics["Pods"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "10"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["autoscaling"]["queueDepth"]["enabled"] is False  # off by default


def test_backend_tls_files_come_from_mounted_secrets() -> None:
    tls = {"ca_file": "/etc/sluicegate/tls/vllm-tls/ca.crt", "server_name": "vllm.default.svc"}
    values = {
        "backends": [{"name": "vllm", "url": "https://10.0.0.5:8000", "models": ["m"], "tls": tls}],
        "backendTlsSecrets": ["vllm-tls"],
    }
    dep = router_deployment(manifests(values))
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts["/etc/sluicegate/tls/vllm-tls"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"] == {"secretName": "vllm-tls", "defaultMode": 0o440}
    assert pod["securityContext"]["fsGroup"] == 10001  # the group the key is readable by
    (backend,) = yaml.safe_load(_rendered_config(values))["backends"]
    assert backend["tls"] == tls


def test_picker_profile_runs_the_endpoint_picker_with_grpc_health() -> None:
    docs = manifests(PICKER)
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == [
        "epp",
        "--config",
        "/etc/sluicegate/config.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "9002",
        "--metrics-port",
        "9090",
    ]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 9002, "http": 9090}  # the reference picker's ports
    assert c["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert pod["automountServiceAccountToken"] is True  # it watches the pool and its pods
    (svc,) = by_kind(docs, "Service")
    grpc = {p["name"]: p for p in svc["spec"]["ports"]}["grpc-ext-proc"]
    assert (grpc["port"], grpc["targetPort"], grpc["appProtocol"]) == (9002, "grpc", "http2")
    assert svc["spec"]["selector"] == router_deployment(docs)["spec"]["selector"]["matchLabels"]
    # The ServiceMonitor's port: the HTTP one, where /metrics is.
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["http"] == 9090


def test_picker_profile_watches_its_own_pool_with_read_only_rbac(tmp_path: Path) -> None:
    docs = manifests(PICKER)
    (pool,) = by_kind(docs, "InferencePool")
    path = tmp_path / "config.yaml"
    path.write_text(_rendered_config(PICKER))
    (source,) = load_settings(path).discovery
    assert isinstance(source, InferencePoolDiscovery)
    assert (source.name, source.namespace) == (pool["metadata"]["name"], "llm")
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    (binding,) = by_kind(docs, "RoleBinding")
    (sa,) = by_kind(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "llm"}
    ]
    # A source the values name for the same pool is not doubled.
    values = deepcopy(PICKER)
    values["discovery"] = [{"kind": "inferencepool", "name": "sg-sluicegate", "models": ["m"]}]
    (again,) = yaml.safe_load(_rendered_config(values))["discovery"]
    assert again == {
        "kind": "inferencepool",
        "name": "sg-sluicegate",
        "namespace": "llm",
        "models": ["m"],
    }


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"inferencePool": {"failureMode": "FailOpen", "appProtocol": "kubernetes.io/h2c"}},
        {"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]}},
    ],
)
def test_picker_inferencepool_is_a_valid_v1_pool_pointing_at_the_picker(
    extra: dict[str, Any],
) -> None:
    values = deepcopy(PICKER)
    for k, v in extra.get("inferencePool", {}).items():
        values["picker"]["inferencePool"][k] = v
    docs = manifests(values)
    (pool,) = by_kind(docs, "InferencePool")
    jsonschema.validate(pool, json.loads(INFERENCEPOOL_SCHEMA.read_text()))
    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = by_kind(docs, "Service")
    assert (ref["kind"], ref["name"]) == ("Service", svc["metadata"]["name"])
    # The port is the Service's ext_proc port (the service port, not the target port).
    grpc = {p["name"]: p for p in svc["spec"]["ports"]}["grpc-ext-proc"]
    assert ref["port"] == {"number": grpc["port"]}
    assert ref["failureMode"] == extra.get("inferencePool", {}).get("failureMode", "FailClose")
    wanted = values["picker"]["inferencePool"]
    assert pool["spec"]["selector"]["matchLabels"] == wanted["modelServers"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == wanted["targetPorts"]


def test_the_inferencepool_schema_refuses_what_the_crd_refuses() -> None:
    """The schema the chart's pool is checked against is not a formality: the shapes the v1
    CRD refuses (and v1alpha2's field names) fail it."""
    schema = json.loads(INFERENCEPOOL_SCHEMA.read_text())
    (good,) = by_kind(manifests(PICKER), "InferencePool")
    jsonschema.validate(good, schema)
    spec = good["spec"]
    bad_specs = [
        {k: v for k, v in spec.items() if k != "targetPorts"},
        {**spec, "targetPorts": []},
        {**spec, "targetPorts": [{"number": 8000}, {"number": 8000}]},
        {**spec, "selector": {"matchLabels": {}}},
        {**spec, "endpointPickerRef": {"name": "epp"}},  # a Service without its port
        {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"}},
        {**spec, "extensionRef": {"name": "epp"}},  # v1alpha2's
        {**{k: v for k, v in spec.items() if k != "targetPorts"}, "targetPortNumber": 8000},
    ]
    for bad in bad_specs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": bad}, schema)


def test_picker_without_pool_labels_or_with_an_ingress_is_refused() -> None:
    values = deepcopy(PICKER)
    values["picker"]["inferencePool"]["modelServers"]["matchLabels"] = {}
    with pytest.raises(helm.HelmError, match="matchLabels"):
        render(values)
    with pytest.raises(helm.HelmError, match="picker"):
        render({**PICKER, "ingress": {"enabled": True}})
    # An existing pool, by name: no InferencePool rendered, its RBAC and source still are.
    values = deepcopy(PICKER)
    values["picker"]["inferencePool"] = {"create": False, "name": "shared-pool"}
    docs = manifests(values)
    assert by_kind(docs, "InferencePool") == []
    (source,) = yaml.safe_load(_rendered_config(values))["discovery"]
    assert source["name"] == "shared-pool"
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == ["sg-sluicegate-inferencepool"]


def _keda_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(KEDA_SCHEMA.read_text())
    return schema


def test_scale_from_zero_renders_a_valid_keda_scaled_object_per_model() -> None:
    docs = manifests(SCALE_FROM_ZERO)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in by_kind(docs, "ScaledObject")}
    assert set(scaled) == {"vllm-llama-70b", "vllm-qwen"}
    schema = _keda_schema()
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "sg-sluicegate"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    for so in scaled.values():
        jsonschema.validate(so, schema)
        spec = so["spec"]
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert spec["minReplicaCount"] == 0
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "external-push"
        host, port = trigger["metadata"]["scalerAddress"].rsplit(":", 1)
        assert host == "sg-sluicegate.llm.svc.cluster.local" and int(port) == ports["keda-scaler"]
    llama = scaled["vllm-llama-70b"]
    assert llama["metadata"]["namespace"] == "models"
    assert llama["spec"]["maxReplicaCount"] == 4
    assert llama["spec"]["triggers"][0]["metadata"]["model"] == "llama-70b"
    assert scaled["vllm-qwen"]["metadata"]["namespace"] == "llm"
    # The pod listens where the Service sends KEDA, and the router serves the declared models.
    (c,) = router_deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert {"name": "keda-scaler", "containerPort": 9091, "protocol": "TCP"} in c["ports"]
    config = yaml.safe_load(_rendered_config(SCALE_FROM_ZERO))["scale_from_zero"]
    assert config["models"] == ["llama-70b", "qwen-7b", "declared-only"]
    assert config["scaler_port"] == 9091 and config["target_per_replica"] == 8
    # A broken ScaledObject is caught by the check: it is not vacuous.
    bad = deepcopy(llama)
    bad["spec"]["minReplicaCount"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    # Off by default: no ScaledObject, no scaler port.
    plain = manifests(None)
    assert by_kind(plain, "ScaledObject") == []
    assert "scale_from_zero" not in yaml.safe_load(_rendered_config(None))


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != key}


@functools.cache
def _a_scaled_object() -> dict[str, Any]:
    """One rendered ScaledObject, rendered once for the refusal cases (not to be mutated)."""
    (good, *_) = by_kind(manifests(SCALE_FROM_ZERO), "ScaledObject")
    return good


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(lambda spec: _without(spec, "scaleTargetRef"), id="no-scaleTargetRef"),
        pytest.param(lambda spec: {**spec, "minReplicas": 0}, id="unknown-spec-field"),
        pytest.param(
            lambda spec: {**spec, "scaleTargetRef": {"kind": "Deployment"}}, id="target-unnamed"
        ),
        pytest.param(lambda spec: {**spec, "triggers": []}, id="no-trigger"),
        pytest.param(
            lambda spec: {**spec, "triggers": [{"type": "external-push", "metadata": {}}]},
            id="external-without-address",
        ),
        pytest.param(lambda spec: {**spec, "maxReplicaCount": -1}, id="negative-max"),
    ],
)
def test_the_keda_schema_refuses_a_broken_scaled_object(broken: Any) -> None:
    """The schema the chart's ScaledObjects are checked against is not a formality: what KEDA
    would refuse (or silently prune, as a misspelled field) fails it."""
    schema = _keda_schema()
    good = _a_scaled_object()
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "spec": broken(good["spec"])}, schema)


def test_batch_storage_mounts_an_existing_claim_in_every_router_pod() -> None:
    docs = manifests({"batchStorage": {"existingClaim": "sg-batch"}})
    pod = router_deployment(docs)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts["/var/lib/sluicegate/batch"]]
    assert volume["persistentVolumeClaim"] == {"claimName": "sg-batch"}
    plain = router_deployment(manifests(None))["spec"]["template"]["spec"]
    assert not [v for v in plain["volumes"] if "persistentVolumeClaim" in v]
