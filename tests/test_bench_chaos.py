"""Chaos for the harness: parents and workers killed (SIGKILL) or interrupted (SIGINT), suites launched
twice on one store, and what must hold whatever happens.

* Nothing finished is lost: every run a suite announced as finished is in the store afterwards.
* Nothing is stored twice: one row per run, and the row is the one training that a healthy process
  finished (not overwritten by a second training).
* Nothing is trained twice: of the trainings that finished in processes the test never signalled
  (neither the process nor its parent), at most one per run.
* Nothing is left behind: no process of a suite (parent, workers, multiprocessing's resource
  tracker) outlives its parent.

The truth is independent of the harness: a log file the tiny task appends to from whichever process
trains it (one line per start and per finished training: pid, parent pid, a nonce), the rows read
with sqlite3, and /proc (processes found by an environment marker they inherit).

The CI version runs for about 8 s of chaos (20-35 s in all on 2 busy cores); ``POSENC_CHAOS_SECONDS=600 pytest -m slow
tests/test_bench_chaos.py`` (or any number of seconds) runs the long one. Linux only (/proc).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")

TASKS = """
import os, time, uuid
from posenc.bench.api import Task, register_task


def log(line):
    fd = os.open(os.environ["POSENC_CHAOS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


@register_task
class ChaosCount(Task):
    name = "chaos-count"
    description = "sleeps, and logs each start and each finished training (test only)"

    def run(self, cfg, on_step=None):
        log(f"start {cfg.seed} {os.getpid()} {os.getppid()} -")
        time.sleep(float(os.environ.get("POSENC_CHAOS_SLEEP", "0.3")))
        nonce = uuid.uuid4().hex
        log(f"done {cfg.seed} {os.getpid()} {os.getppid()} {nonce}")
        return {"metrics": {"8": 1.0}, "curve": [[1, 0.1]], "extra": {"nonce": nonce}}
"""

DRIVER = """
import sys
from posenc.bench import RunConfig, run_suite
from posenc.bench.api import load_tasks

if __name__ == "__main__":
    tasks, store, workers, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    load_tasks(tasks)
    cfgs = [RunConfig(task="chaos-count", encoding="none", seed=s, steps=1, train_lengths=(4, 8), test_lengths=(8,))
            for s in range(first, first + count)]
    res = run_suite(cfgs, store, workers=workers, progress=False, live=True)
    print(f"DRIVER-DONE {len(res)}", flush=True)
"""


# ---------------------------------------------------------------------------------------------- helpers
class Lab:
    """A store, the task file, the log, and every process launched on them (found by a marker)."""

    def __init__(self, tmp: Path, sleep: float = 0.3):
        self.tmp = tmp
        self.tasks = tmp / "chaos_tasks.py"
        self.tasks.write_text(TASKS)
        self.driver = tmp / "driver.py"
        self.driver.write_text(DRIVER)
        self.store = tmp / "store"
        self.log = tmp / "train.log"
        self.log.touch()
        self.marker = uuid.uuid4().hex
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "POSENC_CHAOS_LOG": str(self.log),
            "POSENC_CHAOS_SLEEP": str(sleep),
            "POSENC_CHAOS_ID": self.marker,
        }
        self.drivers: list[tuple[subprocess.Popen, Path]] = []
        self.signalled: set[int] = set()

    def launch(self, workers: int, first: int, count: int) -> subprocess.Popen:
        out = self.tmp / f"driver-{len(self.drivers)}.out"
        f = out.open("w")
        p = subprocess.Popen(
            [sys.executable, str(self.driver), str(self.tasks), str(self.store), str(workers), str(first), str(count)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.tmp,
            start_new_session=True,
        )
        f.close()
        self.drivers.append((p, out))
        return p

    def signal(self, pid: int, sig: int) -> None:
        self.signalled.add(pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def events(self) -> list[tuple[str, int, int, int, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                out.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3]), parts[4]))
        return out

    def wait_for_starts(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and sum(e[0] == "start" for e in self.events()) < n:
            time.sleep(0.05)

    def marked(self) -> list[int]:
        """Live processes carrying this lab's marker (drivers, workers, resource trackers)."""
        found = []
        needle = f"POSENC_CHAOS_ID={self.marker}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0") and _state(int(d.name)) not in ("Z", None):
                    found.append(int(d.name))
            except OSError:
                continue
        return found

    def workers_of(self, pid: int) -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and _ppid(int(d.name)) == pid:
                try:
                    if b"spawn_main" in (d / "cmdline").read_bytes():
                        out.append(int(d.name))
                except OSError:
                    continue
        return out

    def rows(self) -> list[tuple[str, int, str]]:
        from posenc.bench.store import SQLiteStore

        SQLiteStore(self.store / "results.sqlite").close()  # imports what dead processes left pending
        con = sqlite3.connect(self.store / "results.sqlite")
        try:
            import json

            return [
                (k, seed, json.loads(p)["extra"]["nonce"])
                for k, seed, p in con.execute("SELECT key, seed, payload FROM runs")
            ]
        finally:
            con.close()

    def _lines(self, failed: bool) -> set[int]:
        seeds = set()
        for _, out in self.drivers:
            for line in out.read_text(errors="replace").splitlines():
                if "] chaos-count/none/seed" in line and ("  FAILED: " in line) == failed:
                    seeds.add(int(line.split("seed")[1].split()[0]))
        return seeds

    def announced(self) -> set[int]:
        """Seeds that some suite printed as finished (its line comes after the run was stored or kept).

        Not the ``[i/n] <title>  FAILED: ...`` lines (stderr goes to the same file): a run whose worker was
        killed twice is a failed run, recorded as a failure and tried again by the next suite, not a finished one
        (:meth:`announced_failed`)."""
        return self._lines(failed=False)

    def announced_failed(self) -> set[int]:
        """Seeds that some suite printed as failed (here, or ``(in another process)``)."""
        return self._lines(failed=True)

    def failures(self) -> set[int]:
        """Seeds with a recorded failure in the store."""
        con = sqlite3.connect(self.store / "results.sqlite")
        try:
            return {seed for (seed,) in con.execute("SELECT seed FROM failures")}
        finally:
            con.close()

    def reap(self, timeout: float = 60) -> None:
        for p, _ in self.drivers:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def no_orphans(self, grace: float = 10.0) -> list[int]:
        end = time.monotonic() + grace
        left = self.marked()
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = self.marked()
        return left

    def cleanup(self) -> None:
        for pid in self.marked():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reap(5)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _state(pid: int) -> str | None:
    st = _stat(pid)
    return st[0] if st else None


def _ppid(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[1]) if st else None


@pytest.fixture
def lab(tmp_path):
    lab = Lab(tmp_path)
    yield lab
    lab.cleanup()


def check_invariants(lab: Lab, seeds: set[int]) -> None:
    rows = lab.rows()
    stored = Counter(seed for _, seed, _ in rows)
    assert set(stored) == seeds, f"missing {sorted(seeds - set(stored))}, extra {sorted(set(stored) - seeds)}"
    assert all(n == 1 for n in stored.values()) and len({k for k, _, _ in rows}) == len(rows)
    healthy: dict[int, list[str]] = defaultdict(list)
    for kind, seed, pid, ppid, nonce in lab.events():
        if kind == "done" and pid not in lab.signalled and ppid not in lab.signalled:
            healthy[seed].append(nonce)
    twice = {s: n for s, n in healthy.items() if len(n) > 1}
    assert not twice, f"trained twice by processes nobody signalled: {twice}"
    by_seed = {seed: nonce for _, seed, nonce in rows}
    for seed, nonces in healthy.items():  # the stored row is that training, not another one
        assert by_seed[seed] == nonces[0]


# ---------------------------------------------------------------------------------------------- tests
def test_killing_the_parent_ends_its_workers_and_the_resource_tracker(lab):
    lab.env["POSENC_CHAOS_SLEEP"] = "30"
    p = lab.launch(workers=2, first=0, count=4)
    lab.wait_for_starts(2, timeout=60)
    before = lab.marked()
    workers = lab.workers_of(p.pid)
    assert len(workers) == 2 and len(before) >= 4, (before, workers)  # parent, 2 workers, resource tracker
    lab.signal(p.pid, signal.SIGKILL)
    p.wait()
    assert lab.no_orphans(grace=10) == []


def test_two_launches_on_one_store_share_the_runs(lab):
    a = lab.launch(workers=2, first=0, count=8)
    b = lab.launch(workers=1, first=0, count=8)
    lab.reap()
    assert a.returncode == 0 and b.returncode == 0, [o.read_text()[-2000:] for _, o in lab.drivers]
    done = Counter(e[1] for e in lab.events() if e[0] == "done")
    assert done == Counter(range(8))  # each run trained once, by one of them
    assert {e[3] for e in lab.events() if e[0] == "done"} | {e[2] for e in lab.events()} != set()
    check_invariants(lab, set(range(8)))
    assert lab.announced() == set(range(8))
    assert lab.no_orphans() == []


def test_a_dead_owners_runs_are_taken_over_at_once(lab):
    lab.env["POSENC_CHAOS_SLEEP"] = "30"
    a = lab.launch(workers=1, first=0, count=2)
    lab.wait_for_starts(1, timeout=60)
    lab.signal(a.pid, signal.SIGKILL)
    a.wait()
    lab.env["POSENC_CHAOS_SLEEP"] = "0.1"
    t0 = time.monotonic()
    b = lab.launch(workers=1, first=0, count=2)
    b.wait(timeout=120)
    assert b.returncode == 0 and time.monotonic() - t0 < 45  # not the 60 s lease: the owner's pid is gone
    check_invariants(lab, {0, 1})


def test_a_worker_killed_mid_run_is_replaced_and_the_run_tried_again(lab):
    lab.env["POSENC_CHAOS_SLEEP"] = "2"
    p = lab.launch(workers=2, first=0, count=3)
    lab.wait_for_starts(1, timeout=60)
    victim = next(e[2] for e in lab.events() if e[0] == "start")
    lab.signal(victim, signal.SIGKILL)
    p.wait(timeout=120)
    assert p.returncode == 0, lab.drivers[0][1].read_text()[-2000:]
    check_invariants(lab, {0, 1, 2})
    assert lab.no_orphans() == []


def test_a_run_whose_worker_is_killed_twice_is_announced_failed_not_finished(lab):
    """The worker of seed 0 killed, its run tried again in a new worker, that one killed too: the run is a
    failure (printed ``FAILED:``, recorded in the failures table, not in the runs). Before the chaos test told
    the two kinds of line apart, this was its rare "announced but not stored: [0]" (two kill-worker blows
    that hit the same run)."""
    lab.env["POSENC_CHAOS_SLEEP"] = "30"  # each training is killed long before its end
    p = lab.launch(workers=2, first=0, count=1)
    killed: list[int] = []
    for _ in range(2):
        end = time.monotonic() + 60
        victims: list[int] = []
        while not victims and time.monotonic() < end:
            victims = [e[2] for e in lab.events() if e[0] == "start" and e[2] not in killed]
            time.sleep(0.05)
        assert victims, lab.drivers[0][1].read_text()[-2000:]
        killed.append(victims[0])
        lab.signal(victims[0], signal.SIGKILL)
    p.wait(timeout=120)
    out = lab.drivers[0][1].read_text()
    assert p.returncode == 0 and "died 2 times" in out, out[-2000:]
    assert lab.announced_failed() == {0} and lab.announced() == set(), out[-2000:]
    assert lab.rows() == [] and lab.failures() == {0}
    assert lab.announced() <= {seed for _, seed, _ in lab.rows()}  # the chaos test's check holds
    assert lab.no_orphans() == []


def _blow(lab: Lab, rng: random.Random, alive: list[subprocess.Popen], actions: Counter[str]) -> None:
    """One random blow at the suites of a round: a parent or a worker killed or interrupted, or nothing."""
    action = rng.choice(("kill-parent", "int-parent", "kill-worker", "kill-worker", "none"))
    victim = rng.choice(alive)
    if action == "kill-worker":
        workers = [w for p in alive for w in lab.workers_of(p.pid)]
        if not workers:
            return
        lab.signal(rng.choice(workers), signal.SIGKILL)
    elif action != "none":
        lab.signal(victim.pid, signal.SIGKILL if action == "kill-parent" else signal.SIGINT)
    actions[action] += 1


def _chaos(lab: Lab, seconds: float, seed: int) -> dict[str, int]:
    """Rounds of ``n`` new runs: 2-3 suites launched at once on the store; while they run, blows at random
    moments, and a suite that was stopped is now and then launched again (it joins the others)."""
    rng = random.Random(seed)
    actions: Counter[str] = Counter()
    n = 10
    first = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        launched = [lab.launch(workers=rng.choice((1, 2)), first=first, count=n) for _ in range(rng.choice((2, 3)))]
        for _ in range(rng.randint(1, 3)):
            alive = [p for p in launched if p.poll() is None and p.pid not in lab.signalled]
            if not alive:
                break
            lab.wait_for_starts(sum(e[0] == "start" for e in lab.events()) + rng.randint(1, 3), timeout=15)
            _blow(lab, rng, alive, actions)
            if rng.random() < 0.5:
                launched.append(lab.launch(workers=rng.choice((1, 2)), first=first, count=n))
                actions["relaunch"] += 1
        for p in launched:
            p.wait(timeout=120)
            if p.pid not in lab.signalled:
                assert p.returncode == 0, [o.read_text()[-3000:] for q, o in lab.drivers if q is p]
        first += n
    # nothing finished is lost: every run announced as finished is stored (pending files of the dead included)
    announced, failed = lab.announced(), lab.announced_failed()
    stored = {seed for _, seed, _ in lab.rows()}
    assert announced <= stored, f"announced but not stored: {sorted(announced - stored)}"
    # a clean pass finishes what the chaos left, without training anything stored again
    final = lab.launch(workers=2, first=0, count=first)
    final.wait(timeout=300)
    assert final.returncode == 0, lab.drivers[-1][1].read_text()[-3000:]
    check_invariants(lab, set(range(first)))
    assert lab.no_orphans() == []
    actions["rounds"] = first // n
    actions["suites"] = len(lab.drivers)
    actions["trainings"] = sum(e[0] == "done" for e in lab.events())
    actions["failed"] = len(failed)
    print(f"chaos (seed {seed}): {dict(actions)}")
    return dict(actions)


def test_chaos(lab):
    """About 8 s of random kills and interrupts of parents and workers, 2-3 suites at once on one store."""
    seed = int(os.environ.get("POSENC_CHAOS_SEED", time.time()))
    done = _chaos(lab, seconds=float(os.environ.get("POSENC_CHAOS_CI_SECONDS", "8")), seed=seed)
    assert done["rounds"] >= 1


@pytest.mark.slow
@pytest.mark.skipif("POSENC_CHAOS_SECONDS" not in os.environ, reason="set POSENC_CHAOS_SECONDS to run the long one")
def test_chaos_long(lab):
    seed = int(os.environ.get("POSENC_CHAOS_SEED", time.time()))
    done = _chaos(lab, seconds=float(os.environ["POSENC_CHAOS_SECONDS"]), seed=seed)
    assert done["rounds"] >= 2
