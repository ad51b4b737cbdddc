"""Many drivers on one registry, on PostgreSQL and on SQLite: 8 processes x 50 mixed operations (register, promote with a
signed bundle, alias, rollback, list), a driver SIGKILLed while it holds a write transaction and another at a random
moment; then the invariants: version numbers 1..n per model with none lost or duplicated, every alias entry on a promoted
version whose artifact and signed bundle verify, and the event log holding one event per successful operation.

All drivers share two models (every write of a model takes that model's lock, so they contend); each driver moves aliases
of its own (`d<i>-prod`, `d<i>-stage`), so it knows which of its alias moves changed something and the event count can be
exact. Artifacts are tiny (tests/fakes.py's make_artifact: a manifest and a few bytes), signed with the project's key.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from fakes import make_artifact, make_gate, new_version

from pipelines.errors import InputError
from pipelines.registry.promotion import promote_signed
from pipelines.registry.signing import load_signer
from pipelines.registry.store import Registry, verify_version

DRIVERS, OPERATIONS = 8, 50
MODELS = ("stress-a", "stress-b")
EVENT_KINDS = ("registered", "promoted", "alias_set", "alias_rollback")
KINDS = ("register", "promote", "alias", "rollback", "list")
WEIGHTS = (3, 3, 3, 2, 2)


class Driver:
    """One driver process: its operations in a seeded random order, each success appended to its log after commit."""

    def __init__(self, index: int, location: str, root: Path):
        self.index, self.registry, self.root = index, Registry(location), root / f"d{index}"
        self.random = random.Random(index)
        self.candidates: list[tuple[str, int]] = []  # (model, registry id)
        self.promoted: list[tuple[str, int]] = []  # (model, version number)
        self.alias_target: dict[tuple[str, str], int] = {}
        self.alias_depth: dict[tuple[str, str], int] = {}
        self.log = (root / f"d{index}.log").open("a", buffering=1)
        self.made = 0

    def run(self) -> None:
        for _ in range(OPERATIONS):
            kind = self.random.choices(KINDS, WEIGHTS)[0]
            done = getattr(self, kind)() or {"kind": "no event"}  # a read, or an alias already where asked
            self.log.write(json.dumps(done) + "\n")

    def register(self) -> dict | None:
        self.made += 1
        name = f"a{self.made}"
        artifact = make_artifact(self.root / name, weights=f"{self.index}-{name}".encode())
        model = self.random.choice(MODELS)
        version = self.registry.register(new_version(artifact, make_gate(self.root / f"{name}.json"), model=model))
        self.candidates.append((model, version.id))
        return {"kind": "registered", "model": model, "version": version.version}

    def promote(self) -> dict | None:
        if not self.candidates:
            return self.register()
        model, version_id = self.candidates.pop(0)
        version = promote_signed(self.registry, self.registry.get(version_id), f"driver {self.index}")
        self.promoted.append((model, version.version))
        return {"kind": "promoted", "model": model, "version": version.version}

    def alias(self) -> dict | None:
        if not self.promoted:
            return self.promote()
        model, number = self.random.choice(self.promoted)
        key = (model, f"d{self.index}-{self.random.choice(('prod', 'stage'))}")
        if self.alias_target.get(key) == number:
            return None  # no move: no event
        self.registry.set_alias(model, key[1], number)
        self.alias_target[key] = number
        self.alias_depth[key] = self.alias_depth.get(key, 0) + 1
        return {"kind": "alias_set", "model": model, "alias": key[1], "version": number}

    def rollback(self) -> dict | None:
        movable = [key for key, depth in self.alias_depth.items() if depth > 1]
        if not movable:
            return self.alias()
        model, alias = self.random.choice(movable)
        try:
            target = self.registry.rollback(model, alias, f"driver {self.index}")
        except InputError as error:
            if "to roll back to" not in error.message:  # the stack's earlier entries are all this version
                raise
            return None
        self.alias_target[(model, alias)] = target.version
        self.alias_depth[(model, alias)] = len(self.registry.alias_stack(model, alias))
        return {"kind": "alias_rollback", "model": model, "alias": alias, "version": target.version}

    def list(self) -> dict | None:
        for model in MODELS:
            numbers = [v.version for v in self.registry.list() if v.model == model]
            assert numbers == list(range(1, len(numbers) + 1)), f"a snapshot with a gap or a duplicate: {numbers}"
        return {"kind": "listed"}


def _drive(index: int, location: str, root: str) -> None:
    Driver(index, location, Path(root)).run()


def _hold_a_write_transaction(location: str, ready: str) -> None:
    """Writes half a registration under the model's lock, says so, and waits to be killed."""
    registry = Registry(location)
    with registry.db.transaction(write=True) as db:
        db.lock_model(MODELS[0])
        db.execute("INSERT INTO events (at, model, version, kind, reason) VALUES ('t', ?, 999, 'registered', 'never committed')",
                   (MODELS[0],))
        Path(ready).write_text("holding")
        time.sleep(600)


def stress(location: str, root: Path) -> dict:
    load_signer(Registry(location).path)  # the project key made once, before the drivers race to make it
    context = multiprocessing.get_context("fork")
    ready = root / "holder.ready"
    holder = context.Process(target=_hold_a_write_transaction, args=(location, str(ready)))
    holder.start()
    while not ready.exists():
        assert holder.is_alive(), f"the lock holder died before taking the lock (exit {holder.exitcode})"
        time.sleep(0.02)
    started = time.monotonic()
    drivers = [context.Process(target=_drive, args=(i, location, str(root))) for i in range(DRIVERS)]
    for process in drivers:
        process.start()
    time.sleep(0.5)  # the drivers queue behind the holder's lock, then it dies mid-transaction
    os.kill(holder.pid, signal.SIGKILL)
    victim = drivers[-1]
    while _logged(root, DRIVERS - 1) < 10 and victim.is_alive():
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)  # a random moment: inside a transaction, a signature, or between two
    for process in drivers:
        process.join(timeout=300)
        if process.is_alive():  # stuck: killed, so no driver outlives the test
            process.kill()
            process.join()
    seconds = time.monotonic() - started
    assert [p.exitcode for p in drivers[:-1]] == [0] * (DRIVERS - 1), [p.exitcode for p in drivers]
    events = [json.loads(line) for i in range(DRIVERS) for line in (root / f"d{i}.log").read_text().splitlines()]
    return {"seconds": seconds, "events": events, "killed_logged": _logged(root, DRIVERS - 1)}


def _logged(root: Path, index: int) -> int:
    path = root / f"d{index}.log"
    return len(path.read_text().splitlines()) if path.exists() else 0


def check_invariants(location: str, run: dict) -> None:
    registry = Registry(location)
    versions = registry.list()
    for model in MODELS:
        numbers = [v.version for v in versions if v.model == model]
        assert numbers == list(range(1, len(numbers) + 1)), f"{model}: lost or duplicate version numbers {numbers}"
    history = registry.history()
    assert all(event.reason != "never committed" for event in history)  # the killed holder's write rolled back
    logged = Counter(event["kind"] for event in run["events"] if event["kind"] in EVENT_KINDS)
    recorded = Counter(event.kind for event in history)
    for kind in EVENT_KINDS:
        # The random victim may have committed one operation it was killed before logging.
        assert logged[kind] <= recorded[kind] <= logged[kind] + 1, (kind, logged, recorded)
    assert sum(recorded.values()) - sum(logged.values()) <= 1, (logged, recorded)
    registered = {(e["model"], e["version"]) for e in run["events"] if e["kind"] == "registered"}
    assert registered <= {(v.model, v.version) for v in versions}  # no registration lost
    for target in registry.aliases():
        for number in registry.alias_stack(target.model, target.alias):
            version = registry.show(target.model, number)
            assert version.status == "promoted"
            verify_version(version)
            assert registry.verify_signature(version, required=True) is not None


def _report(backend: str, run: dict) -> None:
    operations = len(run["events"])
    print(f"\nregistry stress on {backend}: {operations} operations by {DRIVERS} drivers (one SIGKILLed after "
          f"{run['killed_logged']}, one killed holding a write transaction) in {run['seconds']:.1f} s: "
          f"{operations / run['seconds']:.1f} ops/s")


def test_many_drivers_on_postgres(postgres, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    location = postgres.create_database("stress")
    run = stress(location, tmp_path)
    check_invariants(location, run)
    _report("PostgreSQL", run)


def test_many_drivers_on_sqlite(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    location = str(tmp_path / "registry.db")
    run = stress(location, tmp_path)
    check_invariants(location, run)
    _report("SQLite", run)


@pytest.fixture(autouse=True)
def _quiet_signing_key(monkeypatch) -> None:
    for name in ("QUANTGATE_SIGNING_KEY", "QUANTGATE_SIGNING_CERT"):
        monkeypatch.delenv(name, raising=False)
