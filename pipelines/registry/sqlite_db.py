"""The registry in one SQLite file (artifacts/registry.db unless QUANTGATE_REGISTRY or --registry says otherwise).

Every write is one `BEGIN IMMEDIATE` transaction, so concurrent processes serialise on the database lock instead of
losing updates (`lock_model` has nothing left to do); WAL mode lets readers go on while one writes. The schema's version
is PRAGMA user_version; an older file is migrated in place under `BEGIN EXCLUSIVE` when first opened for writing (SQLite
keeps no list of connected writers: the exclusive lock is the guard, and every other writer waits on it).

Reading opens the file read-only (`file:...?mode=ro`), so a registry on a read-only disk, or a file the user may not
write, can still be inspected. A registry that does not exist yet is created by its first write, never by a read.
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pipelines.errors import InputError
from pipelines.registry.database import MIGRATE_1_TO_2, SCHEMA_VERSION, Connection, table_statements

BUSY_TIMEOUT_S = 60.0

SCHEMA = (
    *table_statements(identity="INTEGER PRIMARY KEY AUTOINCREMENT", reference="INTEGER"),
    """CREATE TRIGGER IF NOT EXISTS events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'registry events are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'registry events are append-only'); END""",
)


class _Connection:
    """sqlite3 under the Connection interface: BEGIN IMMEDIATE already holds the one write lock."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self.db.execute(sql, parameters)

    def lock_model(self, model: str) -> None:
        return None


def _writable(path: Path) -> bool:
    """Whether SQLite can write `path`: the file and its folder (journal, WAL and shared-memory files)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _creatable(path: Path) -> bool:
    """Whether the registry file could be made: its nearest existing folder can be written."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


@contextmanager
def empty_registry() -> Iterator[_Connection]:
    """What a reader sees of a registry not created yet: the schema, no rows (in memory: no file is made)."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        for statement in SCHEMA:
            db.execute(statement)
        yield _Connection(db)
    finally:
        db.close()


def _set_wal(db: sqlite3.Connection) -> None:
    """Switch the file to WAL, waiting up to BUSY_TIMEOUT_S. The switch reads and then needs the exclusive lock;
    while another connection holds the write lock SQLite refuses that upgrade at once (SQLITE_BUSY) instead of
    calling the busy handler, to avoid a deadlock: two first opens of a fresh file meet exactly there."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL").fetchone()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SQLiteDatabase:
    def __init__(self, path: Path, field: str = "registry"):
        self.path = path
        self.location = str(path)
        self.field = field
        # SQLite follows a link (and creates -wal/-shm beside its target): the registry is a regular file or nothing.
        if self.path.is_symlink():
            raise InputError("the registry must be a regular file, not a symbolic link", file=self.path, field="registry")
        if self.path.exists() and not self.path.is_file():
            raise InputError("the registry must be a regular file", file=self.path, field="registry")
        # An existing registry the user may not write (read-only disk or permissions) is opened for
        # reading only: list / show / history work, writes say why they cannot.
        exists = self.path.exists()
        self.read_only = not _writable(self.path) if exists else not _creatable(self.path)
        self._schema_ready = False  # this instance has seen the schema in place (created or migrated)
        if self.read_only and exists:
            self._check_readable()
        elif exists:
            self._create_schema()
            self._schema_ready = True

    def transaction(self, *, write: bool) -> Any:
        if write:
            return self._transaction("IMMEDIATE")
        # A file without tables yet is a registry another process is creating this instant: empty, as none at all.
        if not self.path.exists() or (not self._schema_ready and not self._has_tables()):
            return empty_registry()
        return self._transaction("DEFERRED")

    def begin_copy(self, connection: Connection) -> None:
        return None  # BEGIN IMMEDIATE holds the file's one write lock already

    def end_copy(self, connection: Connection) -> None:
        return None  # AUTOINCREMENT continues after the largest id inserted

    def _create(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(f"cannot create the registry's folder ({error.strerror or error})", file=self.path) from None
        self._create_schema()

    def _connect(self, *, read_only: bool = False) -> sqlite3.Connection:
        try:
            db = self._open_read_only() if read_only else sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if not read_only:
                db.execute("PRAGMA foreign_keys = ON")
                db.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as error:
            raise InputError(f"cannot open the registry database ({error})", file=self.path) from None
        return db

    def _open_read_only(self) -> sqlite3.Connection:
        """`mode=ro`. A WAL file in a folder nobody may write has no shared-memory file and cannot be
        created one; then `immutable=1` (safe there: no writer can be at work in that folder either)."""
        if not self.path.is_file():
            raise sqlite3.OperationalError("no such file")
        uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
        db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            db.close()
            if not self.read_only:
                raise
        return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)

    @contextmanager
    def _transaction(self, mode: Literal["IMMEDIATE", "DEFERRED", "EXCLUSIVE"]) -> Iterator[_Connection]:
        """One transaction. IMMEDIATE takes the write lock at BEGIN, so read-then-write cannot race;
        DEFERRED (readers, on a read-only connection) gives one consistent snapshot across several SELECTs."""
        if mode != "DEFERRED" and self.read_only:
            raise InputError(
                "the registry is read-only here (the file or its folder cannot be written): it can be listed, not changed",
                file=self.path,
            )
        if mode != "DEFERRED" and not self._schema_ready:
            # The first write creates the file and its schema (in a transaction of its own); a file another process is
            # creating right now is waited for under its write lock, never written before its tables exist.
            self._schema_ready = True  # before: creating the schema is itself a write through here
            try:
                self._create()
            except BaseException:
                self._schema_ready = False
                raise
        db = self._connect(read_only=mode == "DEFERRED")
        try:
            db.execute(f"BEGIN {mode}")
            try:
                yield _Connection(db)
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.DatabaseError as error:
            raise InputError(f"registry database error ({error})", file=self.path) from None
        finally:
            db.close()

    def _has_tables(self) -> bool:
        db = self._connect(read_only=True)
        try:
            return db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'versions'").fetchone()[0] > 0
        except sqlite3.DatabaseError:
            return False
        finally:
            db.close()

    def _check_readable(self) -> None:
        db = self._connect(read_only=True)
        try:
            found = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as error:
            raise InputError(f"not a registry database ({error})", file=self.path) from None
        finally:
            db.close()
        if found > SCHEMA_VERSION:
            raise InputError(f"registry schema {found} is newer than this quantgate's ({SCHEMA_VERSION})", file=self.path)
        if not {"versions", "aliases", "events"} <= tables:
            raise InputError("not a registry database (no versions, aliases and events tables)", file=self.path)

    def _create_schema(self) -> None:
        db = self._connect()
        try:
            # WAL is a property of the file, kept once set: readers never wait for a writer.
            _set_wal(db)
            found = db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as error:
            raise InputError(f"not a registry database ({error})", file=self.path) from None
        finally:
            db.close()
        if found == SCHEMA_VERSION:
            return
        if found > SCHEMA_VERSION:
            raise InputError(f"registry schema {found} is newer than this quantgate's ({SCHEMA_VERSION})", file=self.path)
        with self._transaction("EXCLUSIVE") as connection:
            # Read again under the write lock: another process may have created or migrated it meanwhile.
            found = connection.execute("PRAGMA user_version").fetchone()[0]
            if found == 1:
                for statement in MIGRATE_1_TO_2:
                    connection.execute(statement)
            elif found == 0:  # CREATE ... IF NOT EXISTS: concurrent first opens are safe
                for statement in SCHEMA:
                    connection.execute(statement)
            connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
