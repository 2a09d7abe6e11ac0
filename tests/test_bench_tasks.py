"""Tasks of one's own everywhere: ``--import``, entry points, workers / Ray / torchrun, versions in the key.

The truths checked against: run keys written down before task versions existed (built-in keys
must not change), the pids a task records (a run in a worker is not run in the parent), and
Python's own import machinery (a dist-info folder with an entry point, in a fresh interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

from posenc.bench import RunConfig, run_suite
from posenc.bench.api import Task, get_task, load_tasks, register_task, task_version, worker_imports
from posenc.bench.runner import run_one
from posenc.errors import ConfigError, UnknownNameError

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(steps=1, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=8)
TINY_LEN = dict(train_lengths=(4, 8), test_lengths=(8,))

PID_TASK = """
import os
from posenc.bench.api import Task, register_task


@register_task
class PidTask(Task):
    name = "{name}"
    description = "records which process ran it"
    {version}

    def run(self, cfg, on_step=None):
        return {{"metrics": {{"8": 1.0}}, "curve": [[1, 0.5]], "extra": {{"pid": os.getpid()}}}}
"""


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _write_task(folder: Path, module: str, name: str, version: str = "", comment: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}.py"
    path.write_text(f"# {comment}\n" + PID_TASK.format(name=name, version=f"version = {version!r}" if version else ""))
    return path


def test_builtin_run_keys_are_those_of_before():
    """Keys computed before task versions existed: existing stores stay valid for the built-in tasks."""
    assert RunConfig().key() == "46b333fab0cb2a26"
    assert RunConfig(task="adjacent", encoding="alibi", steps=5, test_lengths=(16, 17)).key() == "58ecaad32809f408"
    assert "task_version" not in RunConfig().as_dict() and task_version("order") is None
    # the sequence tasks changed (decoder runs read a BOS token): they declare a version, and their runs of before
    # are not reused
    counting = RunConfig(task="counting", encoding="rope", seed=3)
    assert task_version("counting") == task_version("copy") == task_version("addition") == "bos"
    assert counting.key() != "d47724bf1c1890af"  # its key before


def test_a_user_task_is_keyed_by_its_source_and_an_explicit_version_wins(tmp_path):
    a = _write_task(tmp_path / "a", "ver_task_a", "t-ver", comment="first")
    load_tasks(a)
    cfg1 = RunConfig(task="t-ver", encoding="none", **TINY_LEN)
    assert cfg1.task_version.startswith("src-") and cfg1.as_dict()["task_version"] == cfg1.task_version
    b = _write_task(tmp_path / "b", "ver_task_b", "t-ver", comment="edited")  # same task, code edited
    with pytest.warns(RuntimeWarning, match="replaced"):
        load_tasks(b)
    cfg2 = RunConfig(task="t-ver", encoding="none", **TINY_LEN)
    assert cfg2.task_version != cfg1.task_version and cfg2.key() != cfg1.key()
    # the run planned with the old code is refused, not silently run with the new one
    with pytest.raises(ConfigError, match="code changed"):
        run_one(cfg1)
    assert run_one(cfg2)["key"] == cfg2.key()
    # an explicit version: edits that keep it keep the key
    c = _write_task(tmp_path / "c", "ver_task_c", "t-ver2", version="3", comment="one")
    d = _write_task(tmp_path / "d", "ver_task_d", "t-ver2", version="3", comment="two")
    load_tasks(c)
    k1 = RunConfig(task="t-ver2", encoding="none", **TINY_LEN).key()
    with pytest.warns(RuntimeWarning):
        load_tasks(d)
    assert RunConfig(task="t-ver2", encoding="none", **TINY_LEN).key() == k1
    assert task_version("t-ver2") == "3"


def test_registering_again_replaces_warning_only_across_modules():
    def make(body: str, module: str):
        ns: dict = {"__name__": module, "Task": Task}
        exec(textwrap.dedent(body), ns)
        return ns["C"]

    src = """
    class C(Task):
        name = "t-rereg"
        def run(self, cfg, on_step=None):
            return {"metrics": {"8": %s}}
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_task(make(src % "0.1", "notebook_cell"))
        register_task(make(src % "0.2", "notebook_cell"))  # the cell run again: no warning
    assert get_task("t-rereg").run(None)["metrics"]["8"] == 0.2
    with pytest.warns(RuntimeWarning, match="t-rereg.*notebook_cell.*other_module"):
        register_task(make(src % "0.3", "other_module"))
    assert get_task("t-rereg").run(None)["metrics"]["8"] == 0.3


def test_unknown_task_says_how_to_import_one():
    with pytest.raises(UnknownNameError, match="--import"):
        get_task("no-such-task-here")


def test_a_notebook_task_cannot_go_to_workers(tmp_path):
    mod = types.ModuleType("a_notebook")  # no __file__, like a Jupyter cell or `python -c`
    exec("from posenc.bench.api import Task\nclass NB(Task):\n    name = 't-notebook'\n", mod.__dict__)
    sys.modules["a_notebook"] = mod
    register_task(mod.NB)
    with pytest.raises(ConfigError, match="notebook.*\\.py file"):
        run_suite([RunConfig(task="t-notebook", encoding="none", **TINY_LEN)], tmp_path, workers=2, progress=False)


def test_worker_imports_name_a_module_by_name_or_file(tmp_path, monkeypatch):
    _write_task(tmp_path, "wi_by_name", "t-by-name")
    monkeypatch.syspath_prepend(str(tmp_path))
    import wi_by_name  # noqa: F401 -- imported as a user would, not through load_tasks

    assert "wi_by_name" in worker_imports(["t-by-name"])
    path = _write_task(tmp_path / "f", "wi_by_file", "t-by-file")
    load_tasks(str(path))
    assert str(path.resolve()) in worker_imports([])
    assert worker_imports(["order"]) == worker_imports([])  # built-in: nothing to add


def test_import_flag_loads_tasks_in_every_worker_and_the_cli(tmp_path):
    """`posenc bench --import FILE --workers 2`: the runs happen in the workers, which imported the file."""
    path = _write_task(tmp_path, "cli_tasks", "t-cli")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "posenc", "bench", "--import", str(path), "--tasks", "t-cli", "--seeds", "0", "1"]
    cmd += ["--steps", "1", "--train-max", "8", "--test-lengths", "8", "--workers", "2", "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    from posenc.bench import results

    runs = results(out)  # the quick suite's encodings x seeds 0 1
    assert (
        len(runs) >= 2
        and {r["config"]["seed"] for r in runs} == {0, 1}
        and all(rec["config"]["task_version"].startswith("src-") for rec in runs)
    )
    pids = {rec["extra"]["pid"] for rec in runs}
    assert r.returncode == 0 and len(pids) >= 1 and all(p != os.getpid() for p in pids)
    # --list-tasks sees it too; a module name works from the current folder
    r = subprocess.run(
        [sys.executable, "-m", "posenc", "bench", "--import", "cli_tasks", "--list-tasks"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0 and "t-cli" in r.stdout, r.stderr


def test_entry_point_group_registers_an_installed_packages_tasks(tmp_path):
    pkg = tmp_path / "site"
    _write_task(pkg, "ep_tasks", "t-entry-point")
    dist = pkg / "ep_tasks_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-tasks-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[posenc.tasks]\nmine = ep_tasks\n")
    code = "from posenc.bench import available_tasks, RunConfig; print('t-entry-point' in available_tasks())"
    env = {**os.environ, "PYTHONPATH": str(pkg), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_ddp_ranks_import_the_task_module(tmp_path):
    path = _write_task(tmp_path, "ddp_tasks", "t-ddp")
    load_tasks(path)
    res = run_suite(
        [RunConfig(task="t-ddp", encoding="none", **TINY, **TINY_LEN)], tmp_path / "o", ddp=2, progress=False
    )
    assert res.failures == [] and len(res) == 1 and res[0]["extra"]["pid"] != os.getpid()


def test_ray_tasks_import_the_task_module(tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'posenc[cluster]')")
    path = _write_task(tmp_path, "ray_tasks", "t-ray")
    load_tasks(path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfgs = [RunConfig(task="t-ray", encoding="none", seed=s, **TINY_LEN) for s in (0, 1)]
        res = run_suite(cfgs, tmp_path / "o", executor="ray", progress=False)
    finally:
        ray.shutdown()
    assert res.failures == [] and len(res) == 2 and all(r["extra"]["pid"] != os.getpid() for r in res)


def test_ray_without_a_cluster_is_one_clear_sentence(monkeypatch, capsys):
    from posenc.bench import executors

    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False

    def init(**kw):
        raise ConnectionError("Could not find any running Ray instance. Please specify ... `--address` flag")

    fake.init = init
    monkeypatch.setitem(sys.modules, "ray", fake)
    with pytest.raises(ConfigError) as err:
        executors.RayExecutor("auto")
    msg = str(err.value)
    assert msg.startswith("no Ray cluster was found at --ray-address auto: start one with `ray start --head`")
    assert "omit --ray-address" in msg and "--workers" in msg and "\n" not in msg and "`--address` flag" not in msg


@pytest.mark.skipif(Path("/tmp/ray/ray_current_cluster").exists(), reason="a Ray cluster runs on this machine")
def test_ray_address_auto_without_a_cluster_exits_2(tmp_path):
    pytest.importorskip("ray")
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():  # "auto" connects to any Ray cluster running here (another test run's, say)
        pytest.skip("a Ray cluster runs on this machine now; --ray-address auto would connect to it")
    suite = tmp_path / "s.toml"
    suite.write_text(
        'name = "s"\ntasks = ["order"]\nseeds = [0]\nencodings = ["none"]\n'
        "[settings]\nsteps = 1\ntrain_lengths = [4, 8]\ntest_lengths = [8]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run(
        [sys.executable, "-m", "posenc", "bench", "--suite", str(suite), "--executor", "ray", "--ray-address", "auto"]
        + ["--out", str(tmp_path / "o"), "--quiet"],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "no Ray cluster was found at --ray-address auto" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr


def test_records_name_their_task_version_in_json(tmp_path):
    path = _write_task(tmp_path, "json_tasks", "t-json")
    load_tasks(path)
    rec = run_one(RunConfig(task="t-json", encoding="none", **TINY_LEN))
    assert json.loads(json.dumps(rec))["config"]["task_version"] == task_version("t-json")
