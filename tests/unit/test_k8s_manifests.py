"""deploy/k8s validates against Kubernetes 1.31 and hangs together (issue 11, item 4).

- Built-in kinds: ``kubernetes-validate`` (PyPI) with the Kubernetes **1.31** OpenAPI schemas in
  strict mode (an unknown or misspelt field fails, as ``kubectl apply --validate=strict`` would).
- ``InferencePool``: kubernetes-validate has no CRD schemas, so it is checked against
  :data:`INFERENCE_POOL_V1`, our JSON-schema transcription of the fields, types, bounds and enums of
  the Gateway API inference extension's ``inference.networking.k8s.io/v1`` InferencePool CRD
  (``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``, v1.0 API:
  ``selector.matchLabels``, ``targetPorts[1]``, ``endpointPickerRef{group,kind,name,port,failureMode}``).
- Cross-references: every Service selects pods that exist and name the ports it targets; every
  ``<service>:<port>`` a container is pointed at is a Service port; every workload's selector
  matches its pod template; the InferencePool selects the engine pods on their serving port and
  names the epp Service; ``kustomization.yaml`` lists every manifest.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31.0"

_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
INFERENCE_POOL_V1: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {"type": "object", "minProperties": 1, "additionalProperties": _LABEL_VALUE}
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": _PORT},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": _PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def _manifests() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _validate(resource: dict[str, Any]) -> None:
    if resource["kind"] == "InferencePool":
        jsonschema.validate(resource, INFERENCE_POOL_V1)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def _all() -> list[dict[str, Any]]:
    return [r for docs in _manifests().values() for r in docs]


def _pod_templates() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every Deployment and StatefulSet."""
    return [(r, r["spec"]["template"]) for r in _all() if r["kind"] in ("Deployment", "StatefulSet")]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("name", sorted(_manifests()))
def test_manifest_is_valid_for_kubernetes(name: str) -> None:
    resources = _manifests()[name]
    assert resources, f"{name} holds no resource"
    for resource in resources:
        _validate(resource)
        assert resource["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "kvmesh", (
            name, resource["metadata"]["name"])


def test_the_validators_reject_what_kubectl_would() -> None:
    router = next(r for r in _all() if r["kind"] == "Deployment" and r["metadata"]["name"] == "kvmesh-router")
    typo = copy.deepcopy(router)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    bad_port = copy.deepcopy(router)
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad_port)
    pool = next(r for r in _all() if r["kind"] == "InferencePool")
    for mutate in (
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"),
        lambda p: p["spec"]["targetPorts"].append({"number": 8001}),  # v1 allows exactly one
        lambda p: p["spec"].pop("selector"),
        lambda p: p["spec"]["selector"]["matchLabels"].update(bad="-not-a-label-"),
    ):
        broken = copy.deepcopy(pool)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = (K8S_DIR / "kustomization.yaml").read_text()
    listed = set(re.findall(r"^\s*#?\s*-\s+(\S+\.yaml)\s*$", kustomization, re.M))
    assert listed == set(_manifests()), (listed, set(_manifests()))
    active = yaml.safe_load(kustomization)["resources"]
    assert all((K8S_DIR / name).is_file() for name in active)


def test_workload_selectors_match_their_pods() -> None:
    for workload, template in _pod_templates():
        selector = workload["spec"]["selector"]["matchLabels"]
        assert _matches(selector, template["metadata"]["labels"]), workload["metadata"]["name"]


def test_services_select_pods_that_serve_their_ports() -> None:
    for svc in (r for r in _all() if r["kind"] == "Service"):
        pods = [t for _, t in _pod_templates() if _matches(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for pod in pods:
            names = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def test_every_service_address_in_args_is_a_service_port() -> None:
    ports = {
        (r["metadata"]["name"], p["port"]) for r in _all() if r["kind"] == "Service" for p in r["spec"]["ports"]
    }
    seen = 0
    for _, template in _pod_templates():
        for container in template["spec"]["containers"]:
            for arg in container.get("args", []):
                for host, port in re.findall(r"(kvmesh-[a-z-]+):(\d+)", arg):
                    assert (host, int(port)) in ports, (container["name"], arg)
                    seen += 1
    config = next(r for r in _all() if r["kind"] == "ConfigMap")
    host, port = config["data"]["KVMESH_ETCD"].split(":")
    assert (host, int(port)) in ports
    assert seen >= 5


def test_inference_pool_selects_the_engines_on_their_serving_port() -> None:
    pool = next(r for r in _all() if r["kind"] == "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    engines = [t for _, t in _pod_templates() if _matches(selector, t["metadata"]["labels"])]
    assert engines, "the InferencePool selects no pod"
    for pod in engines:
        serving = {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert pool["spec"]["targetPorts"][0]["number"] in serving
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "model-server"
    # Every engine flavour carries the pool label and serves on the same port.
    flavours = [t for _, t in _pod_templates() if t["metadata"]["labels"].get("app.kubernetes.io/component") == "model-server"]
    assert len(flavours) == 2 and all("kvmesh.io/pool" in t["metadata"]["labels"] for t in flavours)
    picker = pool["spec"]["endpointPickerRef"]
    assert any(r["kind"] == "Service" and r["metadata"]["name"] == picker["name"] for r in _all())


def test_vllm_engines_carry_the_flags_kvmesh_needs() -> None:
    vllm = next(t for w, t in _pod_templates() if w["metadata"]["name"] == "kvmesh-engine-vllm")
    args = " ".join(next(c for c in vllm["spec"]["containers"] if c["name"] == "vllm")["args"])
    for flag in ("--enable-prefix-caching", "--prefix-caching-hash-algo=sha256_cbor", "--block-size=64",
                 "--enable-prompt-tokens-details", '"enable_kv_cache_events": true', '"publisher": "zmq"',
                 '"topic": "kv@$(POD_IP):8000@llama-3.1-8b"'):
        assert flag in args, flag
    sidecar = next(c for c in vllm["spec"]["containers"] if c["name"] == "registration")
    assert "--block-size-tokens=64" in sidecar["args"] and "--engine-url=http://$(POD_IP):8000" in sidecar["args"]
