"""Progress of a running suite: a tqdm bar and a live leaderboard, one plain line per finished run.

Readable in a terminal and in CI logs alike. In a terminal, a tqdm bar is redrawn in
place; when the output is not a terminal (a file, a pipe, CI) there is no bar and no
carriage return, only the lines. Every finished run prints one line with its result and
the current leaders of its task (mean over the seeds finished so far), e.g.::

    [ 7/24] order/rope/seed0  L=16 99.6  L=32 97.3  L=64 88.1  (11.2 s)  | order: rope 92.7 > t5 90.1 > learned 71.0

and, without a bar, the time left: ``ETA 0:02:48`` prices each run left by its estimated work
(:func:`work`: the multiply-adds of its training and evaluation, by its steps, batch, lengths, layers and
width, plus a per-step overhead) times the measured seconds per unit of work of the finished runs of its
task, else of every finished run (recent runs weigh more: a machine whose load changes is followed); the
first run, which also paid for the suite's start (imports, data, workers), counts only until another has
finished. The sum is divided by the runs that go in parallel (``workers``).
A run that did not learn its task in distribution (at chance: :func:`posenc.bench.outcomes.run_learned`)
says so at the end of its line. A control of the suite (``[controls]``: at chance by design, :attr:`Job.control
<posenc.bench.types.Job.control>`) is not warned about while at chance (its line says it is, as designed); a
control that is *not* at chance gets a note.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .outcomes import ranking_labels, run_learned
from .types import Job, label_of

_POSENC_PREFIXES = ("DataUnavailableError", "ConfigError", "PositionError", "UnknownNameError", "PosencError")


def _fmt(v: Any, metric: str) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if metric in ("accuracy", "f1", "sequence_accuracy") else f"{v:.2f}"


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LiveBoard:
    """Progress bar (steps when runs report them, else runs) plus one summary line per finished run.

    ``stream``: where the lines (and the bar) go; default: lines on stdout, failures and the bar
    on stderr. The bar is drawn only when that stream is a terminal; otherwise each line ends with
    an ETA. ``workers``: how many runs go in parallel (for the ETA). ``clock``: the time source.
    """

    def __init__(
        self,
        jobs: Sequence[Job],
        store: Any,
        *,
        progress: bool,
        live: bool,
        per_step: bool,
        workers: int = 1,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        fresh: bool = False,
    ):
        self.jobs = list(jobs)
        self.live = live
        self.per_step = per_step
        self.stream = stream
        self.workers = max(1, int(workers))
        self.clock = clock
        self.t0 = clock()
        self.finish_times: list[float] = []
        self.durations: list[float] = []
        # each finished run of ours: (task, seconds, work, whether it started with the suite: paid its start too)
        self.measured: list[tuple[str, float, float, bool]] = []
        self.left: dict[str, Job] = {}
        done = set() if fresh else store.keys()
        self.todo = [j for j in self.jobs if j.key not in done]
        self.left = {j.key: j for j in self.todo}
        self.n_done = 0
        self.steps_seen: dict[str, int] = {}
        self.total = len(self.todo)
        keys = {j.key for j in self.jobs}
        # results so far (stored runs of this suite count from the start)
        self.scores: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.higher: dict[str, bool] = {}
        for key, rec in store.load().items() if keys & done else ():
            if key in keys:
                self._score(rec)
        self.bar = None
        bar_stream = stream if stream is not None else sys.stderr
        if progress and self.todo and _is_terminal(bar_stream):
            from tqdm.auto import tqdm

            total = sum(j.config.steps for j in self.todo) if per_step else len(self.todo)
            self.bar = tqdm(
                total=total,
                unit="step" if per_step else "run",
                dynamic_ncols=True,
                mininterval=0.5,
                file=bar_stream,
            )

    def _score(self, rec: dict[str, Any]) -> float | None:
        """Mean of the metric over lengths beyond training (else all lengths) of one run; a task's ranking
        labels only where it has some (text classification: "test", not "valid"), as the report ranks."""
        cfg = rec["config"]
        train_max = cfg["train_lengths"][1]
        vals = {k: v for k, v in rec["metrics"].items() if not k.endswith("_error")}
        ranked = ranking_labels(cfg, vals)
        beyond = [v for k, v in vals.items() if k.isdigit() and int(k) > train_max]
        pool = [vals[k] for k in ranked] if ranked else beyond or [v for v in vals.values() if v is not None]
        hib = rec.get("higher_is_better", True)
        if not pool:
            return None
        worst = 0.0 if hib else float("inf")
        score = statistics.fmean(worst if v is None else float(v) for v in pool)
        self.scores[cfg["task"]][label_of(rec)].append(score)
        self.higher[cfg["task"]] = hib
        return score

    def leaders(self, task: str, n: int = 3) -> str:
        rows = [(statistics.fmean(v), lab) for lab, v in self.scores[task].items() if v]
        hib = self.higher.get(task, True)
        rows.sort(key=lambda r: -r[0] if hib else r[0])
        metric_pct = hib and all(0 <= m <= 1 for m, _ in rows)
        return " > ".join(f"{lab} {100 * m:.1f}" if metric_pct else f"{lab} {m:.2f}" for m, lab in rows[:n])

    def write(self, line: str, err: bool = False) -> None:
        out = self.stream if self.stream is not None else (sys.stderr if err else sys.stdout)
        if self.bar is not None:
            self.bar.write(line, file=out)
        elif self.live or err:
            print(line, file=out, flush=True)

    def rate(self, task: str) -> float:
        """Measured seconds per unit of :func:`work`: the finished runs of ``task`` (else every finished run) pooled,
        Σ seconds / Σ work, each weighted by how recent it is (half the weight every ``HALF_LIFE`` runs). The runs
        that started with the suite (and paid for its imports and warm-up) count only where no other run is known."""
        same = [m for m in self.measured if m[0] == task]
        pool = [m for m in same if not m[3]] or same or [m for m in self.measured if not m[3]] or self.measured
        weights = [0.5 ** ((len(pool) - 1 - i) / HALF_LIFE) for i in range(len(pool))]
        return sum(w * m[1] for w, m in zip(weights, pool)) / sum(w * m[2] for w, m in zip(weights, pool))

    def predicted(self, job: Job) -> float:
        """The wall time ``job`` is expected to take: its :func:`work` × the measured :meth:`rate` of its task."""
        return self.rate(job.config.task) * work(job)

    def eta(self) -> float | None:
        """Seconds left: the predicted wall time of each run left (:meth:`predicted`) summed, / runs in parallel
        (None before any run finished)."""
        if not self.measured:
            return None
        todo = list(self.left.values())
        missing = max(0, self.total - self.n_done - len(todo))  # runs counted but not known by key
        total = sum(self.predicted(j) for j in todo) + missing * statistics.fmean(self.durations)
        return total / min(self.workers, max(1, self.total))

    def _eta_text(self) -> str:
        if self.bar is not None:  # the bar shows its own
            return ""
        left = self.eta()
        return "" if left is None or self.n_done >= self.total else f"  ETA {_clock(left)}"

    def on_step(self, job: Job, step: int, loss: float) -> None:
        if self.bar is None:
            return
        if self.bar.n == 0 and not self.steps_seen:
            # the first step of the suite: restart the bar's clock, so that its rate (and ETA)
            # is not one step per setup time (imports, data, workers starting: "34:15:07")
            self.bar.reset()
        if step == 1:
            self.bar.set_description(job.title)
        self.bar.update(1)
        self.steps_seen[job.key] = step
        if step % 25 == 0:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def _advance(self, job: Job, elsewhere: bool = False) -> None:
        # The k-th run to finish started when the (k - workers)-th finished (or at the start):
        # exact with one worker, and with a pool as long as runs are handed out in order.
        now = self.clock()
        self.left.pop(job.key, None)
        if elsewhere:  # not a run of ours: it tells nothing about our rate
            self.n_done += 1
            if self.bar is not None:
                self.bar.update(job.config.steps if self.per_step else 1)
            return
        k = len(self.finish_times)
        started = self.finish_times[k - self.workers] if k >= self.workers else self.t0
        self.durations.append(now - started)
        self.measured.append((job.config.task, now - started, work(job), k < self.workers))
        self.finish_times.append(now)
        self.n_done += 1
        if self.bar is not None and self.per_step:  # a run that stopped early: count its remaining steps
            left = job.config.steps - self.steps_seen.get(job.key, 0)
            if left > 0:
                self.bar.update(left)
        if self.bar is not None and not self.per_step:
            self.bar.update(1)
            self.bar.set_description(job.title)

    def note(self, line: str) -> None:
        """A message about the suite (waiting for another process, a locked store), shown even when quiet."""
        self.write(line, err=True)

    def finished(self, job: Job, rec: dict[str, Any], elsewhere: bool = False) -> None:
        """A run finished (``elsewhere``: by another process on the same store, not trained here)."""
        self._advance(job, elsewhere)
        self._score(rec)
        if not self.live:
            return
        metric = rec.get("metric", "accuracy")
        cells = "  ".join(
            f"{'L=' + k if k.isdigit() else k} {_fmt(v, metric)}"
            for k, v in rec["metrics"].items()
            if not k.endswith("_error")
        )
        w = len(str(self.total))
        warn = ""
        try:
            ok = run_learned(rec)
            control = getattr(job, "control", "")
            if control and ok is False:
                warn = "  (control: at chance, as designed)"
            elif control and ok is True:
                warn = "  note: this control is not at chance in distribution, though it is meant to be"
            elif ok is False:
                warn = "  !! did not learn (at chance in distribution)"
        except Exception:  # noqa: BLE001 -- a warning must never stop the suite
            pass
        self.write(
            f"[{self.n_done:>{w}}/{self.total}] {job.title}  {cells}  "
            + ("(by another process)" if elsewhere else f"({rec.get('train_seconds', 0):.1f} s)")
            + f"{warn}  | {job.config.task}: {self.leaders(job.config.task)}{self._eta_text()}"
        )

    def failed(self, job: Job, error: str) -> None:
        self._advance(job)
        w = len(str(self.total))
        # a posenc error is its message (what to do); anything else its first line (type: message)
        lines = error.strip().splitlines() or ["(no message)"]
        text = "\n    ".join(lines[:8] if error.startswith(_POSENC_PREFIXES) else lines[:1])
        self.write(f"[{self.n_done:>{w}}/{self.total}] {job.title}  FAILED: {text}{self._eta_text()}", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


HALF_LIFE = 6  # runs: how fast the ETA's rate follows a machine whose load changes
# seconds of Python and dispatch per optimizer step, in units of work: fitted on the quick suite on 2 CPU cores
# (order 300 steps × 64 in 5.7 s, adjacent 400 × 128 in 13.2 s), where a tiny model's step is mostly overhead
STEP_OVERHEAD = 7e7


def work(job: Job) -> float:
    """The work of a run, in multiply-adds (what the ETA prices by the measured seconds per unit): per token and
    layer ``12·d²`` (the projections, a 4·d feed-forward; ``4·d² + 2·d·d_ff`` with ``d_ff``) and ``2·L·d``
    (attention at length ``L``); training is 3 passes (forward and backward) over steps × batch sequences of the
    mean training length, evaluation one pass over ``eval_samples`` sequences of each test length; plus
    :data:`STEP_OVERHEAD` per step."""
    c = job.config
    d = max(1, int(c.d_model))
    dense = 4 * d * d + 2 * d * int(c.d_ff) if c.d_ff else 12 * d * d
    layers = max(1, int(c.n_layers))

    def tokens(length: float, n: int) -> float:
        return n * length * layers * (dense + 2 * length * d)

    lo, hi = c.train_lengths
    steps = max(1, int(c.steps))
    train = 3 * tokens((lo + hi) / 2, steps * max(1, int(c.batch_size or 1)))
    evaluation = sum(tokens(length, max(1, int(c.eval_samples))) for length in c.test_lengths)
    return train + evaluation + STEP_OVERHEAD * steps


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
