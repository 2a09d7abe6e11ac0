"""Where runs execute: this process, a pool of processes, a Ray cluster, or one run across torchrun ranks.

Every executor yields ``(job, record, error)`` as runs finish; the caller (the
parent process, :func:`posenc.bench.runner.run_suite`) writes the store. A
failed run yields its error as text instead of a record (``KeyboardInterrupt``
is never swallowed).

DDP: a task's training loop can use :func:`ddp_wrap` (wraps the model in
:class:`~torch.nn.parallel.DistributedDataParallel` when ``torch.distributed`` is
initialised, else returns it as it is), :func:`shard` (this rank's rows of a
batch) and :func:`mean_over_ranks` (a loss value averaged over ranks). The
shared loop :func:`posenc.bench.training.train_classifier` does; so a
classification task runs under ``torchrun`` unchanged (see :mod:`posenc.bench.ddp`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, PosencError
from .runner import Job, RunConfig

Event = tuple[Job, "dict[str, Any] | None", "str | None"]
OnStep = Callable[[Job, int, float], None]

EXECUTORS = ("auto", "local", "process", "ray", "ddp")


# ---------------------------------------------------------------------------- DDP helpers
def distributed() -> tuple[int, int] | None:
    """``(rank, world_size)`` inside an initialised process group, else ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


_WRAPPED: list[nn.Module] = []


def ddp_wrap(model: nn.Module) -> nn.Module:
    """``DistributedDataParallel(model)`` under torchrun, ``model`` itself otherwise.

    Gradients are averaged over ranks in ``backward``; parameters start equal
    (DDP broadcasts rank 0's). The plain model is remembered (:func:`last_wrapped`)
    so the launcher can check that every rank ends with the same parameters.
    """
    if distributed() is None:
        return model
    _WRAPPED.clear()
    _WRAPPED.append(model)
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def last_wrapped() -> nn.Module | None:
    return _WRAPPED[-1] if _WRAPPED else None


def shard(*tensors: Tensor) -> tuple[Tensor, ...]:
    """This rank's rows (``rank::world``) of each batch tensor; all rows when not distributed.

    Every rank draws the same full batch from the same seeded generator and keeps
    its share, so the averaged gradient is the full batch's gradient (for a batch
    size divisible by the number of ranks) and a run's result does not depend on
    how many processes ran it, up to floating-point summation order.
    """
    d = distributed()
    if d is None:
        return tensors
    rank, world = d
    return tuple(t[rank::world] for t in tensors)


def mean_over_ranks(value: float) -> float:
    d = distributed()
    if d is None:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / d[1]


def parameter_checksum(model: nn.Module) -> float:
    """Sum of |p| · (1 + index) over all parameters (float64): equal models, equal checksums."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        total += p.detach().double().abs().sum() * (1 + i)
    return float(total)


# ---------------------------------------------------------------------------- executors
def describe_error(exc: BaseException) -> str:
    """A failed run as text: the message of a posenc error, a short traceback for anything else."""
    if isinstance(exc, PosencError):
        return f"{type(exc).__name__}: {exc}"
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}\n" + "".join(tb[-4:-1]).rstrip()


def _run_config_dict(cfg: dict[str, Any], threads: int | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Run one config (given as a dict) in a worker; never raises (except KeyboardInterrupt)."""
    from . import runner

    if threads:
        torch.set_num_threads(threads)
    try:
        return runner.run_one(RunConfig.from_dict(cfg)), None
    except Exception as exc:  # noqa: BLE001 -- recorded as a failed run
        return None, describe_error(exc)


class Executor:
    reports_steps = False

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    """One run after the other in this process (progress per training step)."""

    reports_steps = True

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:
        from . import runner

        for job in jobs:

            def tick(step: int, loss: float, job: Job = job) -> None:
                if on_step is not None:
                    on_step(job, step, loss)

            try:
                rec = runner.run_one(job.config, tick)
            except Exception as exc:  # noqa: BLE001 -- recorded as a failed run
                yield job, None, describe_error(exc)
                continue
            yield job, rec, None


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


class ProcessExecutor(Executor):
    """``workers`` processes (spawned, ``cpu_count // workers`` torch threads each)."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.pool: Any = None

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        if not jobs:
            return
        threads = threads_per_worker(self.workers)
        self.pool = ProcessPoolExecutor(
            max_workers=min(self.workers, len(jobs)),
            mp_context=mp.get_context("spawn"),
            initializer=_init_worker,
            initargs=(threads,),
        )
        pending = {self.pool.submit(_run_config_dict, j.config.as_dict()): j for j in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                job = pending.pop(fut)
                try:
                    rec, err = fut.result()
                except Exception as exc:  # noqa: BLE001 -- a worker that died
                    rec, err = None, f"worker process failed: {describe_error(exc)}"
                yield job, rec, err

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


class RayExecutor(Executor):
    """Runs as Ray tasks (1 CPU each) on the cluster at ``address`` (or a local one)."""

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise ConfigError("--executor ray needs Ray: pip install 'posenc[cluster]' (or pip install ray)") from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
            self.started = True

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:
        ray = self.ray
        remote = ray.remote(num_cpus=1)(_run_config_dict)
        pending = {remote.remote(j.config.as_dict(), 1): j for j in jobs}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                job = pending.pop(ref)
                try:
                    rec, err = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 -- a task or node that died
                    rec, err = None, f"ray task failed: {describe_error(exc)}"
                yield job, rec, err

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


class DDPExecutor(Executor):
    """Each run across ``nproc`` processes: ``torchrun --nproc_per_node nproc -m posenc.bench.ddp``."""

    def __init__(self, nproc: int):
        if nproc < 1:
            raise ConfigError(f"--ddp needs a number of processes >= 1, got {nproc}")
        self.nproc = nproc

    def run(self, jobs: Sequence[Job], on_step: OnStep | None = None) -> Iterator[Event]:
        for job in jobs:
            rec, err = run_ddp(job.config, self.nproc)
            yield job, rec, err


def run_ddp(cfg: RunConfig, nproc: int, timeout: float | None = None) -> tuple[dict[str, Any] | None, str | None]:
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
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_worker(nproc))}
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


def make_executor(kind: str, *, workers: int = 1, ray_address: str | None = None, ddp: int = 0) -> Executor:
    if kind not in EXECUTORS:
        raise ConfigError(f"executor must be one of {EXECUTORS}, got {kind!r}")
    if ddp and kind not in ("auto", "ddp"):
        raise ConfigError(f"--ddp runs each job across processes itself; it cannot be combined with --executor {kind}")
    if ddp or kind == "ddp":
        return DDPExecutor(ddp or 2)
    if kind == "ray":
        return RayExecutor(ray_address)
    if kind == "process" or (kind == "auto" and workers > 1):
        return ProcessExecutor(workers)
    return LocalExecutor()
