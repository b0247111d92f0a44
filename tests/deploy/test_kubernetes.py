"""deploy/kubernetes/ holds together and validates offline against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown or misspelt field fails): every file the kustomization lists, and only those; the gateway finds
exactly the vLLM pods by its configured selector and role labels, with the RBAC that lets it (get, list and watch
pods, bound to the service account it runs as); every vLLM workload runs the NIXL connector the gateway needs
(bidirectional, its role's kv_role, a decode TTL above the gateway's session TTL, a side channel on the pod's IP)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvtether.gateway.config import load_config
from kvtether.gateway.nodes.discovery.members import PodFacts, pod_member
from kvtether.gateway.nodes.discovery.settings import parse_selector

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OPERATIONS = ROOT / "docs" / "operations.md"
KUBERNETES_VERSION = "1.33.0"  # a supported release the schemas cover (kubernetes-validate ships 1.2x to 1.37)
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def _kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    return doc


def _objects() -> list[dict[str, Any]]:
    return [d for name in _kustomization()["resources"] for d in yaml.safe_load_all((KUBE / name).read_text())
            if d is not None]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == kind}


def _vllm() -> dict[str, dict[str, Any]]:
    return {n: d for n, d in _by_kind("Deployment").items() if n.startswith("vllm-")}


def _gateway_settings() -> dict[str, Any]:
    text = _by_kind("ConfigMap")["kvtether-gateway"]["data"]["gateway.toml"]
    return tomllib.loads(text)["gateway"]


def _matches(labels: dict[str, str], selector: str) -> bool:
    for key, op, values in parse_selector(selector):
        ok = {"=": labels.get(key) == (values[0] if values else None),
              "!=": labels.get(key) != (values[0] if values else None),
              "exists": key in labels, "!exists": key not in labels,
              "in": labels.get(key) in values, "notin": labels.get(key) not in values}[op]
        if not ok:
            return False
    return True


def test_the_kustomization_lists_every_manifest_of_the_folder() -> None:
    k = _kustomization()
    assert k["kind"] == "Kustomization" and k["namespace"] == "kvtether"
    assert sorted(k["resources"]) == sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_every_object_validates_against_the_kubernetes_schemas(name: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d is not None]
    assert docs
    for doc in docs:
        # Raises ValidationError naming the path of the first field that is wrong, unknown or missing.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == _kustomization()["namespace"], (name, doc["metadata"]["name"])


def test_services_select_their_workloads_and_name_their_ports() -> None:
    deployments = _by_kind("Deployment")
    for name, svc in _by_kind("Service").items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    for name in _vllm():
        assert _by_kind("Service")[name]["spec"]["clusterIP"] == "None", f"{name}: headless, for dns discovery"


def test_the_gateway_runs_as_a_service_account_that_may_watch_pods_and_nothing_more() -> None:
    gateway = _by_kind("Deployment")["kvtether-gateway"]["spec"]["template"]["spec"]
    account = gateway["serviceAccountName"]
    assert account in _by_kind("ServiceAccount")
    [binding] = [b for b in _by_kind("RoleBinding").values()
                 if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])]
    assert binding["roleRef"]["kind"] == "Role"  # namespaced, not a ClusterRole
    role = _by_kind("Role")[binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not _by_kind("ClusterRole") and not _by_kind("ClusterRoleBinding")


def test_the_gateway_config_loads_and_finds_exactly_the_vllm_pods_by_their_role() -> None:
    settings = _gateway_settings()
    cfg = load_config(None, **settings)
    d = cfg.discovery
    assert d.source == "kubernetes"
    for name, deployment in _by_kind("Deployment").items():
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        selected = _matches(labels, d.selector)
        assert selected == name.startswith("vllm-"), name
        if not selected:
            continue
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        pod = PodFacts(name=name, uid=name, ip="10.1.2.3", labels=labels, ready=True, phase="Running", ports=ports)
        found = pod_member(pod, d)
        assert found is not None, name
        url, member = found
        assert url == f"http://10.1.2.3:{_vllm_arg(deployment, '--port')}", name
        assert member.role == {"vllm-prefill": "prefill", "vllm-decode": "decode", "vllm-pool": "both"}[name]


def _args(deployment: dict[str, Any]) -> list[str]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return [*container.get("command", []), *container.get("args", [])]


def _vllm_arg(deployment: dict[str, Any], flag: str) -> str:
    args = _args(deployment)
    return args[args.index(flag) + 1]


def test_every_vllm_workload_runs_the_nixl_connector_the_gateway_needs() -> None:
    settings = _gateway_settings()
    cfg = load_config(None, **settings)
    assert set(_vllm()) == {"vllm-prefill", "vllm-decode", "vllm-pool"}
    for name, deployment in _vllm().items():
        template = deployment["spec"]["template"]
        role = template["metadata"]["labels"]["kvtether.io/role"]
        kv = json.loads(_vllm_arg(deployment, "--kv-transfer-config"))
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == KV_ROLES[role], name
        assert kv["kv_load_failure_policy"] == "fail", name
        extra = kv["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is True, name
        # The gateway drops a handle before the engine frees its blocks.
        assert extra["decoder_kv_blocks_ttl"] == cfg.engine_kv_ttl_s > cfg.session_ttl_s, name
        assert "engine_id" not in kv, f"{name}: a fixed engine_id would outlive a restart"
        assert int(_vllm_arg(deployment, "--max-num-batched-tokens")) == cfg.chunk_tokens, name
        assert "--enable-prompt-tokens-details" in _args(deployment), name
        if role != "prefill":
            assert "--enable-prefix-caching" in _args(deployment), f"{name}: decode-local turns reuse its cache"
        [container] = template["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", name
        side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert {"name": "nixl", "containerPort": side} in container["ports"], name
        # A deleted pod keeps serving its running turns while the gateway drains it.
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) < template["spec"]["terminationGracePeriodSeconds"], name


def test_operations_doc_says_how_to_apply_the_manifests_and_what_rbac_they_need() -> None:
    text = OPERATIONS.read_text()
    assert "kubectl apply -k deploy/kubernetes" in text
    assert "get`, `list` and `watch`" in text
    for name in _kustomization()["resources"]:
        assert f"deploy/kubernetes/{name}" in text, name
