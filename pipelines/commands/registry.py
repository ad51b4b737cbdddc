"""`quantize registry ...`: list, inspect and move versions of quantized artifacts and their aliases."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipelines.commands.args import int_arg
from pipelines.console.output import emit, say, table
from pipelines.console.redact import without_credentials
from pipelines.errors import InputError
from pipelines.files.jsonio import read_json_object
from pipelines.files.yamlio import MAX_JSON_BYTES
from pipelines.loadtest.render import headline
from pipelines.registry.copying import copy_registry
from pipelines.registry.evidence import PromotionCheck
from pipelines.registry.mirror import mirror_after, mirror_target, retry_pending
from pipelines.registry.mlflow_export import export_to_mlflow, mirror_model
from pipelines.registry.promotion import promote_signed
from pipelines.registry.reference import MAX_VERSION, split_reference, version_or_alias
from pipelines.registry.store import AliasTarget, Event, Registry, Version, open_registry

version_number = int_arg(1, MAX_VERSION)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("registry")  # its summary: pipelines.cli.COMMANDS
    actions = parser.add_subparsers(dest="registry_command", metavar="ACTION", required=True)

    def action(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument("--registry", metavar="PATH", type=Path, default=None,
                         help="registry database (default: $QUANTGATE_REGISTRY or artifacts/registry.db)")
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
        sub.set_defaults(handler=handler)
        return sub

    sub = action("list", "versions of every model, or of one", _list)
    sub.add_argument("model", metavar="MODEL", nargs="?")

    sub = action("show", "one version (by number or alias) with its gate evidence", _show)
    sub.add_argument("model", metavar="MODEL")
    sub.add_argument("version", metavar="VERSION_OR_ALIAS")

    for name in ("promote", "reject"):
        sub = action(name, f"{name} a version by hand (recorded with the reason)", _change_status)
        sub.add_argument("model", metavar="MODEL")
        sub.add_argument("version", metavar="VERSION", type=version_number)
        sub.add_argument("--reason", required=True, help="why; kept in the history")
        sub.add_argument("--evidence", type=Path, help="a JSON file recorded with the change")
        if name == "promote":
            sub.add_argument("--override-gate", action="store_true",
                             help="promote even though this version's gate evidence says rejected (recorded)")
            _mlflow_option(sub)

    sub = action("verify", "check a promoted version's signed bundle: files, signature, trusted key, evidence", _verify)
    sub.add_argument("target", metavar="NAME[@VERSION|ALIAS]", help="a model, optionally @ a version or alias (default: its newest promoted version)")

    sub = action("alias", "point an alias (e.g. production) at a promoted version", _alias)
    sub.add_argument("model", metavar="MODEL")
    sub.add_argument("alias", metavar="ALIAS")
    sub.add_argument("version", metavar="VERSION", type=version_number)
    sub.add_argument("--reason", default="", help="why; kept in the history")
    _mlflow_option(sub)

    sub = action("rollback", "move an alias back to the version it pointed at before", _rollback)
    sub.add_argument("model", metavar="MODEL")
    sub.add_argument("alias", metavar="ALIAS")
    sub.add_argument("--reason", default="", help="why; kept in the history")
    _mlflow_option(sub)

    sub = action("history", "every registration, status change and alias move", _history)
    sub.add_argument("model", metavar="MODEL", nargs="?")
    sub.add_argument("--alias", help="only moves of this alias")
    sub.add_argument("--version", type=version_number, help="only events about this version")

    sub = action("export-mlflow", "register a promoted version in an MLflow model registry", _export_mlflow)
    sub.add_argument("model", metavar="MODEL")
    sub.add_argument("version", metavar="VERSION_OR_ALIAS")
    sub.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///artifacts/mlflow.db)")
    sub.add_argument("--alias", default=None, help="MLflow alias to set on the new model version")

    sub = actions.add_parser("copy", help="copy every version, alias and event into an empty registry (SQLite <-> PostgreSQL)")
    sub.add_argument("--from", dest="source", metavar="PATH|URL", required=True, help="the registry to copy")
    sub.add_argument("--to", dest="target", metavar="PATH|URL", required=True, help="an empty or new registry")
    sub.add_argument("--json", action="store_true", help="print JSON instead of a line")
    sub.set_defaults(handler=_copy)

    sub = action("mirror", "mirror versions and aliases to an MLflow tracking server (docs/registry.md, \"MLflow mirror\")", _mirror)
    sub.add_argument("model", metavar="MODEL", nargs="?", help="mirror this model's promoted versions and its aliases")
    sub.add_argument("version", metavar="VERSION_OR_ALIAS", nargs="?", help="only this version (and the aliases)")
    sub.add_argument("--retry", action="store_true", help="mirror what failed before (the pending records in the artifacts folder)")
    _mlflow_option(sub)


def _mlflow_option(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--mlflow", metavar="URL", default=None,
                     help="mirror the change to this MLflow tracking server (default: $QUANTGATE_MLFLOW; none: no mirror)")


# --- handlers ------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    versions = _open(args).list(args.model)
    emit(versions, as_json=args.json, render=_render_versions)
    return 0


def _show(args: argparse.Namespace) -> int:
    wanted = version_or_alias(args.version)  # checked before the database is opened
    version = _open(args).show(args.model, wanted)
    emit(version, as_json=args.json, render=_render_version)
    return 0


def _change_status(args: argparse.Namespace) -> int:
    registry = _open(args)
    version = registry.show(args.model, args.version)
    evidence = _read_evidence(args.evidence) if args.evidence else None
    if args.registry_command == "promote":

        run_dir = Path(version.gate_path).parent if version.gate_path else None
        changed = promote_signed(registry, version, args.reason, evidence, run_dir=run_dir, override_gate=args.override_gate)
        mirror_after(registry, changed.model, [changed.version], target=args.mlflow)
    else:
        changed = registry.reject(version.id, args.reason, evidence)
    emit(changed, as_json=args.json, render=_render_version)
    return 0


def _copy(args: argparse.Namespace) -> int:
    source, target = open_registry(args.source, field="--from"), Registry(args.target, field="--to")
    copied = copy_registry(source, target)
    emit(copied, as_json=args.json, render=lambda c: say(
        f"copied {c['versions']} versions, {c['aliases']} alias entries and {c['events']} events to {target.location}"))
    return 0


def _verify(args: argparse.Namespace) -> int:
    model, number_or_alias = split_reference(args.target)  # checked before the database is opened
    registry = _open(args)
    version = registry.show(model, number_or_alias) if number_or_alias is not None else _newest_promoted(registry, model)
    check = registry.verify_signature(version, required=True)
    emit(check, as_json=args.json, render=_render_check)
    return 0


def _newest_promoted(registry: Registry, model: str) -> Version:
    promoted = [v for v in registry.list(model) if v.status == "promoted"]
    if not promoted:
        raise InputError(f"model {model!r} has no promoted version", file=registry.path, field="NAME")
    return promoted[-1]


def _alias(args: argparse.Namespace) -> int:
    registry = _open(args)
    target = registry.set_alias(args.model, args.alias, args.version, reason=args.reason)
    mirror_after(registry, args.model, target=args.mlflow)
    emit(target, as_json=args.json, render=_render_alias)
    return 0


def _rollback(args: argparse.Namespace) -> int:
    registry = _open(args)
    target = registry.rollback(args.model, args.alias, reason=args.reason)
    mirror_after(registry, args.model, target=args.mlflow)
    emit(target, as_json=args.json, render=_render_alias)
    return 0


def _history(args: argparse.Namespace) -> int:
    events = _open(args).history(args.model, version=args.version, alias=args.alias)
    emit(events, as_json=args.json, render=_render_events)
    return 0


def _export_mlflow(args: argparse.Namespace) -> int:

    wanted = version_or_alias(args.version)
    registry = _open(args)
    version = registry.resolve(args.model, wanted)
    result = export_to_mlflow(version, tracking_uri=args.tracking_uri, alias=args.alias, registry=registry)

    def render(value: Any) -> None:
        state = "already exported as" if value.reused else "exported as"
        say(f"{version.model} v{version.version} {state} MLflow model "
            f"{value.registered_model!r} version {value.model_version} ({value.tracking_uri})")
        if value.alias:
            say(f"alias {value.alias!r} -> version {value.model_version}")

    emit(result, as_json=args.json, render=render)
    return 0


def _mirror(args: argparse.Namespace) -> int:
    """A model (or one version) mirrored now, errors as errors; or, with --retry, every pending record."""
    url = mirror_target(args.mlflow)
    if args.retry:
        done, failed = retry_pending(url)
        for line in failed:
            say(f"still pending: {line}")
        say(f"mirrored {len(done)} pending record group(s); {len(failed)} still pending")
        return 2 if failed else 0
    if args.model is None:
        raise InputError("name a MODEL to mirror, or --retry the pending records", field="MODEL")
    if url is None:
        raise InputError("no MLflow tracking server: give --mlflow URL or set QUANTGATE_MLFLOW", field="--mlflow")
    registry = _open(args)
    if args.version is not None:
        numbers = [registry.resolve(args.model, version_or_alias(args.version)).version]
    else:
        numbers = [v.version for v in registry.list(args.model) if v.status == "promoted"]
    try:
        result = mirror_model(registry, args.model, numbers, url)
    except InputError:
        raise
    except Exception as error:  # MLflow's errors (server down, refused request) are the user's to fix: one line
        raise InputError(f"MLflow mirror failed: {without_credentials(str(getattr(error, 'message', error))).splitlines()[0]}",
                         file=without_credentials(url), field="--mlflow") from None
    emit(result, as_json=args.json, render=lambda value: say(
        f"{value.registered_model}: versions {value.versions or '-'}, aliases {value.aliases or '-'} at {without_credentials(url)}"))
    return 0


# --- helpers ------------------------------------------------------------------------------------------


def _open(args: argparse.Namespace) -> Registry:
    return open_registry(args.registry)


def _read_evidence(path: Path) -> dict[str, Any]:
    return read_json_object(path, what="evidence", field="--evidence", max_bytes=MAX_JSON_BYTES)[0]


def _render_versions(versions: list[Version]) -> None:
    if not versions:
        say("no versions registered yet")
        return
    rows = [
        [v.model, v.version, v.status, ", ".join(v.aliases), v.recipe_name, _verdict(v), _when(v.created_at)]
        for v in versions
    ]
    say(table("Registry", ["model", "ver", "status", "aliases", "recipe", "gate", "created (UTC)"], rows))


def _render_version(version: Version) -> None:
    rows = [
        ["status", version.status], ["aliases", ", ".join(version.aliases) or "-"],
        ["reason", version.reason or "-"], ["artifact", version.artifact_path],
        ["artifact hash", version.artifact_hash], ["source hash", version.source_hash],
        ["recipe", f"{version.recipe_name} ({version.recipe_hash[:12]})"],
        ["eval sets", ", ".join(f"{ref.name} ({ref.hash[:12]})" for ref in version.eval_sets) or "-"],
        ["gate evidence", version.gate_path or "-"], ["gate verdict", _verdict(version) or "-"],
        ["load test", _performance(version)],
        ["created (UTC)", version.created_at], ["updated (UTC)", version.updated_at],
    ]
    say(table(f"{version.model} v{version.version}", ["field", "value"], rows))


def _performance(version: Version) -> str:
    """The load test's headline from the version's gate evidence (docs/loadtest.md), or '-'."""

    performance = version.gate.performance if version.gate is not None else None
    return headline(performance) if performance is not None else "-"


def _render_check(check: PromotionCheck | None) -> None:
    assert check is not None  # verify_signature(required=True) raises instead
    rows = [
        ["bundle", str(check.bundle)], ["signed by", f"{check.method} {check.key_id[:16]}..."],
        ["files", f"{check.files} ({check.bytes / 2**20:.1f} MiB with the signature)"],
        ["evidence", check.evidence], ["verified in", f"{check.verify_s:.2f} s"],
    ]
    say(table(f"{check.model} v{check.version}: signature verified", ["field", "value"], rows))


def _render_alias(target: AliasTarget) -> None:
    before = f" (previously v{target.previous})" if target.previous is not None else ""
    say(f"{target.model}: {target.alias} -> v{target.version}{before}")


def _render_events(events: list[Event]) -> None:
    rows = [
        [_when(e.at), e.model, e.kind.replace("alias_", ""), _move(e) or e.version, e.alias or "", e.reason]
        for e in events
    ]
    say(table("Registry history", ["at (UTC)", "model", "event", "version", "alias", "reason"], rows))


def _when(timestamp: str) -> str:
    return timestamp[:16].replace("T", " ")


def _move(event: Event) -> str:
    if not event.kind.startswith("alias"):
        return ""
    before = f"v{event.from_version} " if event.from_version is not None else ""
    return f"{before}-> v{event.to_version}"


def _verdict(version: Version) -> str:
    return version.verdict or ""
