"""The Kubernetes example (examples/deploy/kvtether.yaml) holds together: every object has the fields Kubernetes
requires, selectors, named ports, volumes and the store URL point at what the file defines, and the gateway's
configuration loads. (``kubectl --dry-run=client`` needs an API server for discovery, so a schema check it is.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from kvtether.gateway.config import load_config

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "deploy" / "kvtether.yaml"
API_VERSIONS = {"ConfigMap": "v1", "Service": "v1", "Deployment": "apps/v1"}


def _objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == kind}


def _containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def _port_names(deployment: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in _containers(deployment) for p in c.get("ports", [])}


def test_every_object_has_what_kubernetes_requires() -> None:
    objects = _objects()
    assert {o["kind"] for o in objects} == set(API_VERSIONS)
    for o in objects:
        assert o["apiVersion"] == API_VERSIONS[o["kind"]], o["kind"]
        assert isinstance(o["metadata"]["name"], str) and o["metadata"]["name"]
    for name, d in _by_kind("Deployment").items():
        spec = d["spec"]
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1, name
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        ports = _port_names(d)
        for c in _containers(d):
            assert c["name"] and c["image"], name
            assert all(isinstance(p["containerPort"], int) for p in c.get("ports", []))
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, name
            for probe in ("readinessProbe", "livenessProbe"):
                for action in ("httpGet", "tcpSocket"):
                    if action in c.get(probe, {}):
                        assert c[probe][action]["port"] in ports, (name, probe)
        for v in spec["template"]["spec"].get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in _by_kind("ConfigMap"), name


def test_services_select_their_deployments_ports() -> None:
    deployments = _by_kind("Deployment")
    for name, svc in _by_kind("Service").items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        for port in svc["spec"]["ports"]:
            assert isinstance(port["port"], int) and port["targetPort"] in _port_names(selected[0]), name


def test_gateway_replicas_share_the_redis_the_file_defines(tmp_path: Path) -> None:
    gateway = _by_kind("Deployment")["kvtether-gateway"]
    (container,) = _containers(gateway)
    env = {e["name"]: e["value"] for e in container["env"]}
    store = urlsplit(env["KVTETHER_STORE"])
    redis_svc = _by_kind("Service")[str(store.hostname)]
    assert store.scheme == "redis" and store.port in [p["port"] for p in redis_svc["spec"]["ports"]]
    command = container["command"]
    assert command[:2] == ["kvtether", "serve"] and int(command[command.index("--workers") + 1]) >= 1
    assert gateway["spec"]["replicas"] > 1
    # The configuration the replicas read: mounted where --config points, and loadable as it stands.
    config_path = Path(command[command.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert config_path.parent == Path(mount["mountPath"])
    toml = _by_kind("ConfigMap")["kvtether-gateway"]["data"][config_path.name]
    (tmp_path / config_path.name).write_text(toml)
    cfg = load_config(tmp_path / config_path.name, store=env["KVTETHER_STORE"])
    assert cfg.store.startswith("redis://") and cfg.session_ttl_s < cfg.engine_kv_ttl_s
    # Redis: every key the gateway writes expires, so only volatile eviction is ever needed.
    (redis,) = _containers(_by_kind("Deployment")["kvtether-redis"])
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl"
