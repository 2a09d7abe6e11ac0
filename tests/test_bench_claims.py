"""Claims (leases on runs) and pending files of the results store, in one process.

Truths: the file system (which claim files exist, their mtimes set by hand), threads that race for
one expired claim, and rows counted through a separate sqlite3 connection.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

from posenc.bench.store import HOST, Claims, SQLiteStore, new_owner


def _other(pid: int | None = None, host: str = HOST) -> dict:
    return {"host": host, "pid": pid if pid is not None else os.getpid(), "pid_start": None, "tag": os.urandom(4).hex()}


def test_a_claim_is_exclusive_and_released(tmp_path):
    a, b = Claims(tmp_path / "r.sqlite"), Claims(tmp_path / "r.sqlite", owner=_other())
    assert a.try_claim("k1", "order/rope/seed0") is None  # ours
    assert a.try_claim("k1") is None  # still ours
    holder = b.try_claim("k1")
    assert holder is not None and holder["pid"] == os.getpid() and holder["title"] == "order/rope/seed0"
    assert b.holder("k1") is not None and a.holder("k1") is None
    a.release("k1")
    assert b.try_claim("k1") is None and a.try_claim("k1") is not None
    a.close()
    b.close()
    assert not (tmp_path / "r.sqlite.claims").exists()  # the folder goes when the last claim does


def test_a_dead_owners_claim_and_a_stale_heartbeat_expire(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    gone = Claims(tmp_path / "r.sqlite", owner=_other(dead_pid))
    assert gone.try_claim("k") is None
    me = Claims(tmp_path / "r.sqlite")
    assert me.try_claim("k") is None  # the pid is gone: taken over at once, as claim number 1
    assert [p.name for p in sorted((tmp_path / "r.sqlite.claims").glob("*.claim"))] == ["k.1.claim"]
    # another host's claim: alive while its heartbeat is fresh, expired when older than the lease
    far = Claims(tmp_path / "r.sqlite", lease=60, owner=_other(1, host="elsewhere"))
    assert far.try_claim("j") is None
    assert me.try_claim("j") is not None
    path = tmp_path / "r.sqlite.claims" / "j.0.claim"
    os.utime(path, (time.time() - 61, time.time() - 61))
    assert me.try_claim("j") is None
    far.beat()
    assert "j" in far.lost  # the old owner notices it lost the lease
    me.close()


def test_exactly_one_of_many_takes_over_an_expired_claim(tmp_path):
    for round_ in range(5):
        key = f"k{round_}"
        old = Claims(tmp_path / "r.sqlite", owner=_other(1, host="elsewhere"))
        old.try_claim(key)
        p = tmp_path / "r.sqlite.claims" / f"{key}.0.claim"
        os.utime(p, (time.time() - 3600, time.time() - 3600))
        racers = [Claims(tmp_path / "r.sqlite", owner=_other()) for _ in range(8)]
        won = []
        go = threading.Barrier(len(racers))

        def race(c, go, key, won):
            go.wait()
            if c.try_claim(key) is None:
                won.append(c)

        threads = [threading.Thread(target=race, args=(c, go, key, won)) for c in racers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        for c in racers:
            c.close()


def test_the_heartbeat_keeps_a_claim_alive(tmp_path):
    a = Claims(tmp_path / "r.sqlite", lease=0.6)
    b = Claims(tmp_path / "r.sqlite", lease=0.6, owner=_other())
    assert a.try_claim("k") is None
    time.sleep(1.5)  # 2.5 leases: only the heartbeat (every lease / 6) keeps it
    assert b.try_claim("k") is not None
    a.close(keep={"k"})  # kept, but no heartbeat any more: it expires with the lease
    time.sleep(0.8)
    assert b.try_claim("k") is None
    b.close()


def test_pending_files_of_finished_or_dead_suites_are_imported_others_are_not(tmp_path):
    db = tmp_path / "results.sqlite"
    store = SQLiteStore(db)
    rec = {"key": "a", "config": {"task": "order", "encoding": "none", "seed": 0}, "metrics": {}}
    live = new_owner()
    from posenc.bench import store as store_mod

    store_mod.ACTIVE_TAGS.add(live["tag"])
    try:
        store.keep_pending(rec, live)  # a suite of this process that is still going: left alone
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        store.keep_pending({**rec, "key": "b"}, {**live, "pid": int(dead.stdout), "tag": "x1"})
        store.keep_pending({**rec, "key": "c"}, {**live, "host": "elsewhere", "tag": "x2"})  # fresh: left alone
        store.pending_path.write_text(json.dumps({**rec, "key": "d"}) + "\n")  # the old single file
        SQLiteStore(db).close()
        con = sqlite3.connect(db)
        keys = {k for (k,) in con.execute("SELECT key FROM runs")}
        con.close()
        assert keys == {"b", "d"}
        assert len(list(tmp_path.glob("results.sqlite.pending*"))) == 2
    finally:
        store_mod.ACTIVE_TAGS.discard(live["tag"])
    SQLiteStore(db).close()  # the suite is over: its file is imported now
    con = sqlite3.connect(db)
    assert {k for (k,) in con.execute("SELECT key FROM runs")} == {"a", "b", "d"}
    con.close()
