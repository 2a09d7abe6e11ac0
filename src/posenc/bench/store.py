"""The results store of ``posenc bench``: one SQLite file, one row per finished run.

* A row is keyed by :meth:`RunConfig.key` and holds the run's whole record as JSON.
* A run is written in one transaction, only once it has finished: an interrupted
  suite loses nothing it had finished, and started again it skips exactly those
  runs (the key is the primary key, so nothing is ever counted twice).
* The file uses SQLite's write-ahead log, so a report can read while a suite writes.
* Failed runs (e.g. a data package that is not installed) are kept in a table of
  their own; they do not count as finished and are tried again next time.
* A ``results.jsonl`` left by an older posenc beside the store is imported once
  (rows already in the store win); the old file is left as it was.

Nothing here deletes a finished run. A corrupt or locked file is a
:class:`StoreError` that says what to do; the file is never rewritten.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import PosencError

SQLITE_MAGIC = b"SQLite format 3\x00"
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    encoding TEXT NOT NULL,
    seed INTEGER NOT NULL,
    label TEXT,
    finished_at REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS failures (
    key TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    encoding TEXT NOT NULL,
    seed INTEGER NOT NULL,
    label TEXT,
    failed_at REAL NOT NULL,
    error TEXT NOT NULL,
    config TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
"""


class StoreError(PosencError):
    """The results store cannot be used (corrupt, locked, not writable)."""


class StoreCorruptError(StoreError):
    pass


class StoreLockedError(StoreError):
    pass


def _corrupt(path: Path, detail: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"the results store {path} is not a readable SQLite database ({detail}). Nothing was changed in it. "
        f"Move it away (e.g. `mv {path} {path}.bad`) to start a new store, or pass --store PATH to use another file; "
        f"`sqlite3 {path} .recover` may rescue the rows of a damaged file"
    )


def _locked(path: Path, timeout: float) -> StoreLockedError:
    return StoreLockedError(
        f"the results store {path} is locked by another process (waited {timeout:g} s): another `posenc bench` "
        "writing to the same file, or an open sqlite3 shell with a transaction. Wait for it to finish, or pass "
        "--store PATH (a different file) to run beside it. Nothing stored was lost"
    )


class SQLiteStore:
    """Finished runs in an SQLite file (see the module docstring).

    ``timeout`` is how long a write waits for another writer before giving up
    with a :class:`StoreLockedError`.
    """

    def __init__(self, path: str | Path, *, timeout: float = 30.0, migrate: bool = True):
        self.path = Path(path)
        self.timeout = float(timeout)
        if self.path.is_dir():
            raise StoreError(
                f"the results store {self.path} is a folder; give a file path such as {self.path}/results.sqlite"
            )
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                head = f.read(len(SQLITE_MAGIC))
            if head != SQLITE_MAGIC:
                raise _corrupt(self.path, "the file does not start with the SQLite header")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the folder of the results store {self.path}: {exc}") from None
        self._conn: sqlite3.Connection | None = None
        with self._errors():
            conn = self.connection
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)
            row = conn.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise _corrupt(self.path, f"integrity check: {row[0] if row else 'no answer'}")
        if migrate:
            legacy = self.path.parent / "results.jsonl"
            if legacy.exists():
                self.import_jsonl(legacy)
        if self.pending_path.exists():  # finished runs that could not be written last time
            self.import_jsonl(self.pending_path)
            self.pending_path.unlink()

    @property
    def pending_path(self) -> Path:
        """Where a finished run goes when the store cannot take it (imported at the next open)."""
        return self.path.with_name(self.path.name + ".pending.jsonl")

    def add_or_keep(self, record: dict[str, Any]) -> None:
        """:meth:`add`; if the store is locked or unwritable, keep the run in :attr:`pending_path` and re-raise."""
        try:
            self.add(record)
        except StoreError as exc:
            with self.pending_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            raise type(exc)(
                f"{exc}. The run that had just finished is kept in {self.pending_path} "
                "and goes into the store the next time it is opened"
            ) from None

    # -- plumbing -----------------------------------------------------------------
    @property
    def connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            self._conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            msg = str(exc).lower()
            if "locked" in msg or "busy" in msg:
                raise _locked(self.path, self.timeout) from None
            if "readonly" in msg or "read-only" in msg or "unable to open" in msg:
                raise StoreError(f"cannot write the results store {self.path}: {exc}; pass --store PATH") from None
            if "malformed" in msg or "not a database" in msg:
                raise _corrupt(self.path, str(exc)) from None
            raise StoreError(f"results store {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it is stored, or none of it."""
        with self._errors():
            conn = self.connection
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # -- writing ------------------------------------------------------------------
    def add(self, record: dict[str, Any], *, replace: bool = True) -> None:
        """Store one finished run (and forget an earlier failure of the same config)."""
        cfg = record["config"]
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._write() as conn:
            conn.execute(
                f"{verb} INTO runs (key, task, encoding, seed, label, finished_at, payload) VALUES (?,?,?,?,?,?,?)",
                (
                    record["key"],
                    cfg["task"],
                    cfg["encoding"],
                    int(cfg["seed"]),
                    record.get("label"),
                    time.time(),
                    json.dumps(record),
                ),
            )
            conn.execute("DELETE FROM failures WHERE key = ?", (record["key"],))

    def add_failure(self, key: str, config: dict[str, Any], error: str, label: str | None = None) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO failures (key, task, encoding, seed, label, failed_at, error, config) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (
                    key,
                    config["task"],
                    config["encoding"],
                    int(config["seed"]),
                    label,
                    time.time(),
                    error,
                    json.dumps(config),
                ),
            )

    def import_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Add records not yet stored (one transaction); return how many were new."""
        before = len(self)
        with self._write() as conn:
            for rec in records:
                cfg = rec["config"]
                conn.execute(
                    "INSERT OR IGNORE INTO runs (key, task, encoding, seed, label, finished_at, payload) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (
                        rec["key"],
                        cfg["task"],
                        cfg["encoding"],
                        int(cfg["seed"]),
                        rec.get("label"),
                        time.time(),
                        json.dumps(rec),
                    ),
                )
        return len(self) - before

    def import_jsonl(self, path: str | Path) -> int:
        """Import the finished runs of an old ``results.jsonl`` (a cut-short last line is skipped)."""
        path = Path(path)
        records = []
        lines = path.read_text().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rec["key"], rec["config"]["task"]  # noqa: B018 -- both must be there
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                if lineno == len(lines):  # cut short by an interruption: it was never a finished run
                    continue
                raise StoreCorruptError(
                    f"{path} line {lineno} is corrupt ({exc}); the SQLite store {self.path} was not changed. "
                    f"Fix or move away {path} (its finished runs are imported into the store when it reads cleanly)"
                ) from None
            records.append(rec)
        return self.import_records(records)

    # -- reading ------------------------------------------------------------------
    def __len__(self) -> int:
        with self._errors():
            return int(self.connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def __contains__(self, key: object) -> bool:
        with self._errors():
            return self.connection.execute("SELECT 1 FROM runs WHERE key = ?", (key,)).fetchone() is not None

    def keys(self) -> set[str]:
        with self._errors():
            return {r[0] for r in self.connection.execute("SELECT key FROM runs")}

    def get(self, key: str) -> dict[str, Any] | None:
        with self._errors():
            row = self.connection.execute("SELECT payload FROM runs WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def load(self) -> dict[str, dict[str, Any]]:
        """Every finished run, by key (in the order they finished)."""
        with self._errors():
            rows = self.connection.execute("SELECT key, payload FROM runs ORDER BY finished_at, key").fetchall()
        return {k: json.loads(p) for k, p in rows}

    def results(self, *, task: str | None = None, encoding: str | None = None) -> list[dict[str, Any]]:
        recs = list(self.load().values())
        return [
            r
            for r in recs
            if (task is None or r["config"]["task"] == task)
            and (encoding is None or r["config"]["encoding"] == encoding)
        ]

    def failures(self) -> list[dict[str, Any]]:
        with self._errors():
            rows = self.connection.execute(
                "SELECT key, label, error, config, failed_at FROM failures ORDER BY failed_at"
            ).fetchall()
        return [
            {"key": k, "label": lab, "error": e, "config": json.loads(c), "failed_at": t} for k, lab, e, c, t in rows
        ]


def open_store(store: str | Path | SQLiteStore, **kw: Any) -> SQLiteStore:
    """A store object from a path (a folder means ``<folder>/results.sqlite``) or a store."""
    if isinstance(store, SQLiteStore):
        return store
    p = Path(store)
    if p.is_dir() or (not p.suffix and not p.exists()):
        p = p / "results.sqlite"
    return SQLiteStore(p, **kw)
