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
* :meth:`SQLiteStore.export_jsonl` writes the runs (with the time each finished) and the
  failures as text, sorted by key, for committing (``docs/results/data``);
  :meth:`SQLiteStore.import_jsonl` reads that file back.

* Two processes on one store share the work: a process *claims* a run
  (:class:`Claims`: a file ``<store>.claims/<key>.<n>.claim`` naming its owner's
  host and pid, kept fresh by a heartbeat) before training it. Another process
  skips a claimed run, and takes it over when the lease expires (the owner's pid
  is gone, or its heartbeat is older than the lease).
* A finished run that cannot be written because another process holds the write
  lock is appended to a pending file of its own process
  (``<store>.pending-<host>-<pid>-<tag>.jsonl``) and written when the lock is free;
  the pending files of processes that are gone are imported when the store is opened.

Nothing here deletes a finished run. A corrupt or locked file is a
:class:`StoreError` that says what to do; the file is never rewritten.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import PosencError

SQLITE_MAGIC = b"SQLite format 3\x00"
#: the keys :meth:`SQLiteStore.export_jsonl` adds to a line: when a run was stored; that a line is a failure
FINISHED_AT = "finished_at"
FAILED = "failed"
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


HOST = socket.gethostname()
#: owner tags of the run_suite calls going on in this process (their pending files are not orphans)
ACTIVE_TAGS: set[str] = set()


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from /proc (Linux), or None where there is no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie does not; a reused pid with another
    start time is another process)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    st = _proc_stat(pid)
    if st is not None:
        if st[0] in ("Z", "X"):
            return False
        if start is not None and st[1] != start:
            return False
    return True


def new_owner() -> dict[str, Any]:
    """Who claims runs: this host and process, and a tag for one suite of it."""
    pid = os.getpid()
    st = _proc_stat(pid)
    return {"host": HOST, "pid": pid, "pid_start": st[1] if st else None, "tag": uuid.uuid4().hex[:8]}


class Claims:
    """Leases on runs, one file per claim in ``<store>.claims/`` (see the module docstring).

    A claim of ``key`` is the file ``<key>.<n>.claim`` with the highest ``n``, created
    atomically (a hard link of a complete file, which fails if the name exists): of two
    processes that take over an expired claim ``n``, exactly one creates ``n + 1``. The
    owner touches its files every ``lease / 6`` seconds; a claim is expired when its
    owner's pid is gone (same host) or its file was not touched for ``lease`` seconds.
    """

    def __init__(self, store_path: str | Path, *, lease: float = 60.0, owner: dict[str, Any] | None = None):
        self.store_path = Path(store_path)
        self.dir = self.store_path.with_name(self.store_path.name + ".claims")
        self.lease = float(lease)
        self.owner = owner or new_owner()
        self.mine: dict[str, Path] = {}
        self.lost: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading ------------------------------------------------------------------
    def _files(self, key: str) -> list[tuple[int, Path]]:
        out = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith(key + ".") and name.endswith(".claim"):
                mid = name[len(key) + 1 : -len(".claim")]
                if mid.isdigit():
                    out.append((int(mid), self.dir / name))
        return sorted(out)

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _is_mine(self, info: dict[str, Any] | None) -> bool:
        return info is not None and all(info.get(k) == self.owner[k] for k in ("host", "pid", "tag"))

    def alive(self, info: dict[str, Any] | None, path: Path) -> bool:
        """Whether the claim in ``path`` (its content ``info``) still holds."""
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return False
        if info is not None and info.get("host") == HOST and not pid_alive(int(info["pid"]), info.get("pid_start")):
            return False
        return age < self.lease

    def holder(self, key: str) -> dict[str, Any] | None:
        """The owner of a live claim of ``key`` by another suite, or None (free, expired or ours)."""
        files = self._files(key)
        if not files:
            return None
        info = self._read(files[-1][1])
        if self._is_mine(info) or not self.alive(info, files[-1][1]):
            return None
        return info or {"host": "?", "pid": "?"}

    # -- claiming -----------------------------------------------------------------
    def try_claim(self, key: str, title: str = "") -> dict[str, Any] | None:
        """Claim ``key``: None when it is ours now, else the owner of the live claim that holds it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(8):
            files = self._files(key)
            gen = 0
            if files:
                n, path = files[-1]
                info = self._read(path)
                if self._is_mine(info):
                    return None
                if self.alive(info, path):
                    return info or {"host": "?", "pid": "?"}
                gen = n + 1
            path = self.dir / f"{key}.{gen}.claim"
            tmp = self.dir / f".{key}.{self.owner['tag']}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({**self.owner, "key": key, "title": title, "claimed_at": time.time()}))
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            finally:
                tmp.unlink(missing_ok=True)
            for _n, old in files:  # expired claims it replaces
                old.unlink(missing_ok=True)
            with self._lock:
                self.mine[key] = path
                self.lost.discard(key)
            self._start()
            return None
        return {"host": "?", "pid": "?"}

    def release(self, key: str) -> None:
        with self._lock:
            path = self.mine.pop(key, None)
        if path is not None and self._is_mine(self._read(path)):
            path.unlink(missing_ok=True)

    def release_all(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        for key in list(self.mine):
            if key not in keep:
                self.release(key)

    # -- heartbeat ----------------------------------------------------------------
    def beat(self) -> None:
        """Touch every claim of ours; one that is gone or taken over is noted in :attr:`lost`."""
        with self._lock:
            items = list(self.mine.items())
        for key, path in items:
            files = self._files(key)
            if not files or files[-1][1] != path:
                self.lost.add(key)
                continue
            try:
                os.utime(path)
            except FileNotFoundError:
                self.lost.add(key)

    def _start(self) -> None:
        if self._thread is not None:
            return
        period = max(0.05, self.lease / 6)

        def loop() -> None:
            while not self._stop.wait(period):
                try:
                    self.beat()
                except OSError:
                    pass

        self._thread = threading.Thread(target=loop, name="posenc-claims-heartbeat", daemon=True)
        self._thread.start()

    def close(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Stop the heartbeat; release every claim but those in ``keep`` (they expire with the lease)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.release_all(keep)
        try:
            self.dir.rmdir()  # when empty
        except OSError:
            pass


class SQLiteStore:
    """Finished runs in an SQLite file (see the module docstring).

    ``timeout`` is how long a write waits for another writer before giving up
    with a :class:`StoreLockedError`.
    """

    def __init__(self, path: str | Path, *, timeout: float = 30.0, migrate: bool = True):
        self.path = Path(path)
        self.timeout = float(timeout)
        if self.path.is_dir():
            raise StoreError(_folder_message(self.path))
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
        try:  # finished runs that could not be written last time (another process may hold the lock now)
            self.import_pending()
        except StoreLockedError:
            pass

    @property
    def pending_path(self) -> Path:
        """Where a finished run goes when the store cannot take it (imported at the next open)."""
        return self.path.with_name(self.path.name + ".pending.jsonl")

    def pending_path_of(self, owner: dict[str, Any]) -> Path:
        """The pending file of one suite (``owner`` from :func:`new_owner`)."""
        return self.path.with_name(f"{self.path.name}.pending-{owner['host']}-{owner['pid']}-{owner['tag']}.jsonl")

    def orphaned_pending(self, stale_after: float = 600.0) -> list[Path]:
        """Pending files nobody will write to the store any more: the old single file, and those of
        suites that are over (this host: the pid is gone, or its suite ended; another host: the
        file is older than ``stale_after`` seconds)."""
        out = [self.pending_path] if self.pending_path.exists() else []
        prefix = self.path.name + ".pending-"
        for p in self.path.parent.glob(prefix + "*.jsonl"):
            parts = p.name[len(prefix) : -len(".jsonl")].rsplit("-", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            host, pid, tag = parts[0], int(parts[1]), parts[2]
            if host == HOST:
                gone = not pid_alive(pid) or (pid == os.getpid() and tag not in ACTIVE_TAGS)
            else:
                try:
                    gone = time.time() - p.stat().st_mtime > stale_after
                except FileNotFoundError:
                    continue
            if gone:
                out.append(p)
        return out

    def import_pending(self) -> int:
        """Import (then delete) the orphaned pending files; return how many runs were new."""
        n = 0
        for p in self.orphaned_pending():
            try:
                n += self.import_jsonl(p)
            except FileNotFoundError:  # imported by another process meanwhile
                continue
            p.unlink(missing_ok=True)
        return n

    def keep_pending(self, record: dict[str, Any], owner: dict[str, Any]) -> Path:
        """Append a finished run to this suite's pending file (fsync'd); return the file."""
        path = self.pending_path_of(owner)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return path

    def try_add(self, record: dict[str, Any], wait: float = 1.0) -> bool:
        """:meth:`add`, waiting at most ``wait`` seconds for another writer: False if the store stayed locked."""
        try:
            self.add(record, wait=wait)
        except StoreLockedError:
            return False
        return True

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
    def _write(self, wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it is stored, or none of it (``wait``: seconds for the lock)."""
        with self._errors():
            conn = self.connection
            if wait is not None:
                conn.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
            try:
                conn.execute("BEGIN IMMEDIATE")
            finally:
                if wait is not None:
                    conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # -- writing ------------------------------------------------------------------
    def add(self, record: dict[str, Any], *, replace: bool = True, wait: float | None = None) -> None:
        """Store one finished run (and forget an earlier failure of the same config)."""
        cfg = record["config"]
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._write(wait) as conn:
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

    def add_failure(
        self, key: str, config: dict[str, Any], error: str, label: str | None = None, *, wait: float | None = None
    ) -> None:
        with self._write(wait) as conn:
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
        """Add records not yet stored (one transaction); return how many were new.

        A record with a ``finished_at`` (as :meth:`export_records` writes them) is stored as finished at
        that time, and without that key (as it was before the export)."""
        before = len(self)
        with self._write() as conn:
            for rec in records:
                rec = dict(rec)
                finished = rec.pop(FINISHED_AT, None)
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
                        time.time() if finished is None else float(finished),
                        json.dumps(rec),
                    ),
                )
        return len(self) - before

    def import_failures(self, failures: Iterable[dict[str, Any]]) -> int:
        """Add failures (as :meth:`failures` gives them) of runs neither stored nor failed yet; return how many."""
        n = 0
        with self._write() as conn:
            for f in failures:
                cfg = f["config"]
                if conn.execute("SELECT 1 FROM runs WHERE key = ?", (f["key"],)).fetchone() is not None:
                    continue
                cur = conn.execute(
                    "INSERT OR IGNORE INTO failures (key, task, encoding, seed, label, failed_at, error, config) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (
                        f["key"],
                        cfg["task"],
                        cfg["encoding"],
                        int(cfg["seed"]),
                        f.get("label"),
                        float(f.get("failed_at") or time.time()),
                        str(f["error"]),
                        json.dumps(cfg),
                    ),
                )
                n += cur.rowcount
        return n

    def import_jsonl(self, path: str | Path) -> int:
        """Import the finished runs of an old ``results.jsonl``, or of a file :meth:`export_jsonl` wrote
        (its failures too), and return how many runs were new. A cut-short last line is skipped."""
        path = Path(path)
        records = []
        failed = []
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
            if rec.get(FAILED) is True:
                failed.append({k: v for k, v in rec.items() if k != FAILED})
            else:
                records.append(rec)
        n = self.import_records(records)
        if failed:
            self.import_failures(failed)
        return n

    def export_records(self, keys: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The lines of :meth:`export_jsonl`: every finished run (its record with ``finished_at``, the Unix time
        it was stored), then every failure (``failed: true``, with ``error`` and ``failed_at``), each sorted by
        key. ``keys``: only these runs and failures."""
        want = None if keys is None else set(keys)
        with self._errors():
            runs = self.connection.execute("SELECT key, finished_at, payload FROM runs ORDER BY key").fetchall()
        out = [{**json.loads(p), FINISHED_AT: float(t)} for k, t, p in runs if want is None or k in want]
        fails = sorted(self.failures(), key=lambda f: f["key"])
        out += [{**f, FAILED: True} for f in fails if want is None or f["key"] in want]
        return out

    def export_jsonl(self, path: str | Path, keys: Iterable[str] | None = None) -> int:
        """Write :meth:`export_records` to ``path``, one JSON object a line (the same text for the same store);
        return how many lines. :meth:`import_jsonl` reads it back, times included."""
        return write_jsonl(path, self.export_records(keys))

    # -- reading ------------------------------------------------------------------
    def __len__(self) -> int:
        with self._errors():
            return int(self.connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def __contains__(self, key: object) -> bool:
        with self._errors():
            return self.connection.execute("SELECT 1 FROM runs WHERE key = ?", (key,)).fetchone() is not None

    def keys(self, since: float | None = None) -> set[str]:
        """The keys of the finished runs (``since``: only those finished at or after that time)."""
        with self._errors():
            if since is None:
                return {r[0] for r in self.connection.execute("SELECT key FROM runs")}
            return {r[0] for r in self.connection.execute("SELECT key FROM runs WHERE finished_at >= ?", (since,))}

    def finished_at(self, key: str) -> float | None:
        with self._errors():
            row = self.connection.execute("SELECT finished_at FROM runs WHERE key = ?", (key,)).fetchone()
        return None if row is None else float(row[0])

    def failure(self, key: str) -> dict[str, Any] | None:
        """The recorded failure of ``key`` (``error``, ``failed_at``), or None."""
        with self._errors():
            row = self.connection.execute("SELECT error, failed_at FROM failures WHERE key = ?", (key,)).fetchone()
        return None if row is None else {"error": row[0], "failed_at": float(row[1])}

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


def write_jsonl(path: str | Path, lines: Iterable[dict[str, Any]]) -> int:
    """Write ``lines`` to ``path`` (folders made), one JSON object a line, in the order given; return how many."""
    lines = list(lines)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in lines), encoding="utf-8")
    return len(lines)


def _folder_message(path: Path) -> str:
    """What to say of a results store path that exists as a folder (not a SQLite file)."""
    if path.suffix:  # a file's name (results.sqlite) taken by a folder: nothing to read there
        return (
            f"the results store {path} exists as a folder, not a SQLite file; remove or rename that folder, or give "
            f"another file path (--store {path.parent / ('other' + path.suffix)})"
        )
    return f"the results store {path} is a folder; give a file path such as {path / 'results.sqlite'}"


def open_store(store: str | Path | SQLiteStore, **kw: Any) -> SQLiteStore:
    """A store object from a path (a folder means ``<folder>/results.sqlite``) or a store."""
    if isinstance(store, SQLiteStore):
        return store
    p = Path(store)
    if p.is_dir() and p.suffix in (".sqlite", ".sqlite3", ".db"):  # a store's file name, taken by a folder
        raise StoreError(_folder_message(p))
    if p.is_dir() or (not p.suffix and not p.exists()):
        p = p / "results.sqlite"
    return SQLiteStore(p, **kw)
