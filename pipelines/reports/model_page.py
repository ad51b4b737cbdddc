"""A registry model's page: its newest verdict and aliases first, then its verdicts over time (a drawing and a row per
version), the aliases with what they pointed at before, and the event log.

    html = render_model_page(ModelHistory.read(registry, "demo-llama"))

Each version is read through the registry (pipelines.registry.store): its status, aliases and the gate.json it was
registered with (its verdict, the worst set's bound against its tolerance, the load test's throughput ratio, the host
class it was gated on).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.gate.schema import GateReport
from pipelines.registry.store import AliasTarget, Event, Registry, Version
from pipelines.reports.charts import FAIL, NEUTRAL, PASS, Point, scatter_svg
from pipelines.reports.markup import Markup, anchor_id, bullets, note, page, section, table, verdict_banner

VERSION_COLUMNS = ["Version", "Created", "Recipe", "Status", "Gate verdict", "Aliases", "Worst set: bound / tolerance",
                   "Share of tolerance", "Throughput ratio", "Host class", "Artifact"]
EVENT_COLUMNS = ["At", "Event", "Version", "Alias", "From -> to", "Reason"]
STATUS_COLOURS = {"promoted": PASS, "rejected": FAIL, "error": FAIL}
STATUS_CLASS = {"promoted": "pass", "rejected": "fail", "error": "fail"}


@dataclass(frozen=True)
class ModelHistory:
    model: str
    versions: list[Version]
    aliases: list[AliasTarget]
    events: list[Event]

    @classmethod
    def read(cls, registry: Registry, model: str) -> ModelHistory:
        """What the registry holds of `model`; an unknown model is the registry's one-line InputError."""
        return cls(model=model, versions=registry.list(model), aliases=registry.aliases(model), events=registry.history(model))


def tolerance_share(gate: GateReport) -> tuple[float | None, str]:
    """The largest share of its tolerance any set's one-sided bound uses (under 1: within every tolerance), and that set
    in words; None when no set has both a bound and a tolerance."""
    shares = [(s.worsening_bound / s.tolerance, s) for s in gate.gate.sets
              if s.worsening_bound is not None and s.tolerance is not None and s.tolerance > 0]
    if not shares:
        return None, "-"
    share, worst = max(shares, key=lambda pair: pair[0])
    return share, f"{worst.eval_set}: {worst.worsening_bound:.2f} / {worst.tolerance:.2f} {worst.unit}"


def _throughput(gate: GateReport | None) -> str:
    comparison = gate.performance.comparison if gate is not None and gate.performance is not None else None
    interval = comparison.throughput.interval if comparison is not None else None
    if interval is None:
        return "-"
    shown = f" [{interval.low:.2f}, {interval.high:.2f}]" if interval.low is not None and interval.high is not None else ""
    return f"{interval.estimate:.2f}x{shown}"


def _host_class(gate: GateReport | None) -> str:
    for key in ("runtime", "host"):
        record = gate.inputs.get(key) if gate is not None else None
        if isinstance(record, dict) and isinstance(record.get("host_class"), str):
            return record["host_class"]
    return "-"


def version_rows(history: ModelHistory) -> list[list[str]]:
    rows = []
    for v in history.versions:
        share, worst = tolerance_share(v.gate) if v.gate is not None else (None, "-")
        rows.append([f"v{v.version}", v.created_at, v.recipe_name, v.status, v.verdict or "-", ", ".join(v.aliases) or "-", worst,
                     "-" if share is None else f"{share:.0%}", _throughput(v.gate), _host_class(v.gate), v.artifact_path])
    return rows


def verdicts_over_time(history: ModelHistory) -> Markup:
    """Each version's largest share of a tolerance (its worst set's bound / that tolerance), in version order; coloured by
    status; a version registered without evidence is left out."""
    points = []
    for v in history.versions:
        share = tolerance_share(v.gate)[0] if v.gate is not None else None
        if share is not None:
            points.append(Point(x=float(v.version), y=share, label=f"v{v.version} {v.recipe_name} ({v.status})",
                                colour=STATUS_COLOURS.get(v.status, NEUTRAL)))
    return scatter_svg(points, "version (registration order)", "worst set's bound / its tolerance",
                       title=f"{history.model}: share of the tolerance used, per version (1 = at the tolerance)", y_line=1.0,
                       whole_x=True)


def alias_rows(history: ModelHistory) -> list[list[str]]:
    return [[a.alias, f"v{a.version}", "-" if a.previous is None else f"v{a.previous}"] for a in history.aliases]


def event_rows(history: ModelHistory) -> list[list[str]]:
    def number(value: int | None) -> str:
        return "-" if value is None else f"v{value}"

    return [[e.at, e.kind, number(e.version), e.alias or "-",
             f"{number(e.from_version)} -> {number(e.to_version)}" if e.from_version is not None or e.to_version is not None else "-",
             e.reason or "-"] for e in history.events]


def _banner(history: ModelHistory) -> Markup:
    newest = history.versions[-1]
    counts: dict[str, int] = {}
    for v in history.versions:
        counts[v.status] = counts.get(v.status, 0) + 1
    lines = [f"newest version v{newest.version} ({newest.recipe_name}, {newest.created_at}): {newest.status}",
             "aliases: " + (", ".join(f"{a.alias} -> v{a.version}" for a in history.aliases) or "none"),
             _counted(len(history.versions), "version") + ": " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))]
    return verdict_banner(newest.verdict or newest.status, f"Model {history.model}", lines)


def render_model_page(history: ModelHistory) -> str:
    blocks = [_banner(history)]
    if history.aliases:
        blocks.append(section("Aliases", table(["Alias", "Version", "Before (rollback target)"], alias_rows(history)), anchor="aliases"))
    blocks.append(section(
        "Verdicts over time", verdicts_over_time(history),
        note("Share of tolerance: the largest, over the version's eval sets, of the one-sided bound of the worsening divided by the "
             "tightest tolerance in force; under 100% every set is within its tolerance (the gate's other rules may still reject)."),
        table(VERSION_COLUMNS, version_rows(history), row_classes=[STATUS_CLASS.get(v.status) for v in history.versions],
              row_ids=[anchor_id("version", str(v.version), i) for i, v in enumerate(history.versions)]),
        anchor="versions",
    ))
    signed = [e for e in history.events if e.kind == "promoted"]
    blocks.append(section("Events", table(EVENT_COLUMNS, event_rows(history)),
                          bullets([f"{len(history.events)} events, {len(signed)} promotions (each through the signed door)"]), anchor="events"))
    return page(f"Model {history.model}", *blocks)


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
