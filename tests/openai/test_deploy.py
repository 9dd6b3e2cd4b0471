"""The deployment files in deploy/, checked offline: the Kubernetes core objects against
Kubernetes' own schemas (kubernetes-validate, strict), the inference gateway's and the
Prometheus Operator's objects against the fields their v1 APIs document (our schemas of
them below), the objects against each other (selectors, ports, names), the probes and
arguments against the real server, and the memory request against `ferrum plan`."""

import json
import os
import re
import signal
import subprocess

import httpx
import jsonschema
import yaml

from test_security import start

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DEPLOY = os.path.join(ROOT, "deploy")


def docs(*path):
    with open(os.path.join(DEPLOY, *path)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def by_kind():
    out = {}
    for name in sorted(os.listdir(os.path.join(DEPLOY, "kubernetes"))):
        for d in docs("kubernetes", name):
            assert d["kind"] not in out, d["kind"]
            out[d["kind"]] = d
    return out


NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
META = {"type": "object", "required": ["name"], "properties": {"name": NAME, "labels": LABELS}}
PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}

# What the v1 APIs document (inference.networking.k8s.io InferencePool, gateway.networking.k8s.io
# HTTPRoute, monitoring.coreos.com PodMonitor), for the fields these files use; unknown fields are
# refused, so a misspelt one fails.
SCHEMAS = {
    "InferencePool": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
            "metadata": META,
            "spec": {
                "type": "object", "required": ["selector", "targetPorts", "endpointPickerRef"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                                 "properties": {"matchLabels": LABELS}},
                    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                                    "items": {"type": "object", "required": ["number"], "additionalProperties": False,
                                              "properties": {"number": PORT_NUMBER}}},
                    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                    "endpointPickerRef": {
                        "type": "object", "required": ["name", "port"], "additionalProperties": False,
                        "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": NAME,
                                       "port": {"type": "object", "required": ["number"],
                                                "properties": {"number": PORT_NUMBER}},
                                       "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
                },
            },
        },
    },
    "HTTPRoute": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"const": "HTTPRoute"},
            "metadata": META,
            "spec": {
                "type": "object", "required": ["parentRefs", "rules"], "additionalProperties": False,
                "properties": {
                    "parentRefs": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["name"], "additionalProperties": False,
                        "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": NAME,
                                       "namespace": NAME, "sectionName": {"type": "string"}}}},
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array", "items": {"type": "object", "properties": {
                                "path": {"type": "object", "required": ["type", "value"], "properties": {
                                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                    "value": {"type": "string", "pattern": "^/"}}}}}},
                            "backendRefs": {"type": "array", "minItems": 1, "items": {
                                "type": "object", "required": ["name"], "additionalProperties": False,
                                "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": NAME,
                                               "port": PORT_NUMBER, "weight": {"type": "integer", "minimum": 0}}}},
                            "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                                "request": {"type": "string", "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$"},
                                "backendRequest": {"type": "string"}}},
                        }}},
                },
            },
        },
    },
    "PodMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
            "metadata": META,
            "spec": {
                "type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object", "properties": {"matchLabels": LABELS}},
                    "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                       "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
                },
            },
        },
    },
}


def test_objects_validate_against_their_schemas():
    import kubernetes_validate
    kinds = by_kind()
    assert set(kinds) == {"Deployment", "Service", "InferencePool", "HTTPRoute", "PodMonitor"}, set(kinds)
    for kind in ("Deployment", "Service"):
        kubernetes_validate.validate(kinds[kind], "1.37.0", strict=True)
    for kind, schema in SCHEMAS.items():
        jsonschema.validate(kinds[kind], schema)


def test_objects_agree_with_each_other():
    k = by_kind()
    pod = k["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # The picker reads the engine type from this label and scrapes vLLM's metrics.
    assert labels.get("llm-d.ai/engine-type") == "vllm"
    assert k["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pool = k["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]]
    backend = k["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == \
        ("inference.networking.k8s.io", "InferencePool", k["InferencePool"]["metadata"]["name"])
    assert k["PodMonitor"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert k["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] in ports
    assert k["Service"]["spec"]["selector"].items() <= labels.items()
    # The drain (--shutdown-grace) and the preStop sleep fit in the termination grace period.
    args = container["args"]
    grace = int(next(a.split("=", 1)[1] for a in args if a.startswith("--shutdown-grace=")))
    pre = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pre + grace < pod["spec"]["terminationGracePeriodSeconds"]
    port = int(next(a.split("=", 1)[1] for a in args if a.startswith("--port=")))
    assert port == ports["http"]
    kv = next(a.split("=", 1)[1] for a in args if a.startswith("--kv-events="))
    assert kv.endswith(f":{ports['kv-events']}")


def test_the_llm_d_values_run_the_same_server():
    (values,) = docs("llm-d", "values.yaml")
    c = values["decode"]["containers"][0]
    assert c["command"] == ["ferrum"] and c["args"][0] == "serve"
    deployment_args = by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = lambda args: {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert flags(c["args"]) <= flags(deployment_args)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"


def test_the_dockerfile_builds_the_release_binary():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    assert re.search(r"cargo build --release -p ferrum-cli", text)
    assert "ENTRYPOINT [\"ferrum\"]" in text


def test_probes_and_arguments_work_on_the_real_server_and_memory_fits_the_plan():
    container = by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in container["args"][2:] if not a.startswith(("--host", "--port", "--kv-events"))]
    model = os.environ["FERRUM_MODEL"]
    proc, base, _ = start(model, *args)
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            assert httpx.get(base + path, timeout=5).status_code == 200, probe
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    # `ferrum plan` with the Deployment's context and pool, for the default model: the
    # memory request covers it.
    plan_args = [a for a in args if a.startswith(("--ctx", "--kv-tokens"))]
    out = subprocess.run([os.environ["FERRUM_BIN"], "plan", model, *plan_args, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    need = json.loads(out.stdout)["total_bytes"]
    request = container["resources"]["requests"]["memory"]
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", request)
    assert m and int(m.group(1)) * units[m.group(2)] >= need, (request, need)
