"""Run a suite: train a small model per (task, encoding, seed), test it on longer lengths, keep every result.

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

This module ties the harness together and is the only one that does: the jobs (:mod:`.types`, :mod:`.suites`),
the store and its claims (:mod:`.store`), the executors (:mod:`.executors`) and the live board (:mod:`.live`).
:func:`run_suite` reads as its steps: plan the jobs left to run, choose the executor, then a :class:`_SuiteRun`
hands jobs out, takes finished runs in, stores them, and gives back the results. It imports everything below it
and nothing above it (not the reports, not the CLI). ``RunConfig``, ``Job``, ``run_one`` and the labels are
re-exported from where they live (:mod:`.types`, :mod:`.api`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PosencError
from .api import load_tasks, run_one, unimportable_tasks, worker_imports
from .store import ACTIVE_TAGS, Claims, SQLiteStore, StoreLockedError, new_owner, open_store
from .suites import Suite, load_suite
from .types import MODELS, Job, RunConfig, default_label, label_of  # noqa: F401 -- re-exported

if TYPE_CHECKING:
    from .executors import Executor
    from .live import LiveBoard


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
    if on_error not in ("continue", "stop"):
        raise ConfigError(f"on_error must be 'continue' or 'stop', got {on_error!r}")
    if imports:
        load_tasks(*imports)
    jobs, suite = as_jobs(suite_or_configs)
    out = Path(out) if out is not None else Path("posenc-results") / (suite.name if suite else "runs")
    st = open_store(store if store is not None else out / "results.sqlite")
    say = log or (lambda s: print(s, flush=True))
    started = time.time()
    todo = _left_to_run(jobs, st, resume, say)
    ex = _executor(todo, executor, workers=workers, ray_address=ray_address, ddp=ddp)
    board = _board(jobs, st, ex, progress=progress, live=progress if live is None else live, fresh=not resume)
    run = _SuiteRun(jobs, todo, st, ex, board, say=say, started=started, resume=resume, on_error=on_error, lease=lease)
    run.run(wait_for_others=wait_for_others)
    return run.results(suite)


def _left_to_run(jobs: list[Job], st: SQLiteStore, resume: bool, say: Callable[[str], None]) -> list[Job]:
    """The jobs not in the store yet (all of them when not resuming); says how many are finished already."""
    done = st.keys() if resume else set()
    todo = [j for j in jobs if j.key not in done]
    if len(todo) < len(jobs):  # said even when quiet: it explains why nothing (or less) runs
        say(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} runs already finished in {st.path}")
    return todo


def _executor(todo: list[Job], kind: str, *, workers: int, ray_address: str | None, ddp: int) -> Executor:
    """The executor for ``todo``; one that starts other processes only for tasks they can import."""
    from .executors import make_executor  # torch: imported when a suite runs, not with this module

    task_names = sorted({j.config.task for j in todo})
    local_only = kind == "local" or (kind == "auto" and workers <= 1 and not ddp)
    if not local_only and (bad := unimportable_tasks(task_names)):
        raise ConfigError(
            f"task(s) {bad} are defined in a notebook or an interactive session, which worker processes cannot "
            "import: put them in a .py file and pass imports=['that_file.py'] (posenc bench --import), "
            "or run with workers=1"
        )
    return make_executor(
        kind, workers=workers, ray_address=ray_address, ddp=ddp, imports=worker_imports(task_names), run=run_one
    )


def _board(jobs: list[Job], st: SQLiteStore, ex: Executor, *, progress: bool, live: bool, fresh: bool) -> LiveBoard:
    """The progress bar and live leaderboard of the suite (:class:`~posenc.bench.live.LiveBoard`)."""
    from .live import LiveBoard  # tqdm: imported when a suite runs

    return LiveBoard(
        jobs,
        st,
        progress=progress,
        live=live,
        per_step=ex.reports_steps,
        workers=getattr(ex, "workers", 1),  # runs in parallel (1 for local, torchrun and Ray: gaps measure rate)
        fresh=fresh,
    )


class _SuiteRun:
    """One call of :func:`run_suite`: its claims, scheduler, writer, live board and failures, and the loop that
    hands jobs to the executor and finished runs to the store (see the module docstring)."""

    def __init__(
        self,
        jobs: list[Job],
        todo: list[Job],
        st: SQLiteStore,
        ex: Executor,
        board: LiveBoard,
        *,
        say: Callable[[str], None],
        started: float,
        resume: bool,
        on_error: str,
        lease: float,
    ) -> None:
        self.jobs, self.st, self.ex, self.board, self.say, self.on_error = jobs, st, ex, board, say, on_error
        self.owner = new_owner()
        ACTIVE_TAGS.add(self.owner["tag"])
        self.claims = Claims(st.path, lease=lease, owner=self.owner)
        self.poll = min(1.0, max(0.05, lease / 20))
        self.sched = _Scheduler(todo, st, self.claims, t0=started, fresh=not resume, poll=self.poll)
        self.writer = _Writer(st, self.claims, self.owner, say)
        self.intr = _HeldInterrupts()
        ex.interruptible = self.intr.allow
        self.failures: list[dict[str, Any]] = []
        self.left_to_others: dict[str, tuple[Job, dict[str, Any]]] = {}
        self._waited_note = 0.0

    # ---- the loop
    def run(self, *, wait_for_others: bool) -> None:
        """Every job to its end (here or in another process), every finished run into the store; then close."""
        interrupted = True
        try:
            self.intr.__enter__()
            while self._round(wait_for_others):
                pass
            self._drain_writes()
            self.intr.check()
            interrupted = False
        finally:
            self._close(interrupted)
        self._after()

    def _round(self, wait_for_others: bool) -> bool:
        """Submit what may start, note what others finished, take what finished here; False when all is done."""
        self.intr.check()
        self.writer.flush()
        while self.ex.busy < self.ex.capacity and (job := self.sched.next()) is not None:
            self.ex.submit(job, self.board.on_step)
        for job, rec, err in self.sched.take_elsewhere():
            if err is None:
                assert rec is not None
                self.board.finished(job, rec, elsewhere=True)
            else:
                self._failed(job, err, here=False)
        if self.ex.busy == 0:
            return self._idle(wait_for_others)
        for job, record, error in self.ex.wait(timeout=self.poll):
            if error is None:
                assert record is not None
                record = {**record, "label": job.label, "suite": job.suite}
                self.writer.add_run(job, record)
                self.board.finished(job, record)
            else:
                self.writer.add_failure(job, error)
                self._failed(job, error, here=True)
        return True

    def _idle(self, wait_for_others: bool) -> bool:
        """Nothing runs here: done, or leave the rest to the others, or wait for them (saying so once a minute)."""
        sched = self.sched
        if not sched.queue and not sched.others:
            return False
        if not sched.queue and not wait_for_others:
            self.left_to_others = dict(sched.others)
            return False
        if sched.others and time.monotonic() - self._waited_note > 60:
            self._waited_note = time.monotonic()
            titles = ", ".join(j.title for j, _ in list(sched.others.values())[:5])
            more = f" and {len(sched.others) - 5} more" if len(sched.others) > 5 else ""
            self.board.note(
                f"waiting for {len(sched.others)} run(s) that another process is training "
                f"({_owners(sched.others)}): {titles}{more}"
            )
        due = self.writer.next_due()
        with self.intr.allow():
            time.sleep(self.poll if due is None else max(0.01, min(self.poll, due - time.monotonic())))
        return True

    def _failed(self, job: Job, error: str, here: bool) -> None:
        self.failures.append({"key": job.key, "label": job.label, "config": job.config.as_dict(), "error": error})
        self.board.failed(job, error if here else f"(in another process) {error}")
        if self.on_error == "stop" and here:
            raise RunFailedError(
                f"run {job.title} failed: {error}\n(finished runs are kept in {self.st.path}; "
                "pass --on-error continue to record failures and go on)"
            )

    def _drain_writes(self) -> None:
        """The last runs may wait for a locked store: as long as the store's own timeout, then keep them aside."""
        writer = self.writer
        deadline = time.monotonic() + self.st.timeout
        while writer.queue and time.monotonic() < deadline:
            due = writer.next_due() or time.monotonic()
            with self.intr.allow():
                time.sleep(max(0.0, min(due, deadline) - time.monotonic()))
            writer.flush(force=time.monotonic() >= deadline)

    def _close(self, interrupted: bool) -> None:
        self.intr.__exit__()
        self.board.close()
        self.ex.close(kill=interrupted)
        if interrupted:
            try:  # one last quick try for runs that finished; the rest stay in the pending file
                self.writer.flush(force=True)
            except Exception:  # noqa: BLE001 -- the original error is the one to see
                pass
        self.claims.close(keep=self.writer.unwritten())
        ACTIVE_TAGS.discard(self.owner["tag"])

    def _after(self) -> None:
        """Runs that could not be stored are an error; runs left to other processes are listed."""
        st, writer = self.st, self.writer
        if writer.queue:
            raise StoreLockedError(
                f"the results store {st.path} stayed locked by another process (waited {st.timeout:g} s after the "
                f"last run). The {len(writer.unwritten())} run(s) that had finished are kept in {writer.pending} and "
                "go into the store the next time it is opened: nothing finished was lost"
            )
        if self.left_to_others:
            titles = ", ".join(j.title for j, _ in self.left_to_others.values())
            self.say(
                f"{len(self.left_to_others)} run(s) are being trained by another process "
                f"({_owners(self.left_to_others)}): {titles}; they go into {st.path} when they finish (run the same "
                "command again to see them)"
            )

    def results(self, suite: Suite | None) -> SuiteResults:
        """The stored runs of the jobs, in suite order, with the failures and where they are stored."""
        stored = self.st.load()
        res = SuiteResults({**stored[j.key], "label": j.label} for j in self.jobs if j.key in stored)
        res.failures = self.failures
        res.store_path = self.st.path
        res.suite = suite
        return res
