"""`quantize serve export`: the same deployment for a cluster, as Kubernetes manifests validated offline.

Per route: a Deployment running vLLM's OpenAI server with the route's measured arguments (the same ServeSettings
`quantize serve` starts it with), its API key from a Secret, its model from a read-only PersistentVolumeClaim, resources
from the planner (pipelines/fleet/fit.py: weights + KV space + activations + overhead), and probes on /health: a
startup probe as long as the product's start-up timeout, a readiness probe (a route that stops answering leaves its
Service), a liveness probe that restarts a hung server (the cluster's `hung_after_s`). A ClusterIP Service per route.

The proxy: nginx Deployment (`proxy_replicas`, 2 by default, with a PodDisruptionBudget: the proxy is no single point of
failure either) whose config is the same chain `quantize serve` runs (pipelines/fleet/nginx.py render_chain), with the
routes' Service names as upstreams; it is a ConfigMap template that the nginx image fills with the keys from the Secret
at start (envsubst, only variables named QUANTGATE_*). A Service in front: what clients call.

Every object is validated against the Kubernetes 1.37 JSON schemas that kubernetes-validate bundles (strict: an
unknown field is an error), offline. The files go to --out DIR, all or nothing; the Secret file holds fresh random
keys and is written 0600. An existing --out is replaced only when it is an earlier export as written, known by its
marker (pipelines/fleet/export_folder.py), never by a file name users also use.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from pipelines.errors import InputError
from pipelines.files.atomic import atomic_dir
from pipelines.fleet.deployment import Deployment
from pipelines.fleet.export_folder import MARKER, check_out, marker_document
from pipelines.fleet.fit import route_memory
from pipelines.fleet.nginx import Chain, ProxyLayout, Upstream, max_conns, render_chain, render_config, write_config
from pipelines.fleet.proxy import check_config, find_nginx
from pipelines.fleet.routes import ResolvedRoute
from pipelines.schema import StrictModel
from pipelines.serve.serving import LOOPBACK, MAX_LOGPROBS, MONITORING_ENVIRONMENT

KUBERNETES_VERSION = "1.37"
VLLM_PORT = 8000
PROXY_PORT = 8080
SENTINEL_PORT = 8999
MODELS_MOUNT = "/models"
IMAGES = {"cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0", "gpu": "vllm/vllm-openai:v0.32.0"}
PROBE_PERIOD_S = 5
LIVENESS_FAILURES = 3
MiB = 2**20
KUSTOMIZATION = "kustomization.yaml"
SECRET_FILE_MODE = 0o600


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the proxy's config) as YAML block literals, readable in the ConfigMap; no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_ManifestDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


class ExportedObject(StrictModel):
    file: str
    kind: str
    name: str


class Exported(StrictModel):
    folder: Path
    objects: list[ExportedObject]
    validated_against: str
    proxy_check: str


def _labels(deployment: Deployment, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "quantgate", "app.kubernetes.io/instance": deployment.name, "app.kubernetes.io/component": component}


def _object_name(deployment: Deployment, route: ResolvedRoute) -> str:
    return f"{deployment.name}-{route.label}"


def _key_variable(route: ResolvedRoute) -> str:
    return f"QUANTGATE_KEY_{route.label.upper().replace('-', '_')}"


def model_path(route: ResolvedRoute) -> str:
    """Where the route's model sits on the models volume: promoted/<model>/v<N> (the signed bundle), base/<folder>."""
    if route.kind == "version":
        return f"{MODELS_MOUNT}/promoted/{route.model}/v{route.version}"
    return f"{MODELS_MOUNT}/base/{route.model_dir.name}"


def _probe(path: str, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": timeout}


def route_objects(deployment: Deployment, route: ResolvedRoute, memory_bytes: int) -> list[dict[str, Any]]:
    """The route's Deployment and Service."""
    cluster = deployment.kubernetes
    name = _object_name(deployment, route)
    labels = {**_labels(deployment, "model-server"), "quantgate/route": route.label}
    settings = route.serve
    args = ["--model", model_path(route), "--served-model-name", deployment.model_name, "--host", "0.0.0.0", "--port", str(VLLM_PORT),
            *settings.model_copy(update={"dtype": cluster.dtype}).vllm_args(), "--max-logprobs", str(MAX_LOGPROBS)]
    key = {"secretKeyRef": {"name": f"{deployment.name}-keys", "key": _key_variable(route)}}
    env: list[dict[str, Any]] = [{"name": "VLLM_API_KEY", "valueFrom": key}, *({"name": name, "value": value}
                                                                              for name, value in MONITORING_ENVIRONMENT.items())]
    memory = f"{math.ceil(memory_bytes / MiB)}Mi"
    resources: dict[str, dict[str, str]] = {"requests": {"cpu": str(cluster.cpus), "memory": memory}, "limits": {"memory": memory}}
    if cluster.target == "gpu":
        resources["limits"]["nvidia.com/gpu"] = "1"
    else:
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(settings.cpu_kv_cache_gib)})
    hung_after = deployment.rules.server_death.hung_after_s
    liveness_period = max(1, math.ceil(hung_after / LIVENESS_FAILURES)) if hung_after is not None else 10
    container = {
        "name": "vllm", "image": cluster.vllm_image or IMAGES[cluster.target],
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"], "args": args, "env": env,
        "ports": [{"name": "http", "containerPort": VLLM_PORT}], "resources": resources,
        "startupProbe": _probe("/health", period=PROBE_PERIOD_S, failures=math.ceil(settings.startup_timeout_s / PROBE_PERIOD_S), timeout=2),
        "readinessProbe": _probe("/health", period=PROBE_PERIOD_S, failures=deployment.circuit_breaker.failures_to_open, timeout=2),
        "livenessProbe": _probe("/health", period=liveness_period, failures=LIVENESS_FAILURES, timeout=5),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
    }
    annotations = {"quantgate/serves": f"{route.model} v{route.version}" + (" (16-bit base)" if route.kind == "base" else ""),
                   "quantgate/verified": route.verified[:250], "quantgate/timeout": f"{route.timeout_s:g}s: {route.timeout_basis}"[:250]}
    pod = {"metadata": {"labels": labels, "annotations": annotations},
           "spec": {"containers": [container],
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": cluster.models_claim, "readOnly": True}}]}}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}]}},
    ]


def proxy_chain(deployment: Deployment, routes: list[ResolvedRoute], *, addresses: list[str] | None = None) -> Chain:
    """The chain for the cluster: the routes' Services as upstreams (or `addresses`), keys as ${QUANTGATE_*} for envsubst."""
    upstreams = [
        Upstream(label=route.label, address=addresses[index] if addresses else f"{_object_name(deployment, route)}:{VLLM_PORT}",
                 api_key="${" + _key_variable(route) + "}", timeout_s=route.timeout_s,
                 max_conns=max_conns(route.serve))
        for index, route in enumerate(routes)
    ]
    return Chain(listen=str(PROXY_PORT), sentinel_port=SENTINEL_PORT, client_key="${QUANTGATE_CLIENT_KEY}", access_log="/dev/stdout",
                 upstreams=upstreams)


def proxy_objects(deployment: Deployment, routes: list[ResolvedRoute]) -> list[dict[str, Any]]:
    """The proxy's ConfigMap, Deployment, PodDisruptionBudget and Service."""
    cluster = deployment.kubernetes
    name = f"{deployment.name}-proxy"
    labels = _labels(deployment, "proxy")
    env: list[dict[str, Any]] = [{"name": "NGINX_ENVSUBST_FILTER", "value": "^QUANTGATE_"}]
    env += [{"name": variable, "valueFrom": {"secretKeyRef": {"name": f"{deployment.name}-keys", "key": variable}}}
            for variable in ["QUANTGATE_CLIENT_KEY", *(_key_variable(route) for route in routes)]]
    container = {
        "name": "nginx", "image": cluster.proxy_image, "env": env, "ports": [{"name": "http", "containerPort": PROXY_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "readinessProbe": _probe("/health", period=PROBE_PERIOD_S, failures=2, timeout=max(1, math.ceil(max(r.timeout_s for r in routes)))),
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": [{"name": "chain", "mountPath": "/etc/nginx/templates", "readOnly": True}],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
         "data": {"quantgate.conf.template": textwrap.dedent(render_chain(deployment, proxy_chain(deployment, routes)))}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
         "spec": {"replicas": cluster.proxy_replicas, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "containers": [container], "volumes": [{"name": "chain", "configMap": {"name": name}}]}}}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "labels": labels},
         "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": deployment.name, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
    ]


def secret_object(deployment: Deployment, routes: list[ResolvedRoute]) -> dict[str, Any]:
    keys = {variable: secrets.token_urlsafe(32) for variable in ["QUANTGATE_CLIENT_KEY", *(_key_variable(route) for route in routes)]}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": f"{deployment.name}-keys",
            "labels": _labels(deployment, "keys")}, "stringData": keys}


def validate(objects: list[dict[str, Any]]) -> str:
    """Each object against the bundled Kubernetes schemas (strict), offline; an InputError naming the first that fails."""
    for item in objects:
        where = f"{item['kind']} {item['metadata']['name']}"
        try:
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.absolute_path) or "(top level)"
            raise InputError(f"{where} does not validate against Kubernetes {KUBERNETES_VERSION}: {error.message[:300]}", field=path) from None
    return f"Kubernetes {KUBERNETES_VERSION} JSON schemas, strict (kubernetes-validate {_validator_version()}, offline)"


def _validator_version() -> str:
    from importlib.metadata import version

    return version("kubernetes-validate")


def check_proxy_template(deployment: Deployment, routes: list[ResolvedRoute]) -> str:
    """`nginx -t` on the ConfigMap's chain with the Services replaced by loopback ports (nginx resolves upstream names at
    start, and the cluster's are not resolvable here); skipped, saying so, where nginx is not installed."""
    try:
        binary = find_nginx()
    except InputError:
        return "nginx -t skipped: nginx is not installed here"
    with tempfile.TemporaryDirectory(prefix="quantgate-k8s-check-") as scratch:
        layout = ProxyLayout(prefix=Path(scratch), listen_host=LOOPBACK, listen_port=PROXY_PORT, sentinel_port=SENTINEL_PORT, client_key="x")
        chain = proxy_chain(deployment, routes, addresses=[f"{LOOPBACK}:{VLLM_PORT + 1 + index}" for index in range(len(routes))])
        text = render_config(deployment, layout, chain.upstreams).replace("${", "placeholder-{")
        write_config(layout, text)
        check_config(binary, layout)
        return "nginx -t: the proxy ConfigMap's chain is ok (the Services' names replaced by loopback ports, the keys by placeholders)"


def export_manifests(deployment: Deployment, routes: list[ResolvedRoute], out: Path, *, machine_bytes: int | None = None) -> Exported:
    """Write and validate the manifests into `out` (all or nothing); `out` must be new, empty, or an earlier export."""
    check_out(out)
    largest = machine_bytes or 2**40  # the planner's fit is the cluster's business here: only each route's own need is asked
    objects: list[dict[str, Any]] = []
    for route in routes:
        objects += route_objects(deployment, route, route_memory(route, largest).total_bytes)
    objects += proxy_objects(deployment, routes)
    secret = secret_object(deployment, routes)
    validated = validate([*objects, secret])
    proxy_check = check_proxy_template(deployment, routes)
    listed = [ExportedObject(file=f"{item['metadata']['name']}-{item['kind'].lower()}.yaml", kind=item["kind"], name=item["metadata"]["name"])
              for item in [*objects, secret]]
    texts = {entry.file: yaml.dump(item, Dumper=_ManifestDumper, sort_keys=False, width=1000) for entry, item in zip(listed, [*objects, secret],
                                                                                                                      strict=True)}
    texts[KUSTOMIZATION] = yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                           "resources": [item.file for item in listed]}, sort_keys=False)
    secrets_files = {entry.file for entry in listed if entry.kind == "Secret"}
    with atomic_dir(out) as staging:
        for file, text in texts.items():
            mode = SECRET_FILE_MODE if file in secrets_files else 0o666
            with os.fdopen(os.open(staging / file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode), "w") as handle:
                handle.write(text)
        (staging / MARKER).write_text(marker_document(texts))
    return Exported(folder=out, objects=listed, validated_against=validated, proxy_check=proxy_check)

