"""Where runs execute: this process, a pool of processes, a Ray cluster, or one run across torchrun ranks.

An executor takes jobs one at a time (:meth:`Executor.submit`, up to
:attr:`Executor.capacity` at once) and hands back ``(job, record, error)`` as runs
finish (:meth:`Executor.wait`); the caller (the parent process,
:func:`posenc.bench.runner.run_suite`) claims each job before submitting it and
writes the store. A failed run gives its error as text instead of a record
(``KeyboardInterrupt`` is never swallowed).

Worker processes (``--workers``) end when their parent ends, however it ends
(``PR_SET_PDEATHSIG`` on Linux, and a thread that watches the parent's pid
everywhere); a worker that dies is replaced, and its run is tried once more
before it is recorded as failed. Every worker, Ray task and torchrun rank first
imports the task modules of the parent (:func:`posenc.bench.api.worker_imports`).

DDP: the helpers a task's training loop uses under ``torchrun`` (:func:`ddp_wrap`,
:func:`shard`, :func:`mean_over_ranks`) live in :mod:`posenc.bench.distributed`, below
the training loops; they are re-exported here, where they were first documented.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .api import describe_error, prepare_process, run_one
from .distributed import (  # noqa: F401 -- re-exported: a task's own loop imports them from here (docs/tasks.md)
    ddp_wrap,
    distributed,
    last_wrapped,
    mean_over_ranks,
    parameter_checksum,
    shard,
)
from .types import Job, RunConfig

Event = tuple[Job, "dict[str, Any] | None", "str | None"]
OnStep = Callable[[Job, int, float], None]

EXECUTORS = ("auto", "local", "process", "ray", "ddp")


# ---------------------------------------------------------------------------- executors
def _run_config_dict(
    cfg: dict[str, Any],
    threads: int | None = None,
    imports: Sequence[str] = (),
    sys_path: Sequence[str] = (),
) -> tuple[dict[str, Any] | None, str | None]:
    """Run one config (given as a dict) in a worker; never raises (except KeyboardInterrupt)."""
    if threads:
        torch.set_num_threads(threads)
    try:
        prepare_process(imports, sys_path)
        return run_one(RunConfig.from_dict(cfg)), None
    except Exception as exc:  # noqa: BLE001 -- recorded as a failed run
        return None, describe_error(exc)


def parent_sys_path() -> list[str]:
    """This process's ``sys.path`` folders, for a Ray task or torchrun rank to find the same modules."""
    return [p for p in sys.path if p and os.path.isdir(p)]


class Executor:
    """Runs jobs: :meth:`submit` (at most :attr:`capacity` in flight), :meth:`wait` for finished ones.

    :attr:`interruptible` wraps the waiting and the training only: a Ctrl-C that arrives while a
    finished run is handed over is held back until the caller has stored it (see ``run_suite``).
    """

    reports_steps = False
    capacity = 1

    def __init__(self) -> None:
        self._queue: list[tuple[Job, OnStep | None]] = []
        self.interruptible: Callable[[], Any] = contextlib.nullcontext

    def submit(self, job: Job, on_step: OnStep | None = None) -> None:
        self._queue.append((job, on_step))

    @property
    def busy(self) -> int:
        """Jobs submitted and not yet handed back."""
        return len(self._queue)

    def wait(self, timeout: float | None = None) -> list[Event]:
        """Finished jobs (at least one unless ``timeout`` passed or nothing is in flight)."""
        out = []
        while self._queue:
            job, on_step = self._queue.pop(0)
            out.append(self._run(job, on_step))
        return out

    def _run(self, job: Job, on_step: OnStep | None) -> Event:  # pragma: no cover
        raise NotImplementedError

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:
        """Every job, as it finishes (no claims: for a caller that owns the jobs)."""
        todo = list(jobs)
        while todo or self.busy:
            while todo and self.busy < self.capacity:
                self.submit(todo.pop(0), on_step)
            yield from self.wait(1.0)

    def close(self, kill: bool = False) -> None:
        """Stop (``kill``: do not wait for runs in flight)."""


#: what trains one config in this process: ``run_one(cfg, on_step)`` -> the run's record
RunOne = Callable[[RunConfig, "Callable[[int, float], None] | None"], "dict[str, Any]"]


class LocalExecutor(Executor):
    """One run after the other in this process (progress per training step).

    ``run_one`` trains a config (default :func:`posenc.bench.api.run_one`); the runner passes the one it
    names, which a caller (a test) may wrap.
    """

    reports_steps = True

    def __init__(self, run_one: RunOne = run_one) -> None:
        super().__init__()
        self.run_one = run_one

    def _run(self, job: Job, on_step: OnStep | None) -> Event:
        def tick(step: int, loss: float) -> None:
            if on_step is not None:
                on_step(job, step, loss)

        try:
            with self.interruptible():
                rec = self.run_one(job.config, tick)
        except Exception as exc:  # noqa: BLE001 -- recorded as a failed run
            return job, None, describe_error(exc)
        return job, rec, None


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, poll: float = 0.5) -> None:
    """End this process when ``parent_pid`` ends: PR_SET_PDEATHSIG (Linux) and a watchdog thread."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent ended before the line above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="posenc-parent-watchdog", daemon=True).start()


def _worker_main(conn: Any, threads: int, parent_pid: int, imports: list[str], sys_path: list[str]) -> None:
    """A worker process: run the configs the parent sends until it sends None or goes away."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    setup_error = None
    try:
        prepare_process(imports, sys_path)
    except Exception as exc:  # noqa: BLE001 -- reported with every run
        setup_error = f"the worker process could not import the task modules: {describe_error(exc)}"
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        jid, cfg = msg
        rec, err = (None, setup_error) if setup_error else _run_config_dict(cfg)
        try:
            conn.send((jid, rec, err))
        except OSError:
            return


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    def __init__(self, proc: Any, conn: Any):
        self.proc, self.conn = proc, conn
        self.job: Job | None = None
        self.jid = 0


class ProcessExecutor(Executor):
    """``workers`` spawned processes (``cpu_count // workers`` torch threads each).

    A worker that dies (killed, out of memory) is replaced and its run submitted again;
    a run whose worker dies ``retries + 1`` times is a failed run. Workers end with the parent.
    """

    def __init__(self, workers: int, imports: Sequence[str] = (), retries: int = 1):
        super().__init__()
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.capacity = workers
        self.imports = list(imports)
        self.retries = retries
        self.pool: list[_Worker] = []
        self.deaths: dict[str, list[str]] = {}
        self._jid = 0

    @property
    def busy(self) -> int:
        return sum(w.job is not None for w in self.pool)

    def _spawn(self) -> _Worker:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main,
            args=(child, threads_per_worker(self.workers), os.getpid(), self.imports, parent_sys_path()),
            daemon=True,
            name="posenc-bench-worker",
        )
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        self.pool.append(w)
        return w

    def submit(self, job: Job, on_step: OnStep | None = None) -> None:
        for w in [w for w in self.pool if w.job is None and not w.proc.is_alive()]:
            self._drop(w)  # died while idle
        idle = [w for w in self.pool if w.job is None]
        w = idle[0] if idle else self._spawn()
        self._jid += 1
        w.job, w.jid = job, self._jid
        try:
            w.conn.send((w.jid, job.config.as_dict()))
        except OSError:  # it died while idle: the sentinel reports it in wait()
            pass

    def _drop(self, w: _Worker) -> None:
        self.pool.remove(w)
        try:
            w.conn.close()
        except OSError:
            pass
        w.proc.join(timeout=1)

    def wait(self, timeout: float | None = None) -> list[Event]:
        from multiprocessing.connection import wait as mp_wait

        busy = [w for w in self.pool if w.job is not None]
        if not busy:
            return []
        handles: dict[Any, _Worker] = {}
        for w in busy:
            handles[w.conn] = w
            handles[w.proc.sentinel] = w
        with self.interruptible():
            ready = mp_wait(list(handles), timeout)
        out: list[Event] = []
        for w in dict.fromkeys(handles[r] for r in ready):
            job = w.job
            if job is None:
                continue
            try:
                if w.conn.poll():
                    jid, rec, err = w.conn.recv()
                    if jid == w.jid:
                        w.job = None
                        out.append((job, rec, err))
                        continue
            except (EOFError, OSError):
                pass
            if w.proc.is_alive():
                continue
            # the worker died with the job
            w.proc.join(timeout=1)
            w.job = None
            self._drop(w)
            deaths = self.deaths.setdefault(job.key, [])
            deaths.append(_exit_text(w.proc.exitcode))
            if len(deaths) <= self.retries:
                self.submit(job)
            else:
                why = (
                    "out of memory, or killed from outside"
                    if all(d.startswith("killed") for d in deaths)
                    else "it exited before returning a result: see its output above"
                )
                out.append(
                    (
                        job,
                        None,
                        f"worker process failed: the worker running it died {len(deaths)} times "
                        f"({', '.join(deaths)}); {why}",
                    )
                )
        return out

    def close(self, kill: bool = False) -> None:
        for w in self.pool:
            if kill or w.job is not None:
                w.proc.terminate()
            else:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for w in self.pool:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=1)
            try:
                w.conn.close()
            except OSError:
                pass
        self.pool = []


def _ray_error(address: str, exc: BaseException) -> ConfigError:
    what = (
        f"no Ray cluster was found at --ray-address {address}"
        if isinstance(exc, ConnectionError) or "could not find any running ray" in str(exc).lower()
        else f"could not join the Ray cluster at --ray-address {address} ({str(exc).strip().splitlines()[0]})"
    )
    return ConfigError(
        f"{what}: start one with `ray start --head` (then --ray-address auto), omit --ray-address to start "
        "a local one, or use --workers N for processes on this machine"
    )


class RayExecutor(Executor):
    """Runs as Ray tasks (1 CPU each) on the cluster at ``address`` (or a local one)."""

    def __init__(self, address: str | None = None, imports: Sequence[str] = ()):
        super().__init__()
        try:
            import ray
        except ImportError:
            raise ConfigError("--executor ray needs Ray: pip install 'posenc[cluster]' (or pip install ray)") from None
        self.ray = ray
        self.started = False
        self.imports = list(imports)
        if not ray.is_initialized():
            try:
                ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
            except Exception as exc:  # noqa: BLE001 -- ConnectionError, or a RuntimeError of a bad address
                if address is None:
                    raise
                raise _ray_error(address, exc) from None
            self.started = True
        try:
            cpus = int(ray.cluster_resources().get("CPU", 1))
        except Exception:  # noqa: BLE001
            cpus = 1
        self.capacity = max(1, cpus)
        self.pending: dict[Any, Job] = {}
        self.remote = ray.remote(num_cpus=1)(_run_config_dict)

    @property
    def busy(self) -> int:
        return len(self.pending)

    def submit(self, job: Job, on_step: OnStep | None = None) -> None:
        ref = self.remote.remote(job.config.as_dict(), 1, self.imports, parent_sys_path())
        self.pending[ref] = job

    def wait(self, timeout: float | None = None) -> list[Event]:
        if not self.pending:
            return []
        with self.interruptible():
            ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        out: list[Event] = []
        for ref in ready:
            job = self.pending.pop(ref)
            try:
                rec, err = self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001 -- a task or node that died
                rec, err = None, f"ray task failed: {describe_error(exc)}"
            out.append((job, rec, err))
        return out

    def close(self, kill: bool = False) -> None:
        for ref in list(self.pending):
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001
                pass
        self.pending.clear()
        if self.started:
            self.ray.shutdown()
            self.started = False


class DDPExecutor(Executor):
    """Each run across ``nproc`` processes: ``torchrun --nproc_per_node nproc -m posenc.bench.ddp``."""

    def __init__(self, nproc: int, imports: Sequence[str] = ()):
        super().__init__()
        if nproc < 1:
            raise ConfigError(f"--ddp needs a number of processes >= 1, got {nproc}")
        self.nproc = nproc
        self.imports = list(imports)

    def _run(self, job: Job, on_step: OnStep | None) -> Event:
        with self.interruptible():
            rec, err = run_ddp(job.config, self.nproc, imports=self.imports)
        return job, rec, err


def run_ddp(
    cfg: RunConfig, nproc: int, timeout: float | None = None, imports: Sequence[str] = ()
) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``cfg`` under torchrun with ``nproc`` CPU processes (gloo); return rank 0's record or the error."""
    with tempfile.TemporaryDirectory(prefix="posenc-ddp-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(cfg.as_dict()))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "posenc.bench.ddp",
            "--config",
            str(cfg_path),
            "--result-json",
            str(out_path),
        ]
        for spec in imports:
            cmd += ["--import", spec]
        path = os.pathsep.join([*parent_sys_path(), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_worker(nproc)), "PYTHONPATH": path}
        failures: list[str] = []
        # A gloo rank on a loaded CPU machine was seen to abort (SIGABRT) now and then, before or after the
        # result was written: a finished result is kept (the exit code is recorded), and a run that left
        # none is tried once more. A failure that repeats is reported.
        for _attempt in range(2):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            if out_path.exists():
                data = json.loads(out_path.read_text())
                record = data.get("record")
                if record is not None and (proc.returncode != 0 or failures):
                    extra = record.setdefault("extra", {})
                    extra["torchrun_exit_code"] = proc.returncode
                    extra["torchrun_failed_attempts"] = failures
                return record, data.get("error")
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            failures.append(f"torchrun exited with {proc.returncode}:\n{tail}")
        return None, failures[-1]


def make_executor(
    kind: str,
    *,
    workers: int = 1,
    ray_address: str | None = None,
    ddp: int = 0,
    imports: Sequence[str] = (),
    run: RunOne = run_one,
) -> Executor:
    """The executor ``kind`` names; ``imports``: task modules every worker imports first.

    ``run`` trains a config in this process (the local executor); workers, Ray tasks and torchrun ranks
    use :func:`posenc.bench.api.run_one`.
    """
    if kind not in EXECUTORS:
        raise ConfigError(f"executor must be one of {EXECUTORS}, got {kind!r}")
    if ddp and kind not in ("auto", "ddp"):
        raise ConfigError(f"--ddp runs each job across processes itself; it cannot be combined with --executor {kind}")
    if ddp or kind == "ddp":
        return DDPExecutor(ddp or 2, imports)
    if kind == "ray":
        return RayExecutor(ray_address, imports)
    if kind == "process" or (kind == "auto" and workers > 1):
        return ProcessExecutor(workers, imports)
    return LocalExecutor(run)
