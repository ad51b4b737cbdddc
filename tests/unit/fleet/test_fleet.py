"""`quantize serve` before anything starts (docs/fleet.md): the deployment file, every route resolved and verified
against the registry's signed bundles, cycles, the planner's fit, the nginx config (checked by the real `nginx -t`),
the proxy's logs read back into traffic and breaker times, and the Kubernetes export validated offline.

Promoted versions come from the real runner with vLLM and lm-eval faked (tests/unit/conftest.py `cli`), with the load
test's figures of a real run on an AVX2 host (tests/data/fleet) as their envelope, so every signature and bundle
checked here is the product's own."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from fakes import promoted as promote_once

from pipelines.cli import main
from pipelines.errors import InputError
from pipelines.fleet import fit as fit_module
from pipelines.fleet.deployment import Deployment, load_deployment
from pipelines.fleet.kubernetes import export_manifests, validate
from pipelines.fleet.nginx import ProxyLayout, Upstream, render_config, write_config
from pipelines.fleet.proxy import check_config, find_nginx
from pipelines.fleet.routes import ResolvedRoute, resolve_routes
from pipelines.fleet.traffic import TrafficCounter, parse_access_line
from pipelines.loadtest.results import PerformanceReport
from pipelines.registry.signing import CERT_ENV, CHAIN_ENV, KEY_ENV, TRUSTED_ENV
from pipelines.registry.store import Registry
from pipelines.runs import runner

DATA = Path(__file__).resolve().parents[2] / "data" / "fleet" / "w8a8-avx2-performance.json"
MODEL = "demo-llama"
NGINX = shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="Debian's nginx is not installed (make setup)")


@pytest.fixture(autouse=True)
def no_signing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (KEY_ENV, CERT_ENV, CHAIN_ENV, TRUSTED_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> PerformanceReport:
    """Every gate run gets the load test of a real w8a8 run on an AVX2 host as its performance section."""
    performance = PerformanceReport.model_validate(json.loads(DATA.read_text())["performance"])
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, load_test=lambda gate, pool, inputs, stages: (gate, performance)))
    return performance


@pytest.fixture
def promoted(cli, workspace: SimpleNamespace, measured: PerformanceReport):
    """promoted(): one more promoted, signed version of the workspace's artifact (a new gate run is new evidence)."""
    return lambda: promote_once(cli, workspace)


def write_deployment(folder: Path, body: dict) -> Path:
    path = folder / "deployment.yaml"
    path.write_text(yaml.safe_dump({"name": "demo", **body}))
    return path


def resolve(workspace: SimpleNamespace, path: Path) -> list[ResolvedRoute]:
    return resolve_routes(load_deployment(path), Registry(workspace.registry), source=path)


def refused(callable_, *args) -> InputError:
    with pytest.raises(InputError) as caught:
        callable_(*args)
    assert "\n" not in caught.value.one_line()
    return caught.value


# --------------------------------------------------------------------------------- the file


def test_a_full_deployment_file_parses_with_shorthands(tmp_path: Path) -> None:
    path = write_deployment(tmp_path, {
        "primary": "demo-llama@production", "fallbacks": ["demo-llama@1", {"base_of": "demo-llama@production", "timeout_s": 20}],
        "circuit_breaker": {"failures_to_open": 2, "retry_after_s": 5}, "listen": {"port": 18080},
    })
    deployment = load_deployment(path)
    assert [route.describe() for route in deployment.routes] == ["demo-llama@production", "demo-llama@1", "16-bit base of demo-llama@production"]
    assert deployment.routes[1].ref.ref == 1 and deployment.routes[2].timeout_s == 20
    assert deployment.model_name == "demo-llama"


@pytest.mark.parametrize("timeout", ["0", "-1", "1e999", ".inf", ".nan", "1e9", "'soon'"])
def test_a_hostile_timeout_is_one_line_naming_the_field(tmp_path: Path, timeout: str) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_text(f"name: demo\nprimary: demo-llama@1\nfallbacks:\n  - model: demo-llama@2\n    timeout_s: {timeout}\n")
    error = refused(load_deployment, path)
    assert error.file == str(path) and error.field in ("fallbacks.0.timeout_s", "fallbacks[0].timeout_s")  # pydantic's / the YAML reader's


@pytest.mark.parametrize(("body", "field"), [
    ({"primary": "demo-llama"}, "primary"),
    ({"primary": "demo-llama@"}, "primary"),
    ({"primary": "demo llama@1"}, "primary"),
    ({"primary": {"model": "demo-llama@1", "base_of": "demo-llama@1"}}, "primary"),
    ({"primary": "demo-llama@1", "extra": 1}, "extra"),
    ({"primary": "demo-llama@1", "listen": {"host": "0.0.0.0"}}, "listen.host"),
    ({"primary": "demo-llama@1", "listen": {"port": 70000}}, "listen.port"),
    ({"primary": "demo-llama@1", "circuit_breaker": {"failures_to_open": 0}}, "circuit_breaker.failures_to_open"),
    ({"primary": "demo-llama@1", "rules": {"min_timeout_s": -2}}, "rules.min_timeout_s"),
    ({"primary": "demo-llama@99999999999999"}, "primary"),
])
def test_bad_fields_are_refused_by_name(tmp_path: Path, body: dict, field: str) -> None:
    error = refused(load_deployment, write_deployment(tmp_path, body))
    assert error.field is not None and error.field.startswith(field), error.one_line()


def test_a_name_that_is_not_a_dns_label_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_text("name: Demo_1\nprimary: demo-llama@1\n")
    assert refused(load_deployment, path).field == "name"


# --------------------------------------------------------------------------------- routes: verified before anything starts


def test_routes_resolve_to_the_signed_bundle_and_the_signed_16_bit_folder(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    Registry(workspace.registry).set_alias(MODEL, "production", version.version)
    routes = resolve(workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@production", "fallbacks": [{"base_of": f"{MODEL}@production"}]}))
    primary, base = routes
    assert primary.model_dir == workspace.registry.parent / "promoted" / MODEL / f"v{version.version}"
    assert base.model_dir == workspace.baseline and base.kind == "base"
    assert "signature" in primary.verified and "signed source_hash" in base.verified
    # 3 x (TTFT p99 768.35 + TPOT p99 48.19 x 11) at concurrency 16, the candidate's; the 16-bit route gets the baseline's figures
    # (3 x 852 ms), raised to last_route_timeout_s: it is the last route, with nothing to fall back to
    assert primary.timeout_s == pytest.approx(3.895, abs=0.01) and base.timeout_s == 120.0 and "2.56 s" in base.timeout_basis
    assert primary.serve.max_num_seqs == 16 and primary.serve.dtype == "bfloat16"  # the unit tests' host (tests/unit/conftest.py)


def test_an_unknown_version_or_alias_is_refused_naming_the_route(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    promoted()
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@1", "fallbacks": [f"{MODEL}@7"]})
    error = refused(resolve, workspace, path)
    assert error.field == "fallbacks[0]" and error.file == str(path)
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@champion"})
    assert "champion" in refused(resolve, workspace, path).message
    assert "no-such-model" in refused(resolve, workspace, write_deployment(tmp_path, {"primary": "no-such-model@1"})).message


def test_a_chain_that_comes_back_to_a_model_is_a_cycle(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    Registry(workspace.registry).set_alias(MODEL, "production", version.version)
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@production", "fallbacks": [{"base_of": f"{MODEL}@1"}, f"{MODEL}@1"]})
    error = refused(resolve, workspace, path)
    assert "cycle" in error.message and error.field == "fallbacks[1]"
    two = promoted()  # another gate run of the same artifact: another version, the same bytes
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@1", "fallbacks": [f"{MODEL}@{two.version}"]})
    assert "cycle" in refused(resolve, workspace, path).message


def test_a_tampered_bundle_is_refused_naming_the_route(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    weights = workspace.registry.parent / "promoted" / MODEL / f"v{version.version}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    error = refused(resolve, workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}"}))
    assert error.field == "primary" and "does not verify" in error.message


def test_an_unsigned_or_rejected_version_is_refused(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    registry = Registry(workspace.registry)
    registry.reject(version.id, "regression found in production")
    error = refused(resolve, workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}"}))
    assert "rejected" in error.message and "promoted versions only" in error.message
    signature = workspace.registry.parent / "promoted" / MODEL
    unsigned = promoted()
    (signature / f"v{unsigned.version}" / "model.sig").unlink()
    assert "does not verify" in refused(resolve, workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@{unsigned.version}"})).message


def test_a_changed_16_bit_folder_is_refused(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    (workspace.baseline / "config.json").write_text((workspace.baseline / "config.json").read_text() + " ")
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}", "fallbacks": [{"base_of": f"{MODEL}@{version.version}"}]})
    error = refused(resolve, workspace, path)
    assert error.field == "fallbacks[0]" and "signed source_hash" in error.message


def test_a_version_without_an_envelope_needs_a_timeout(tmp_path: Path, workspace: SimpleNamespace, cli, monkeypatch) -> None:
    monkeypatch.setattr(runner, "STACK", replace(runner.STACK, load_test=lambda gate, pool, inputs, stages: (gate, None)))
    assert cli() == 0
    error = refused(resolve, workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@1"}))
    assert error.field == "primary.timeout_s" and "load-test envelope" in error.message
    routes = resolve(workspace, write_deployment(tmp_path, {"primary": {"model": f"{MODEL}@1", "timeout_s": 7.5}}))
    assert routes[0].timeout_s == 7.5 and routes[0].timeout_basis == "set in the deployment file"


def test_the_latency_is_each_models_own_at_the_measured_concurrency(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    routes = resolve(workspace, write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}", "fallbacks": [{"base_of": f"{MODEL}@1"}]}))
    performance = PerformanceReport.model_validate(json.loads(DATA.read_text())["performance"])
    for route, role in zip(routes, ("candidate", "baseline"), strict=True):
        latency = route.latency
        figures = performance.figures(role).at(16)  # type: ignore[union-attr]
        assert latency is not None and latency.concurrency == 16 and latency.longest_answer_tokens == 12
        assert latency.ttft_p99_ms == figures.ttft_ms.p99 and latency.e2e_p99_ms == pytest.approx(figures.ttft_ms.p99 + 11 * figures.tpot_ms.p99)


# --------------------------------------------------------------------------------- fit by the planner


def test_a_chain_that_does_not_fit_the_machine_is_refused(tmp_path: Path, workspace: SimpleNamespace, promoted, monkeypatch) -> None:
    version = promoted()
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}", "fallbacks": [{"base_of": f"{MODEL}@{version.version}",
                                                                                                "kv_cache_gib": 64}]})
    routes = resolve(workspace, path)
    report = fit_module.check_fit(routes, source=path, available_bytes=200 * 2**30)
    assert report.required_bytes > 65 * 2**30
    with pytest.raises(InputError) as caught:
        fit_module.check_fit(routes, source=path, available_bytes=24 * 2**30)
    error = caught.value
    assert error.field == "fallbacks[0]" and "does not fit by the planner" in error.message and "24.00 GiB available" in error.message


# --------------------------------------------------------------------------------- nginx


def _layout(folder: Path) -> ProxyLayout:
    return ProxyLayout(prefix=folder, listen_host="127.0.0.1", listen_port=18080, sentinel_port=18999, client_key=secrets.token_urlsafe(32))


@needs_nginx
@pytest.mark.parametrize("routes", [1, 3])
def test_the_generated_config_passes_nginx_t(tmp_path: Path, routes: int) -> None:
    deployment = Deployment.model_validate({"name": "demo", "primary": "m@1", "fallbacks": [f"m@{i}" for i in range(2, routes + 1)]})
    upstreams = [Upstream(label=f"r{i}", address=f"127.0.0.1:{18001 + i}", api_key=secrets.token_urlsafe(32), timeout_s=1.5, max_conns=24)
                 for i in range(routes)]
    layout = _layout(tmp_path)
    text = render_config(deployment, layout, upstreams)
    write_config(layout, text)
    assert "syntax is ok" in check_config(Path(NGINX or "nginx"), layout)
    assert (layout.conf.stat().st_mode & 0o777) == 0o600
    assert text.count("backup max_fails=0;") == routes and text.count("max_fails=3 fail_timeout=10s max_conns=24") == routes
    assert "non_idempotent" in text and "proxy_read_timeout 1500ms" in text
    # overload is not failure: nginx counts every status of proxy_next_upstream toward max_fails; 503/429 go by error_page only
    next_upstream = next(line for line in text.splitlines() if "proxy_next_upstream " in line and "error" in line)
    assert "http_503" not in next_upstream and "http_429" not in next_upstream and "error_page 500 502 504 503 429 = @route_verdict;" in text
    assert "keepalive_timeout 0;" in text and text.count("location = /quantgate-probe/route") == routes


@needs_nginx
def test_a_config_nginx_refuses_is_one_line(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    write_config(layout, "http { this is not nginx }\n")
    error = refused(check_config, Path(NGINX or "nginx"), layout)
    assert "nginx -t" in error.message


def test_a_missing_nginx_says_how_to_install_it(tmp_path: Path) -> None:
    error = refused(find_nginx, str(tmp_path / "nginx"))
    assert "apt-get install nginx" in error.message


# --------------------------------------------------------------------------------- the proxy's logs


def _line(at: float, upstreams: str, statuses: str, status: int = 200, route: str = "primary", took: float = 0.01) -> str:
    return json.dumps({"t": at, "id": "x", "route": route, "method": "POST", "uri": "/v1/completions", "status": status,
                       "upstreams": upstreams, "upstream_status": statuses, "upstream_time": "0.01", "time": took})


def test_log_lines_become_hops() -> None:
    request = parse_access_line(_line(10.0, "127.0.0.1:9101, 127.0.0.1:9199 : 127.0.0.1:9102", "504, 503 : 200", route="fallback-1"), 9199)
    assert request is not None and [(hop.outcome, hop.status) for hop in request.hops] == [("failed", 504), ("answered", 200)]
    assert request.answered_by == 1
    skipped = parse_access_line(_line(11.0, "route0 : 127.0.0.1:9102", "502 : 200"), 9199)
    assert skipped is not None and skipped.hops[0].outcome == "skipped"
    assert parse_access_line("not json", 9199) is None and parse_access_line("{" * 20_000, 9199) is None


def test_the_breaker_opens_with_nginx_and_closes_when_the_route_answers_again() -> None:
    counter = TrafficCounter(["primary", "fallback-1"], sentinel_port=9199)
    stamp = time.mktime(time.strptime("2026/12/03 13:45:57", "%Y/%m/%d %H:%M:%S"))
    access = [
        _line(stamp - 1, "127.0.0.1:9101", "200"),
        *[_line(stamp + 0.2 * i, "127.0.0.1:9101, 127.0.0.1:9199 : 127.0.0.1:9102", "502, 503 : 200", route="fallback-1") for i in range(3)],
        *[_line(stamp + 1 + i, "127.0.0.1:9199, route0 : 127.0.0.1:9102", "503, 502 : 200", route="fallback-1") for i in range(4)],
        _line(stamp + 11, "127.0.0.1:9101", "200"),
    ]
    errors = ["2026/12/03 13:45:57 [warn] 1#1: *8 upstream server temporarily disabled while connecting to upstream, client: 127.0.0.1, "
              'server: , request: "POST /v1/completions HTTP/1.1", upstream: "http://127.0.0.1:9101/v1/completions", host: "x"']
    counter.feed(access, errors, {9101: 0, 9102: 1})
    traffic = counter.traffic
    assert (traffic.requests, traffic.answered, traffic.failed) == (9, 9, {})
    primary, fallback = traffic.routes
    assert primary.answered == 2 and primary.failed == {"connection refused or reset (server down)": 3} and primary.skipped_breaker_open == 4
    assert fallback.answered == 7
    assert [(event.kind, event.at) for event in traffic.breaker] == [("opened", stamp), ("closed", stamp + 11)]


def test_a_request_no_route_answered_is_counted_with_why() -> None:
    counter = TrafficCounter(["primary", "fallback-1"], sentinel_port=9199)
    counter.feed([_line(5.0, "127.0.0.1:9101, 127.0.0.1:9199 : 127.0.0.1:9102", "504, 503 : 502", status=502, route="fallback-1")], [], {})
    assert counter.traffic.failed == {"HTTP 502: primary timed out; fallback-1 connection refused or reset (server down)": 1}


# --------------------------------------------------------------------------------- Kubernetes


def test_the_export_validates_offline_and_keeps_the_keys_private(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    version = promoted()
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}", "fallbacks": [{"base_of": f"{MODEL}@{version.version}"}]})
    deployment = load_deployment(path)
    exported = export_manifests(deployment, resolve(workspace, path), tmp_path / "k8s")
    kinds = sorted(item.kind for item in exported.objects)
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "Deployment", "PodDisruptionBudget", "Secret", "Service", "Service", "Service"]
    assert "strict" in exported.validated_against
    secret = next(tmp_path.joinpath("k8s", item.file) for item in exported.objects if item.kind == "Secret")
    assert (secret.stat().st_mode & 0o777) == 0o600
    primary = yaml.safe_load((tmp_path / "k8s" / "demo-primary-deployment.yaml").read_text())
    container = primary["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["--model", f"/models/promoted/{MODEL}/v{version.version}"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    with pytest.raises(InputError):  # the folder is not ours to replace
        export_manifests(deployment, resolve(workspace, path), workspace.root / "models")


def test_the_export_replaces_only_its_own_earlier_export(tmp_path: Path, workspace: SimpleNamespace, promoted) -> None:
    """A user's kustomize folder (kustomization.yaml, app.yaml, overlays/) is refused untouched; an earlier export is
    replaced; one a user edited since, or added a file to, is refused (nothing deletes a file it did not write)."""
    version = promoted()
    path = write_deployment(tmp_path, {"primary": f"{MODEL}@{version.version}"})
    deployment, routes = load_deployment(path), resolve(workspace, path)
    users = tmp_path / "users"
    (users / "overlays" / "prod").mkdir(parents=True)
    for name in ("kustomization.yaml", "app.yaml", "overlays/prod/kustomization.yaml"):
        (users / name).write_text(f"# the user's {name}\n")
    with pytest.raises(InputError, match="not an earlier export"):
        export_manifests(deployment, routes, users)
    assert sorted(p.relative_to(users).as_posix() for p in users.rglob("*")) == [
        "app.yaml", "kustomization.yaml", "overlays", "overlays/prod", "overlays/prod/kustomization.yaml"]
    out = tmp_path / "k8s"
    first = export_manifests(deployment, routes, out)
    second = export_manifests(deployment, routes, out)  # an earlier export, as written: replaced
    assert [item.file for item in first.objects] == [item.file for item in second.objects]
    (out / "notes.md").write_text("mine\n")
    with pytest.raises(InputError, match="not written by the export"):
        export_manifests(deployment, routes, out)
    (out / "notes.md").unlink()
    (out / "kustomization.yaml").write_text("# edited\n")
    with pytest.raises(InputError, match="changed since"):
        export_manifests(deployment, routes, out)
    assert (out / "kustomization.yaml").read_text() == "# edited\n"


def test_an_object_the_schema_refuses_names_its_field() -> None:
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicas": "two", "selector": {}, "template": {}}}
    error = refused(validate, [bad])
    assert "Deployment x" in error.message and error.field == "spec.replicas"


# --------------------------------------------------------------------------------- the command line


def test_serve_check_refuses_bad_input_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_text("name: demo\nprimary: demo-llama@1\nfallbacks: [{model: demo-llama@2, timeout_s: -1}]\n")
    assert main(["serve", "check", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "fallbacks.0.timeout_s" in lines[0]
    assert main(["serve", "status", "nothing-ran"]) == 2
    assert main(["serve", "export", str(path)]) == 2
