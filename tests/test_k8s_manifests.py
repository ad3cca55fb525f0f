"""deploy/k8s: the manifests parse, hold the kinds an operator needs, and every
``MX_*`` variable they set is a field of :class:`MxSettings` (a renamed or removed
setting fails here, not in a cluster)."""

from __future__ import annotations

import pathlib
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is missing (a dependency of vLLM's CPU build)")

K8S = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def _docs() -> list[dict[str, Any]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc["__file__"] = path.name
                out.append(doc)
    return out


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in _docs():
        if doc["kind"] in WORKLOADS:
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                yield doc, c


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_document_parses_and_names_its_kind() -> None:
    docs = _docs()
    assert docs
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), d["__file__"]
        assert d["metadata"].get("name"), d["__file__"]


def test_kustomization_lists_exactly_the_manifest_files() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(files)


def test_server_runs_two_replicas_on_redis_behind_one_service() -> None:
    server = _by_kind("Deployment")["modelexpress-server"]
    assert server["spec"]["replicas"] == 2
    (container,) = server["spec"]["template"]["spec"]["containers"]
    store = _env(container)["MX_STORE"]["value"]
    assert store.startswith("redis://")
    redis_host, redis_port = store.removeprefix("redis://").split("/")[0].split(":")
    services = _by_kind("Service")
    assert int(redis_port) in [p["port"] for p in services[redis_host]["spec"]["ports"]]
    assert "mx-redis" in _by_kind("StatefulSet")
    assert services["modelexpress"]["spec"]["selector"].items() <= \
        server["spec"]["template"]["metadata"]["labels"].items()
    assert "modelexpress-server" in _by_kind("PodDisruptionBudget")


def test_server_probes_hit_a_route_the_app_serves_without_a_token(
        tmp_path: pathlib.Path) -> None:
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    from modelexpress.server.app import create_app
    from modelexpress.settings import MxSettings

    app = create_app(MxSettings(store=f"sqlite:///{tmp_path / 'mx.db'}", server_token="t"))
    routes = {getattr(r, "path", None) for r in app.routes}
    (container,) = _by_kind("Deployment")["modelexpress-server"]["spec"]["template"][
        "spec"]["containers"]
    port = container["ports"][0]["containerPort"]
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes and get["port"] == port, probe
    from fastapi.testclient import TestClient
    with TestClient(app) as client:  # no Authorization header: probes send none
        assert client.get(container["readinessProbe"]["httpGet"]["path"]).status_code == 200


def test_every_mx_variable_is_a_setting() -> None:
    from modelexpress.settings import MxSettings

    fields = set(MxSettings.model_fields)
    used = {name for _, c in _containers() for name in _env(c) if name.startswith("MX_")}
    assert used
    unknown = sorted(n for n in used if n.removeprefix("MX_").lower() not in fields)
    assert not unknown, f"not fields of MxSettings: {unknown}"


def test_every_mx_value_is_one_mxsettings_accepts() -> None:
    from modelexpress.settings import MxSettings

    for _, c in _containers():
        values = {n.removeprefix("MX_").lower(): e["value"] for n, e in _env(c).items()
                  if n.startswith("MX_") and "value" in e}
        MxSettings(**values)  # raises with the allowed values on a bad one


def test_workers_get_the_node_name_the_ipc_hostpath_and_the_server() -> None:
    worker = _by_kind("StatefulSet")["vllm-worker"]
    pod = worker["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env(container)
    assert env["MX_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ipc_dir = env["MX_IPC_DIR"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "hostPath" in volumes[mounts[ipc_dir]], "MX_IPC_DIR must be a hostPath mount"
    url = env["MX_SERVER_URL"]["value"]
    host, port = url.removeprefix("http://").split(":")
    assert int(port) in [p["port"] for p in _by_kind("Service")[host]["spec"]["ports"]]
    assert "--load-format" in container["args"]
    assert container["args"][container["args"].index("--load-format") + 1] in (
        "modelexpress", "mx")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == container["ports"][0]["containerPort"]


def test_secrets_and_selectors_refer_to_what_exists() -> None:
    secrets = _by_kind("Secret")
    for _, c in _containers():
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"]
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in _docs()
              if d["kind"] in WORKLOADS]
    for d in _docs():
        if d["kind"] in WORKLOADS:
            assert d["spec"]["selector"]["matchLabels"].items() <= \
                d["spec"]["template"]["metadata"]["labels"].items()
        if d["kind"] == "Service":
            sel = d["spec"]["selector"]
            assert any(sel.items() <= lab.items() for lab in labels), d["metadata"]["name"]
