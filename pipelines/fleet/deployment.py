"""The deployment file: which registry versions serve one endpoint, in which order, and when to move down the chain.

    name: demo                         # the deployment's name: its run folder, its Kubernetes objects (a DNS label)
    served_model_name: demo-llama      # the one model name clients ask for (default: the primary's model)
    primary: demo-llama@production     # NAME@ALIAS or NAME@VERSION: a promoted, signed registry version
    fallbacks:                         # tried in this order when the route before fails, hangs or is overloaded
      - demo-llama@1                   #   a previous champion
      - base_of: demo-llama@production #   the 16-bit model that version was quantized from (its hash is in the signed evidence)
      - model: smollm2-135m@production #   a smaller model, with its own settings
        timeout_s: 20
    rules:
      timeout_headroom: 3.0            # derived timeout = headroom x the version's load-test p99 (gate.json performance)
      min_timeout_s: 2
      last_route_timeout_s: 120          # the last route has nothing to fall back to: a slow answer beats none
      overload: {max_queue: 8, on_http_503: true}
      server_death: {restart: true, max_restarts: 3, hung_after_s: 60}
      canary_every_s: 60               # the golden set of each version route's bundle asked this often (0: off)
    circuit_breaker: {failures_to_open: 3, retry_after_s: 10}
    listen: {host: 127.0.0.1, port: 8080}

Parsed once (pydantic, unknown keys refused) through pipelines/files/yamlio.py: every refusal is one line naming
the file and the field. Only the file's own shape is checked here; what its names resolve to (registry versions,
their signatures, the machine's memory, free ports, nginx) is pipelines/fleet/routes.py and the checks before start.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from pipelines.bounds import MAX_CONTEXT
from pipelines.errors import InputError
from pipelines.files.yamlio import load_yaml_model
from pipelines.registry.reference import split_reference
from pipelines.schema import FrozenModel

MAX_TIMEOUT_S = 24 * 3600.0  # a route answering slower than a day is a misconfiguration, not a timeout
MAX_ROUTES = 8  # a primary and up to seven fallbacks: each is a vLLM server on this machine
MAX_QUEUE = 100_000
MAX_NUM_SEQS = 65_536
MAX_KV_CACHE_GIB = 4096
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._/:@-]{0,254}", re.IGNORECASE)

Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    """A string field that must match `pattern` whole; else one line saying what it must be."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"must be {what} (got {value!r})")
        return value

    return AfterValidator(check)


DnsLabel = Annotated[str, _matching(_DNS_LABEL, "a DNS label: lower-case letters, digits and '-', at most 40 characters")]
ModelName = Annotated[str, _matching(_MODEL_NAME, "letters, digits, '.', '_' or '-', at most 128 characters")]
Image = Annotated[str, _matching(_IMAGE, "a container image reference")]
ObjectName = Annotated[str, _matching(_DNS_SUBDOMAIN, "a Kubernetes object name (lower-case letters, digits, '-' and '.')")]


class VersionRef(FrozenModel):
    """NAME@ALIAS or NAME@VERSION, as written in the file."""

    model: str
    ref: int | str

    def __str__(self) -> str:
        return f"{self.model}@{self.ref}"


def parse_ref(text: Any) -> VersionRef:
    """`demo-llama@production` or `demo-llama@3` (pipelines/registry/reference.py); a bare NAME is refused here: a deployment
    names the version it serves. Anything else is a ValueError pydantic turns into one line."""
    if not isinstance(text, str) or "@" not in text:
        raise ValueError(f"must be NAME@ALIAS or NAME@VERSION, e.g. demo-llama@production (got {text!r})")
    try:
        model, ref = split_reference(text)
    except InputError as error:
        raise ValueError(error.message) from None
    if ref is None or not _MODEL_NAME.fullmatch(model):
        raise ValueError(f"must be NAME@ALIAS or NAME@VERSION, e.g. demo-llama@production (got {text!r})")
    return VersionRef(model=model, ref=ref)


class Route(FrozenModel):
    """One entry of the chain: a registry version, or the 16-bit model a version was quantized from; and what this
    route overrides of the measured serving arguments and the derived timeout."""

    model: VersionRef | None = Field(default=None, description="NAME@ALIAS|VERSION: serve this promoted version's signed bundle")
    base_of: VersionRef | None = Field(default=None, description="NAME@ALIAS|VERSION: serve the 16-bit model this version was made from")
    timeout_s: Seconds | None = Field(default=None, description="longest wait for an answer; default: derived from the load test")
    max_num_seqs: int | None = Field(default=None, ge=1, le=MAX_NUM_SEQS, description="default: the load test's measured max_num_seqs")
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_CONTEXT, description="default: what the gate served with")
    kv_cache_gib: int | None = Field(default=None, ge=1, le=MAX_KV_CACHE_GIB, description="VLLM_CPU_KVCACHE_SPACE; default: the gate's")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"model": value} if isinstance(value, str) else value

    @field_validator("model", "base_of", mode="before")
    @classmethod
    def _ref(cls, value: Any) -> Any:
        return parse_ref(value) if value is not None and not isinstance(value, VersionRef) else value

    @model_validator(mode="after")
    def _one_source(self) -> Route:
        if (self.model is None) == (self.base_of is None):
            raise ValueError("a route is `model: NAME@REF` or `base_of: NAME@REF` (exactly one)")
        return self

    @property
    def ref(self) -> VersionRef:
        ref = self.model or self.base_of
        assert ref is not None  # _one_source
        return ref

    def describe(self) -> str:
        return str(self.model) if self.model is not None else f"16-bit base of {self.base_of}"


class Overload(FrozenModel):
    max_queue: int = Field(default=8, ge=0, le=MAX_QUEUE, description="requests a route may hold beyond its max_num_seqs before the "
                                                                       "next route takes new ones (nginx max_conns)")
    on_http_503: bool = Field(default=True, description="a 503 (or 429) from a route sends the request down the chain")


class ServerDeath(FrozenModel):
    restart: bool = Field(default=True, description="start a route's server again when it dies (on a new port; nginx reloaded)")
    max_restarts: int = Field(default=3, ge=0, le=100, description="per route, over the deployment's life")
    hung_after_s: Seconds | None = Field(default=60.0, description="restart a server that answers no /health (200) for this long: hung, or "
                                                                   "its engine dead behind a live API server (null: never)")


class Rules(FrozenModel):
    timeout_headroom: float = Field(default=3.0, ge=1, le=1000, allow_inf_nan=False, description="x the load test's p99")
    min_timeout_s: Seconds = 2.0
    last_route_timeout_s: Seconds = Field(default=120.0, description="the last route has nothing to fall back to: it waits at least this")
    connect_timeout_s: Seconds = Field(default=2.0, description="a loopback connect either succeeds at once or is refused")
    overload: Overload = Overload()
    server_death: ServerDeath = ServerDeath()
    canary_every_s: float = Field(default=60.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                  description="each version route's golden set (its bundle's evidence/canary.json) asked this often; a "
                                              "route that answers but disagrees beyond the recorded tolerance is taken out of the chain "
                                              "until a probe agrees (0: off)")


class CircuitBreaker(FrozenModel):
    """nginx's passive health check, per route: `failures_to_open` failures within `retry_after_s` mark the route down for
    `retry_after_s`; then one live request tries it again (success closes the breaker)."""

    failures_to_open: int = Field(default=3, ge=1, le=1000, description="nginx max_fails")
    retry_after_s: int = Field(default=10, ge=1, le=3600, description="nginx fail_timeout, whole seconds")


class Listen(FrozenModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)

    @field_validator("host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        try:
            loopback = ipaddress.IPv4Address(value).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"the endpoint listens on an IPv4 loopback address, e.g. 127.0.0.1 (got {value!r}); the Kubernetes export is "
                             "for more")
        return value


class Kubernetes(FrozenModel):
    """How `quantize serve export` writes the deployment for a cluster (docs/fleet.md)."""

    target: Literal["cpu", "gpu"] = Field(default="cpu", description="cpu: vLLM's CPU image, KV space from kv_cache_gib; "
                                                                     "gpu: one nvidia.com/gpu per route")
    vllm_image: Image | None = Field(default=None, description="default: vLLM 0.32's image for the target")
    proxy_image: Image = "nginx:1.27"
    proxy_replicas: int = Field(default=2, ge=1, le=100, description="more than one: the proxy is no single point of failure either")
    models_claim: ObjectName = Field(default="quantgate-models", description="the PersistentVolumeClaim holding promoted/<model>/v<N> and "
                                                                              "base/<model>")
    cpus: int = Field(default=4, ge=1, le=1024, description="CPU request of each vLLM pod")
    dtype: str = Field(default="auto", pattern=r"^(auto|bfloat16|float16|half|float32|float)$")




class Deployment(FrozenModel):
    name: DnsLabel = Field(description="the run folder's and the Kubernetes objects' name")
    served_model_name: ModelName | None = None
    primary: Route
    fallbacks: list[Route] = Field(default_factory=list, max_length=MAX_ROUTES - 1)
    rules: Rules = Rules()
    circuit_breaker: CircuitBreaker = CircuitBreaker()
    listen: Listen = Listen()
    kubernetes: Kubernetes = Kubernetes()



    @property
    def routes(self) -> list[Route]:
        """The chain in order: the primary, then each fallback."""
        return [self.primary, *self.fallbacks]

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.primary.ref.model


def route_field(index: int) -> str:
    """How a route is named in errors: `primary` or `fallbacks[i]`, as in the file."""
    return "primary" if index == 0 else f"fallbacks[{index - 1}]"


def load_deployment(path: Path) -> Deployment:
    return load_yaml_model(path, Deployment, "deployment")
