"""The benchmark harness shared by ``bench_attention.py``, ``bench_models.py``, ``bench_real_model.py`` and
``decode_interleaved.py``.

A benchmark here is a list of *cases* (one thing to measure at one length L), each measured in a **fresh
process** so that one case's allocator state, caches and compiled kernels never leak into the next. The pieces,
in the order a run uses them:

* the worker's environment (:data:`MALLOC_ENV`, :func:`worker_env`: one thread, glibc's malloc kept from
  returning memory to the OS between steps) and its interpreter (:func:`python_for`: transformers 4.57 cases run
  under ``POSENC_HF457_PYTHON``);
* the worker side: :func:`serve_worker` (``<script> worker <spec JSON>`` prints one JSON record), the timed loop
  :func:`timed` (CPU and wall seconds of each call, the process's CPU utilisation, the load average),
  :func:`fwd_and_step` (the forward / training-step measurement both benchmarks make), :func:`spread`, the
  allocator peak :func:`profiled_peak` and the process's RSS (:func:`rss_bytes`,
  :func:`maxrss_bytes`);
* the parent side: :func:`fresh_process` (one worker, its record or the error it died with), the JSON store
  :class:`Store` (one record per key, rewritten after every case: an interrupted run resumes where it stopped)
  and :func:`run_cases` (skip what is done, measure, store, print a line);
* rounds: :func:`round_order` (odd rounds run the cases in reverse, so that a slow spell of a shared machine hits
  different cases in different rounds; ``bench_real_model.py`` runs its cases in one process, in this order);
* the report: :func:`why_not` (the one line saying why a record has no numbers), :func:`write_report`.

What it may import: the standard library only at import time (the transformers-4.57 interpreter imports this file
too), ``torch`` inside the worker-side functions; never ``posenc`` (the cases import posenc, the harness only
measures them).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MAIN_PY = sys.executable
HF457_PY = os.environ.get("POSENC_HF457_PYTHON", "/work/venv-hf457/bin/python")
# glibc's malloc: blocks up to 32 MiB come from the heap rather than fresh mmaps, and the heap is not trimmed
# below 4 GiB, so memory freed by one step is reused by the next instead of going back to the OS and being
# faulted in again; every figure in results/ was measured with these settings
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296"}

Record = dict[str, Any]


# ============================================================================ the worker's environment
def python_for(case: str) -> str:
    """The interpreter of a case: transformers 4.57's environment for the ``hf457`` cases, else this one."""
    return HF457_PY if "hf457" in case else MAIN_PY


def worker_env(threads: int) -> dict[str, str]:
    """The environment of every worker process: the malloc settings, ``threads`` OpenMP threads, posenc from
    this checkout's ``src``, Hugging Face offline and quiet."""
    env = dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    env.pop("POSENC_BENCH_WORKER", None)
    return env


# ============================================================================ the worker side (one fresh process)
def serve_worker(measure: Callable[[dict], Record]) -> bool:
    """In a worker process (``argv = [script, "worker", spec JSON]``): print ``measure(spec)`` as one JSON line
    and return True; anywhere else return False (the script goes on to its command line)."""
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return True
    return False


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    """The process's resident-set high-water mark."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def profiled_peak(fn: Callable[[], object]) -> int:
    """Allocator peak (bytes above the level at entry) while ``fn()`` runs, from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not mem:
        return 0
    totals = [e["args"]["Total Allocated"] for e in mem]
    start = totals[0] - mem[0]["args"]["Bytes"]
    peak = lo = start
    for t in totals:  # frees of tensors allocated before the profile can push the total below the start
        lo = min(lo, t)
        peak = max(peak, t - (lo - start) if lo < start else t)
    return int(peak - start)


@dataclass
class Timings:
    """What :func:`timed` measured: per name, the CPU and wall seconds of each call (in call order)."""

    cpu: dict[str, list[float]] = field(default_factory=dict)
    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu_util: float = 0.0  # process CPU seconds / wall seconds of the whole loop, per thread
    loadavg_1m: list[float] = field(default_factory=list)  # the 1-minute load average before and after the loop

    def summary(self) -> Record:
        """The record fields every worker stores: ``cpu_util`` and ``loadavg_1m``."""
        return {"cpu_util": self.cpu_util, "loadavg_1m": self.loadavg_1m}


def timed(calls: Iterable[tuple[str, Callable[[], object]]], threads: int) -> Timings:
    """Call each ``(name, fn)`` in turn, timing each call with the process's CPU clock and the wall clock.

    Interleave the names in ``calls`` (``fwd, step, fwd, step, ...``) so that a slow spell of the machine hits
    every kind of call alike. With one thread the CPU seconds are what another process on the machine barely
    changes; ``cpu_util`` says how much of a core the loop got.
    """
    out = Timings()
    load0 = os.getloadavg()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    for name, f in calls:
        p0, t0 = time.process_time(), time.perf_counter()
        f()
        out.wall.setdefault(name, []).append(time.perf_counter() - t0)
        out.cpu.setdefault(name, []).append(time.process_time() - p0)
    c1, w1 = time.process_time(), time.perf_counter()
    out.cpu_util = (c1 - c0) / max(w1 - w0, 1e-9) / threads
    out.loadavg_1m = [load0, os.getloadavg()[0]]
    return out


def fwd_and_step(
    fwd: Callable[[], object], step: Callable[[], object], step_name: str, repeats: int, threads: int, again: bool
) -> tuple[int, int, Timings]:
    """The method of both benchmarks for a no-grad forward ``fwd`` and a step with its backward ``step``.

    Each runs once under the profiler (the warm-up, and its allocator peak: :func:`profiled_peak`), once more
    plainly where ``again`` (where that is cheap), then ``repeats`` rounds time them alternately (``fwd``,
    ``step``: :func:`timed`). Returns the step's peak, the forward's peak, and the timings (names ``"fwd"`` and
    ``step_name``).
    """
    peak_step = profiled_peak(step)
    peak_fwd = profiled_peak(fwd)
    if again:
        step()
        fwd()
    calls = ((n, f) for _ in range(repeats) for n, f in (("fwd", fwd), (step_name, step)))
    return peak_step, peak_fwd, timed(calls, threads)


def spread(name: str, xs: list[float]) -> Record:
    """``{name_s: median, name_min_s: min, name_max_s: max}`` of the seconds ``xs``."""
    return {f"{name}_s": statistics.median(xs), f"{name}_min_s": min(xs), f"{name}_max_s": max(xs)}


# ============================================================================ the parent side
def load(path: Path) -> list[Record]:
    """The records of a results file (none if it does not exist yet)."""
    return json.loads(path.read_text()) if path.exists() else []


class Store:
    """A results file: a JSON list of records, at most one per key (``key(record)``, e.g. ``(case, L)``).

    The file is rewritten after every record, so an interrupted run loses at most the case in flight, and a
    second run finds what the first one stored (:meth:`keys`) and skips it.
    """

    def __init__(self, path: Path, key: Callable[[Record], tuple]) -> None:
        self.path, self.key = path, key
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records = load(path)

    def keys(self, failed: bool = True) -> set[tuple]:
        """The keys stored; with ``failed=False`` only those with numbers or a skip note (an error is retried)."""
        return {self.key(r) for r in self.records if failed or "error" not in r}

    def put(self, rec: Record) -> None:
        """Store ``rec``, replacing the record of the same key, and write the file."""
        self.records = [r for r in self.records if self.key(r) != self.key(rec)] + [rec]
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.records, indent=1))


def fresh_process(script: Path, spec: dict, env: dict[str, str], timeout: float) -> tuple[Record, float]:
    """Measure one case in a fresh process: ``<python_for(case)> script worker <spec JSON>``.

    Returns the worker's record (the last line of its output that starts with ``{``) or, where it failed, timed
    out or printed no record, ``{"case", "L", "error"}`` with the end of its output; and the process's wall
    seconds (start-up and imports included).
    """
    case, L = spec["case"], spec["L"]
    cmd = [python_for(case), str(script), "worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode == 0 and lines:
            rec = json.loads(lines[-1])
        else:
            rec = {"case": case, "L": L, "error": (p.stderr or p.stdout)[-1500:] or f"exit {p.returncode}"}
    except subprocess.TimeoutExpired:
        rec = {"case": case, "L": L, "error": f"timeout after {timeout} s"}
    return rec, time.perf_counter() - t0


def run_cases(
    store: Store,
    jobs: Iterable[tuple[tuple, Any]],
    measure: Callable[[Any], Record],
    show: Callable[[Record], str],
    done: set[tuple],
    force: bool = False,
) -> None:
    """For each ``(key, job)`` not in ``done`` (all of them with ``force``): ``measure(job)``, store the record,
    print ``show(record)``. ``done`` is read once, before the run (:meth:`Store.keys`)."""
    for key, job in jobs:
        if key in done and not force:
            continue
        rec = measure(job)
        store.put(rec)
        print(show(rec), flush=True)


def round_order(cases: list, rnd: int) -> list:
    """The cases in the order of round ``rnd``: as given in even rounds, reversed in odd ones (ABCD, DCBA, ...)."""
    return cases if rnd % 2 == 0 else list(reversed(cases))


# ============================================================================ the report
def why_not(rec: Record, width: int) -> str:
    """Why ``rec`` has no numbers: its skip note, or the last line of its error (at most ``width`` characters)."""
    return rec.get("skipped") or (rec["error"].strip().splitlines() or ["?"])[-1][:width]


def write_report(text: str, dest: Path) -> None:
    """Write a Markdown report and print it."""
    dest.write_text(text)
    print(text)


def write_runs(tag: str, args: dict, runs: list[dict], tables: list[str]) -> None:
    """``results/<tag>.json`` (the arguments, the machine, every run) and ``results/<tag>.md`` (the tables), written
    after each run so that an interrupted benchmark keeps what it finished."""
    RESULTS.mkdir(exist_ok=True)
    meta = {"args": args, "machine": os.uname().nodename}
    (RESULTS / f"{tag}.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    (RESULTS / f"{tag}.md").write_text("\n".join(tables))
