"""What a newcomer trips on at the command line (issue 27, and issue 24's silent results page).

Independent truth: the expected names are the registry's own, the error text is matched for the values
the user typed, and the pipe test reads the real stderr of a real process whose reader stops early.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import posenc
from posenc.cli import main


def test_a_typo_gets_did_you_mean_and_a_pointer_not_the_whole_list(capsys):
    assert main(["bench", "--encodings", "sinusiodal"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean: sinusoidal" in err and "posenc list" in err
    # not the ~90 names: a name that is not close to the typo is not in the message
    assert "kerple-power" not in err and err.count("\n") == 1


def test_every_typo_is_reported_at_once(capsys):
    assert main(["bench", "--encodings", "ropee", "alibii", "rope"]) == 2
    err = capsys.readouterr().err
    assert "'ropee'" in err and "'alibii'" in err and "alibi" in err.split("'alibii'")[1]
    assert "'rope'" not in err.replace("'ropee'", "")  # the valid name is not called unknown


def test_get_unknown_name_error_names_the_close_matches():
    with pytest.raises(posenc.UnknownNameError) as exc:
        posenc.get("alibii", n_heads=4)
    assert exc.value.close_matches[0] == "alibi"
    assert "Known encodings" not in str(exc.value)


def test_help_of_get_lists_every_encoding_with_its_arguments():
    doc = inspect.getdoc(posenc.get)
    assert inspect.signature(posenc.get).parameters.keys() == {"name", "kwargs"}
    for name in posenc.available():
        cls = posenc.resolve(name)
        required = [
            k
            for k, p in inspect.signature(cls.__init__).parameters.items()
            if k != "self" and p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        line = next((ln.strip() for ln in doc.splitlines() if ln.strip().startswith(f"{name}(")), None)
        assert line is not None, f"{name} is not in help(posenc.get)"
        for arg in required:
            assert arg in line or arg in doc.split(line)[1].split("\n    ")[0], (name, arg)
    assert any(ln.strip().startswith("alibi(n_heads") for ln in doc.splitlines())


def test_help_of_get_in_a_fresh_interpreter_lists_the_arguments():
    code = "import posenc, pydoc; print(pydoc.render_doc(posenc.get, renderer=pydoc.plaintext))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "get(name: 'str', **kwargs: 'Any')" in out or "get(name: str, **kwargs: Any)" in out
    assert "alibi(n_heads" in out and "rope(head_dim" in out


def test_a_closed_pipe_prints_no_traceback():
    # the reader takes one line and goes away, as `| head -1` does
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'posenc', 'inspect', 't5', '--format', 'markdown',"
        " '--no-plots'], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
        "p.stdout.readline(); p.stdout.close()\n"
        "err = p.stderr.read().decode(); p.wait()\n"
        "print(p.returncode); print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300).stdout
    rc, _, err = out.partition("\n")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc.strip() == "0"


def test_list_suites_columns_line_up(capsys):
    from posenc.bench.suites import describe_suites

    assert main(["bench", "--list-suites"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " runs  " in ln]
    assert len(lines) == len(describe_suites())
    starts = {ln.index(" runs  ") for ln in lines}
    assert len(starts) == 1, lines  # every "runs" column ends at the same place, context-extension included
    descs = {ln.index(desc) for ln, (_, desc, _) in zip(lines, describe_suites())}
    assert len(descs) == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--stores", "NO_SUCH_DIR"], "NO_SUCH_DIR: no such folder"),
        (["--suite", "nosuch"], "nosuch"),
    ],
)
def test_results_with_a_missing_store_or_suite_is_an_error_and_writes_nothing(tmp_path, capsys, argv, says):
    page = tmp_path / "page.md"
    args = [a.replace("NO_SUCH_DIR", str(tmp_path / "NO_SUCH_DIR")) for a in argv]
    assert main(["results", *args, "--write", str(page)]) == 2
    assert says in capsys.readouterr().err
    assert not page.exists()


def test_results_with_a_folder_holding_no_store_is_an_error(tmp_path, capsys):
    (tmp_path / "stores").mkdir()
    assert main(["results", "--stores", str(tmp_path / "stores"), "--write", str(tmp_path / "p.md")]) == 2
    assert "no store of any suite" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()


def test_results_with_a_store_path_that_is_a_folder_says_so(tmp_path, capsys):
    (tmp_path / "stores" / "alibi" / "results.sqlite").mkdir(parents=True)
    assert main(["results", "--stores", str(tmp_path / "stores"), "--write", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err
    assert "results.sqlite exists as a folder, not a SQLite file" in err
    assert "remove or rename that folder" in err
    assert not (tmp_path / "p.md").exists()


def test_the_terminal_warns_when_a_task_was_not_learned(tmp_path, capsys):
    from posenc.bench.store import open_store
    from posenc.bench.suites import load_suite

    job = load_suite("shaw-k").jobs()[0]
    record = {
        "key": job.key,
        "config": job.config.as_dict(),
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": {"16": 0.51, "32": 0.5, "64": 0.5},  # adjacent's chance is 50 %
        "curve": [[1, 0.7]],
        "train_seconds": 1.0,
        "label": job.label,
        "suite": "shaw-k",
    }
    with open_store(tmp_path / "results.sqlite") as store:
        store.add(record)
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    got = capsys.readouterr()
    assert "posenc bench: warning: no encoding learned task 'adjacent' in distribution" in got.err
    assert "**Verdict:** only shaw k=0 was run" in got.out and "No encoding learned the task" in got.out


def test_a_suite_s_encodings_go_by_label_and_every_unknown_one_is_named(tmp_path, capsys):
    argv = ["bench", "--suite", "shaw-k", "--report-only", "--out", str(tmp_path), "--encodings"]
    assert main([*argv, "shaw k=4"]) == 0  # a label, not a registered name: fine (an empty store's report)
    capsys.readouterr()
    assert main([*argv, "shaw k=4", "shaw k=44", "ropee"]) == 2
    err = capsys.readouterr().err
    assert "'shaw k=44' (did you mean: shaw k=4" in err and "'ropee'" in err


@pytest.mark.parametrize(
    ("typed", "meant"), [("benh", "bench"), ("lst", "list"), ("extnd", "extend"), ("inpsect", "inspect")]
)
def test_a_mistyped_command_gets_did_you_mean(capsys, typed, meant):
    with pytest.raises(SystemExit) as exc:
        main([typed, "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown command {typed!r}. Did you mean: {meant}" in err and "posenc --help" in err


def test_every_command_with_a_letter_dropped_leads_back_to_it(capsys):
    from posenc.cli import build_parser

    names = list(next(a for a in build_parser()._actions if a.dest == "command").choices)
    assert {"list", "bench", "extend", "inspect"} <= set(names)
    for name in names:
        typo = name[:1] + name[2:]
        with pytest.raises(SystemExit):
            main([typo])
        said = capsys.readouterr().err.split("Did you mean:")[1].split("?")[0]
        assert name in [s.strip() for s in said.split(",")], (typo, said)
    with pytest.raises(SystemExit):
        main(["zzzzqq"])
    err = capsys.readouterr().err
    assert "Did you mean" not in err and "The commands: " in err and all(n in err for n in names)


def test_the_quick_report_links_the_page_that_explains_normalized_winning_order(tmp_path, capsys):
    from pathlib import Path

    from posenc.bench.cli import EXPLAINED

    page = Path(__file__).resolve().parents[1] / EXPLAINED["quick"].rsplit(": ", 1)[1]
    text = page.read_text(encoding="utf-8")
    assert "`normalized` positions extrapolate `order`" in text and "t/(N-1)" in text  # the page does explain it
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    assert EXPLAINED["quick"] in capsys.readouterr().out
    assert EXPLAINED["quick"] in (tmp_path / "leaderboard.md").read_text(encoding="utf-8")


def test_a_mean_beyond_training_column_says_what_it_is():
    from posenc.bench.report import leaderboard, markdown_table
    from posenc.bench.reporting.format import SUMMARY_NOTE

    def rec(train_max: int, seed: int) -> dict:
        lengths = {"16": 0.99, "32": 0.8, "64": 0.6} if train_max == 16 else {"64": 0.9}
        cfg = dict(task="order", encoding="rope", seed=seed, train_lengths=[4, train_max], steps=1, batch_size=1)
        cfg["test_lengths"] = [int(k) for k in lengths]
        return {
            "config": cfg,
            "metric": "accuracy",
            "higher_is_better": True,
            "metrics": lengths,
            "label": "rope",
            "train_seconds": 1.0,
        }

    beyond = markdown_table(leaderboard([rec(16, 0), rec(16, 1)]))
    assert "| mean > train |" in beyond and SUMMARY_NOTE in beyond
    within = markdown_table(leaderboard([rec(64, 0), rec(64, 1)]))  # no length beyond training: a plain mean
    assert "mean > train" not in within and SUMMARY_NOTE not in within


def _tiny_llama(layers: int = 3):
    transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval(), torch


def test_one_whole_forward_reports_its_progress_layer_by_layer():
    # docs/extend.md: "a line per prefill chunk"; a whole forward (no chunks) reports after each decoder layer
    from posenc.extend.evaluate import passkey_score, token_losses

    model, torch = _tiny_llama(layers=3)
    ids = torch.randint(0, 64, (1, 101))
    calls: list[tuple[int, int]] = []
    whole = token_losses(model, ids, chunk=None, progress=lambda d, t: calls.append((d, t)))
    assert len(calls) == 3 + 1 and calls[-1] == (100, 100)  # one per layer, then the end
    done = [d for d, _ in calls]
    assert done == sorted(done) and all(d < 100 for d in done[:-1]) and all(t == 100 for _, t in calls)
    # a share k/4 of the work as tokens of a prefill that does as much: 100·√(k/4)
    assert done[:-1] == [int(100 * (k / 4) ** 0.5) for k in (1, 2, 3)]
    assert torch.equal(whole, token_losses(model, ids, chunk=None))  # the hooks change nothing
    chunked: list[tuple[int, int]] = []
    token_losses(model, ids, chunk=40, progress=lambda d, t: chunked.append((d, t)))
    assert chunked == [(40, 100), (80, 100), (100, 100)]  # chunks: a line each, as before
    assert not any(h for layer in model.model.layers for h in layer._forward_hooks.values())  # the hooks are gone
    from posenc.extend.evaluate import PasskeyPrompt

    prompt = PasskeyPrompt(ids[0], 98, "1", 0.5, 50)
    seen: list[tuple[int, int]] = []
    passkey_score(model, prompt, chunk=None, progress=lambda d, t: seen.append((d, t)))
    assert len(seen) == 4 and seen[-1] == (100, 100)
