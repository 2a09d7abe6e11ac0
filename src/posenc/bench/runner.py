"""Train a small model per (task, encoding, seed), test it on longer lengths, keep every result.

Every run is a pure function of its :class:`RunConfig` (the seed fixes the data
and the initialisation). Finished runs go to an SQLite store
(:mod:`posenc.bench.store`, default ``<out>/results.sqlite``) as soon as they
finish, one transaction each, written by this (the parent) process only; an
interrupted suite loses nothing it had finished and, started again, skips
exactly the runs already stored.

Several processes may run suites on one store at once: each claims a run
(:class:`posenc.bench.store.Claims`) before training it, skips runs that another
live process has claimed, takes over those whose owner died, and at the end
waits for the runs others are still training. A store that is locked when a run
finishes does not stop the suite: the run is kept in a pending file and written
when the lock is free, while the other runs go on.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PosencError
from .api import run_one  # noqa: F401 -- re-exported (and the seam tests replace)
from .types import MODELS, Job, RunConfig, default_label, label_of  # noqa: F401 -- re-exported

if TYPE_CHECKING:
    from .store import SQLiteStore
    from .suites import Suite


class RunFailedError(PosencError):
    """A run raised an error and the suite was asked to stop (``on_error="stop"``)."""


class ResultStore:
    """The JSON-lines file of the first ``posenc bench`` (read for migration; see :mod:`.store`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        out: dict[str, dict[str, Any]] = {}
        lines = self.path.read_text().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                # the last line may be cut short by an interruption: every earlier run is kept
                if lineno != len(lines):
                    raise ConfigError(
                        f"{self.path} line {lineno} is corrupt ({exc}); move the file away to start afresh"
                    ) from None
        return out

    def add(self, record: dict[str, Any]) -> None:
        if self.path.exists():
            text = self.path.read_bytes()
            if text and not text.endswith(b"\n"):
                with self.path.open("r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


class SuiteResults(list):
    """The finished runs of a suite (a list of records, in suite order) with ``failures`` and ``store``."""

    failures: list[dict[str, Any]]
    store_path: Path | None
    suite: Suite | None


def as_jobs(suite_or_configs: Suite | str | Path | Sequence[RunConfig | Job]) -> tuple[list[Job], Suite | None]:
    """Jobs from a suite, a suite name or file, or a list of configs / jobs."""
    from .suites import Suite, load_suite

    if isinstance(suite_or_configs, str | Path):
        suite_or_configs = load_suite(suite_or_configs)
    if isinstance(suite_or_configs, Suite):
        return suite_or_configs.jobs(), suite_or_configs
    jobs = [j if isinstance(j, Job) else Job(j) for j in suite_or_configs]
    for j in jobs:
        if not isinstance(j.config, RunConfig):
            raise ConfigError(f"run_suite takes a suite, a suite name or RunConfigs, got {type(j.config).__name__}")
    return jobs, None


class _Writer:
    """Writes finished runs; a run the locked store cannot take now is kept in a pending file and retried
    (with backoff) while the suite goes on. A claim is released once its run is in the store."""

    def __init__(self, store: SQLiteStore, claims: Any, owner: dict[str, Any], say: Callable[[str], None]):
        self.store, self.claims, self.owner, self.say = store, claims, owner, say
        self.queue: list[dict[str, Any]] = []  # {"kind", "job", "record"/"error", "due", "delay"}
        self.pending: Path | None = None
        self.wait = min(1.0, store.timeout)

    def _try(self, item: dict[str, Any]) -> bool:
        job = item["job"]
        if item["kind"] == "run":
            ok = self.store.try_add(item["record"], wait=self.wait)
        else:
            from .store import StoreLockedError

            try:
                self.store.add_failure(job.key, job.config.as_dict(), item["error"], job.label, wait=self.wait)
                ok = True
            except StoreLockedError:
                ok = False
        if ok:
            self.claims.release(job.key)
        return ok

    def add_run(self, job: Job, record: dict[str, Any]) -> None:
        self._add({"kind": "run", "job": job, "record": record})

    def add_failure(self, job: Job, error: str) -> None:
        self._add({"kind": "failure", "job": job, "error": error})

    def _add(self, item: dict[str, Any]) -> None:
        if not self.queue and self._try(item):
            return
        if item["kind"] == "run":
            self.pending = self.store.keep_pending(item["record"], self.owner)
        if not self.queue:
            self.say(
                f"the results store {self.store.path} is locked by another process; finished runs are kept in "
                f"{self.pending or 'memory'} and written as soon as it is free (the other runs go on)"
            )
        item.update(due=time.monotonic() + 0.5, delay=0.5)
        self.queue.append(item)

    def flush(self, force: bool = False) -> None:
        """Write the queued runs whose retry is due (``force``: all of them, now)."""
        now = time.monotonic()
        for item in list(self.queue):
            if not force and item["due"] > now:
                continue
            if self._try(item):
                self.queue.remove(item)
            else:
                item["delay"] = min(10.0, item["delay"] * 2)
                item["due"] = time.monotonic() + item["delay"]
                break  # still locked: no use trying the rest now
        if not self.queue and self.pending is not None:
            self.pending.unlink(missing_ok=True)
            self.pending = None
            self.say(f"the results store {self.store.path} is free again: every finished run is stored")

    def next_due(self) -> float | None:
        return min((i["due"] for i in self.queue), default=None)

    def unwritten(self) -> set[str]:
        return {i["job"].key for i in self.queue if i["kind"] == "run"}


class _Scheduler:
    """Hands out the jobs this process may train: not stored, and claimed by it (see the module docstring)."""

    def __init__(self, todo: Sequence[Job], store: SQLiteStore, claims: Any, *, t0: float, fresh: bool, poll: float):
        self.queue = deque(todo)
        self.store, self.claims, self.poll = store, claims, poll
        self.t0 = t0  # failures (and, when fresh, runs) stored since then by others count as done here
        self.since = t0 if fresh else None
        self.others: dict[str, tuple[Job, dict[str, Any]]] = {}
        self.elsewhere: list[tuple[Job, dict[str, Any] | None, str | None]] = []  # finished by others
        self._next_check = 0.0

    def _outcome(self, job: Job) -> bool:
        """Whether ``job`` was finished (or failed) by another process: noted in :attr:`elsewhere`."""
        if self.since is None:
            rec = self.store.get(job.key)
        else:
            t = self.store.finished_at(job.key)
            rec = self.store.get(job.key) if t is not None and t >= self.since else None
        if rec is not None:
            self.elsewhere.append((job, rec, None))
            return True
        fail = self.store.failure(job.key)
        if fail is not None and fail["failed_at"] >= self.t0:
            self.elsewhere.append((job, None, fail["error"]))
            return True
        return False

    def next(self) -> Job | None:
        """A job claimed by this process, or None when none can start now."""
        while self.queue:
            job = self.queue.popleft()
            holder = self.claims.try_claim(job.key, job.title)
            if holder is not None:
                self.others[job.key] = (job, holder)
                continue
            if self._outcome(job):  # finished by another process before we claimed it
                self.claims.release(job.key)
                continue
            return job
        if not self.others or time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + self.poll
        for key, (job, _info) in list(self.others.items()):
            if self._outcome(job):
                del self.others[key]
                continue
            holder = self.claims.holder(key)
            if holder is not None:
                self.others[key] = (job, holder)
                continue
            self.store.import_pending()  # a dead owner's finished runs, if it left any
            if self._outcome(job):
                del self.others[key]
                continue
            holder = self.claims.try_claim(key, job.title)
            if holder is None:
                del self.others[key]
                if self._outcome(job):
                    self.claims.release(key)
                    continue
                return job
            self.others[key] = (job, holder)
        return None

    def take_elsewhere(self) -> list[tuple[Job, dict[str, Any] | None, str | None]]:
        out, self.elsewhere = self.elsewhere, []
        return out


class _HeldInterrupts:
    """SIGINT raises KeyboardInterrupt only inside :meth:`allow` (waiting, training); elsewhere (a finished
    run on its way to the store) it is held and raised at the next :meth:`check`. Only in the main thread."""

    def __init__(self) -> None:
        self.open = False
        self.held = False
        self.previous: Any = None

    def __enter__(self) -> _HeldInterrupts:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
            signal.default_int_handler
        ):
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.open:
            raise KeyboardInterrupt
        self.held = True

    def allow(self) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def cm() -> Any:
            if self.held:
                raise KeyboardInterrupt
            self.open = True
            try:
                yield
            finally:
                self.open = False

        return cm()

    def check(self) -> None:
        if self.held:
            raise KeyboardInterrupt


def _owners(others: dict[str, tuple[Job, dict[str, Any]]]) -> str:
    who = sorted({f"pid {i.get('pid', '?')} on {i.get('host', '?')}" for _, i in others.values()})
    return ", ".join(who)


def run_suite(
    suite_or_configs: Suite | str | Path | Sequence[RunConfig | Job],
    out: str | Path | None = None,
    *,
    store: str | Path | SQLiteStore | None = None,
    workers: int = 1,
    executor: str = "auto",
    progress: bool = True,
    live: bool | None = None,
    resume: bool = True,
    on_error: str = "continue",
    ray_address: str | None = None,
    ddp: int = 0,
    log: Callable[[str], None] | None = None,
    imports: Sequence[str | Path] = (),
    wait_for_others: bool = True,
    lease: float = 60.0,
) -> SuiteResults:
    """Run every job of a suite not already in the store; return the finished ones in suite order.

    ``suite_or_configs``: a :class:`~posenc.bench.suites.Suite`, a built-in suite name
    (``"quick"``), a suite file, or a list of :class:`RunConfig`. ``out`` is the output
    folder (default ``posenc-results/<suite>``), ``store`` the SQLite file (default
    ``<out>/results.sqlite``). ``executor`` is ``"local"`` (this process), ``"process"``
    (``workers`` processes), ``"ray"`` (a Ray cluster; ``ray_address`` or a local one)
    or ``"auto"`` (``process`` when ``workers > 1``). ``ddp=N`` runs each job across N
    processes with torchrun (DDP, gloo). ``resume=False`` runs finished jobs again
    (their rows are replaced only when the new run finishes). ``on_error="continue"``
    records a failed run (e.g. a missing data package) and goes on; ``"stop"`` raises
    :class:`RunFailedError` after recording it. Results are written by this process only.

    ``imports``: task modules (names or ``.py`` paths) to import here and in every
    worker (:func:`posenc.bench.api.load_tasks`; those loaded before are passed on too).
    Another process running jobs of the same store: each run is trained by one of them
    (claims with a lease of ``lease`` seconds); ``wait_for_others=False`` returns without
    waiting for the runs the others are training (they are listed).
    """
    from .api import load_tasks, unimportable_tasks, worker_imports
    from .executors import make_executor
    from .live import LiveBoard
    from .store import ACTIVE_TAGS, Claims, StoreLockedError, new_owner, open_store

    if on_error not in ("continue", "stop"):
        raise ConfigError(f"on_error must be 'continue' or 'stop', got {on_error!r}")
    if imports:
        load_tasks(*imports)
    jobs, suite = as_jobs(suite_or_configs)
    if out is None:
        out = Path("posenc-results") / (suite.name if suite else "runs")
    out = Path(out)
    st = open_store(store if store is not None else out / "results.sqlite")
    say = log or (lambda s: print(s, flush=True))
    t_start = time.time()
    done = st.keys() if resume else set()
    todo = [j for j in jobs if j.key not in done]
    if len(todo) < len(jobs):  # said even when quiet: it explains why nothing (or less) runs
        say(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} runs already finished in {st.path}")
    task_names = sorted({j.config.task for j in todo})
    local_only = executor == "local" or (executor == "auto" and workers <= 1 and not ddp)
    if not local_only and (bad := unimportable_tasks(task_names)):
        raise ConfigError(
            f"task(s) {bad} are defined in a notebook or an interactive session, which worker processes cannot "
            "import: put them in a .py file and pass imports=['that_file.py'] (posenc bench --import), "
            "or run with workers=1"
        )
    ex = make_executor(executor, workers=workers, ray_address=ray_address, ddp=ddp, imports=worker_imports(task_names))
    owner = new_owner()
    ACTIVE_TAGS.add(owner["tag"])
    claims = Claims(st.path, lease=lease, owner=owner)
    poll = min(1.0, max(0.05, lease / 20))
    sched = _Scheduler(todo, st, claims, t0=t_start, fresh=not resume, poll=poll)
    writer = _Writer(st, claims, owner, say)
    board = LiveBoard(
        jobs,
        st,
        progress=progress,
        live=progress if live is None else live,
        per_step=ex.reports_steps,
        workers=getattr(ex, "workers", 1),  # runs in parallel (1 for local, torchrun and Ray: gaps measure rate)
        fresh=not resume,
    )
    intr = _HeldInterrupts()
    ex.interruptible = intr.allow
    failures: list[dict[str, Any]] = []
    waited_note = 0.0
    left_to_others: dict[str, tuple[Job, dict[str, Any]]] = {}
    interrupted = True

    def failed(job: Job, error: str, here: bool) -> None:
        failures.append({"key": job.key, "label": job.label, "config": job.config.as_dict(), "error": error})
        board.failed(job, error if here else f"(in another process) {error}")
        if on_error == "stop" and here:
            raise RunFailedError(
                f"run {job.title} failed: {error}\n(finished runs are kept in {st.path}; "
                "pass --on-error continue to record failures and go on)"
            )

    try:
        intr.__enter__()
        while True:
            intr.check()
            writer.flush()
            while ex.busy < ex.capacity and (job := sched.next()) is not None:
                ex.submit(job, board.on_step)
            for job, rec, err in sched.take_elsewhere():
                if err is None:
                    assert rec is not None
                    board.finished(job, rec, elsewhere=True)
                else:
                    failed(job, err, here=False)
            if ex.busy == 0:
                if not sched.queue and not sched.others:
                    break
                if not sched.queue and not wait_for_others:
                    left_to_others = dict(sched.others)
                    break
                if sched.others and time.monotonic() - waited_note > 60:
                    waited_note = time.monotonic()
                    titles = ", ".join(j.title for j, _ in list(sched.others.values())[:5])
                    more = f" and {len(sched.others) - 5} more" if len(sched.others) > 5 else ""
                    board.note(
                        f"waiting for {len(sched.others)} run(s) that another process is training "
                        f"({_owners(sched.others)}): {titles}{more}"
                    )
                due = writer.next_due()
                with intr.allow():
                    time.sleep(poll if due is None else max(0.01, min(poll, due - time.monotonic())))
                continue
            for job, record, error in ex.wait(timeout=poll):
                if error is None:
                    assert record is not None
                    record = {**record, "label": job.label, "suite": job.suite}
                    writer.add_run(job, record)
                    board.finished(job, record)
                else:
                    writer.add_failure(job, error)
                    failed(job, error, here=True)
        # the last runs may wait for a locked store: as long as the store's own timeout, then keep them aside
        deadline = time.monotonic() + st.timeout
        while writer.queue and time.monotonic() < deadline:
            due = writer.next_due() or time.monotonic()
            with intr.allow():
                time.sleep(max(0.0, min(due, deadline) - time.monotonic()))
            writer.flush(force=time.monotonic() >= deadline)
        intr.check()
        interrupted = False
    finally:
        intr.__exit__()
        board.close()
        ex.close(kill=interrupted)
        if interrupted:
            try:  # one last quick try for runs that finished; the rest stay in the pending file
                writer.flush(force=True)
            except Exception:  # noqa: BLE001 -- the original error is the one to see
                pass
        claims.close(keep=writer.unwritten())
        ACTIVE_TAGS.discard(owner["tag"])
    if writer.queue:
        raise StoreLockedError(
            f"the results store {st.path} stayed locked by another process (waited {st.timeout:g} s after the last "
            f"run). The {len(writer.unwritten())} run(s) that had finished are kept in {writer.pending} and go into "
            "the store the next time it is opened: nothing finished was lost"
        )
    if left_to_others:
        titles = ", ".join(j.title for j, _ in left_to_others.values())
        say(
            f"{len(left_to_others)} run(s) are being trained by another process ({_owners(left_to_others)}): "
            f"{titles}; they go into {st.path} when they finish (run the same command again to see them)"
        )
    stored = st.load()
    res = SuiteResults({**stored[j.key], "label": j.label} for j in jobs if j.key in stored)
    res.failures = failures
    res.store_path = st.path
    res.suite = suite
    return res
