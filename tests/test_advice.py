"""pipeoptim.lab.tasks.advice: the equal-time study's recommendation as the package holds it (the
table itself is held to the committed rows in study/tests/test_make_results3.py), what it prints, the command
it gives, the nearest studied depth, and what ``pipeoptim compare`` ends with."""
from __future__ import annotations

import shutil

import pytest

from pipeoptim.lab.tasks import advice as advice_module
from pipeoptim.lab.tasks.advice import Advice, advice

ASYNC = Advice(task="image", stages=8, method="pipeoptim", synchronous=False, microbatches=2,
               options=(("lr_correction", "delay"),), optimizer="momentum", lr=0.005, metric="accuracy",
               value=0.92, spread=0.01, seeds=3, runner_up="the synchronous pipeline with momentum",
               runner_up_value=0.89, runner_up_spread=0.02, runner_up_seeds=3, margin=0.03, low=0.004, high=0.056,
               p_value=0.012, verdict="better")
SYNC = Advice(task="lm", stages=4, method="zb-h1", synchronous=True, microbatches=16, options=(("beta1", "0.99"),),
              optimizer="nadam", lr=0.002, metric="perplexity", value=55.25, spread=0.5, seeds=5,
              runner_up="pipedream-2bw with muon", runner_up_value=55.0, runner_up_spread=1.0, runner_up_seeds=5,
              margin=0.25, low=-1.1, high=1.6, p_value=0.62, verdict="no detectable difference")


def test_the_command_trains_the_recommended_setting():
    assert ASYNC.command() == ("pipeoptim train --task image --method pipeoptim --stages 8 --micro-batches 2 "
                               "--optimizer momentum --lr 0.005 --lr-correction delay")
    assert SYNC.command() == ("pipeoptim train --task lm --method zb-h1 --stages 4 --micro-batches 16 "
                              "--optimizer nadam --lr 0.002 --beta1 0.99")
    # a switch is a bare flag (the command line's store_true), one left off is not written
    switched = Advice(**{**ASYNC.__dict__, "method": "pipeoptim-2bw", "options": (("error_feedback", "True"),
                                                                                   ("horizon_scheduled", "False"))})
    assert switched.command().endswith("--optimizer momentum --lr 0.005 --error-feedback")


def test_the_description_gives_the_confirmation_in_the_metrics_unit():
    assert ASYNC.describe() == (
        "image, N = 8: in the same time, pipeoptim, lr_correction delay (M = 2) with momentum gives a better model "
        "than the synchronous pipeline with momentum: test accuracy 92.00 ± 1.00 over 3 fresh seeds, against "
        "89.00 ± 2.00 over 3 (difference asynchronous - synchronous +3.00, 95 % interval [+0.40, +5.60]; "
        "one-sided Welch p = 0.012, corrected for the study's tasks; the equal-time study (docs/results.md)). "
        "To train it: " + ASYNC.command())
    # a synchronous recommendation gives the difference as asynchronous - synchronous too (its
    # margin is the other way round), lower is better said for perplexity
    assert SYNC.describe() == (
        "lm, N = 4: in the same time, use the synchronous pipeline (zb-h1, M = 16) with nadam: test perplexity "
        "55.2 ± 0.5 over 5 fresh seeds. The asynchronous arm chosen on validation, pipedream-2bw with muon, gave "
        "55.0 ± 1.0 over 5: not better by the test (difference asynchronous - synchronous -0.2, lower is "
        "better, 95 % interval [-1.6, +1.1]; one-sided Welch p = 0.620, corrected for the study's tasks; the "
        "equal-time study (docs/results.md)). To train it: " + SYNC.command())
    tiny = Advice(**{**ASYNC.__dict__, "p_value": 0.0002})
    assert "; one-sided Welch p < 0.001, corrected for the study's tasks;" in tiny.describe()
    worse = Advice(**{**SYNC.__dict__, "verdict": "worse", "runner_up_value": 58.0, "margin": -2.75, "low": -3.5,
                      "high": -2.0})
    assert ": worse (difference asynchronous - synchronous +2.8, lower is better, 95 % interval [+2.0, +3.5];" \
        in worse.describe()


def test_bleu_is_higher_is_better_and_written_as_bleu():
    bleu = Advice(**{**SYNC.__dict__, "task": "translation", "metric": "bleu", "value": 15.4, "runner_up_value": 14.9,
                     "margin": 0.5, "low": -0.4, "high": 1.4})
    assert "test BLEU 15.4 ± 0.5 over 5 fresh seeds" in bleu.describe()
    assert "(difference asynchronous - synchronous -0.5, 95 % interval [-1.4, +0.4];" in bleu.describe()


def test_another_depth_gets_the_nearest_studied_one(monkeypatch):
    monkeypatch.setattr(advice_module, "ADVICE", {("image", 8): ASYNC, ("image", 4): ASYNC.__class__(
        **{**ASYNC.__dict__, "stages": 4, "method": "xpipe"})})
    assert advice("image", 8)[0] is ASYNC
    assert advice("image", 4)[0].method == "xpipe"
    entry, text = advice("image", 6)  # as far from 4 as from 8: the deeper one
    assert entry is ASYNC and text.startswith("(no study at N = 6; the nearest studied depth) image, N = 8:")
    assert advice("image", 2)[0].method == "xpipe"


def test_no_finished_study_says_so_and_what_is_safe(monkeypatch):
    monkeypatch.setattr(advice_module, "ADVICE", {})
    entry, text = advice("translation", 4)
    assert entry is None
    assert "has no finished recommendation for translation yet" in text
    assert "the synchronous pipeline is the safe choice" in text


@pytest.mark.parametrize("as_json", [False, True])
def test_compare_ends_with_the_advice_for_its_task_and_depth(tmp_path, capsys, monkeypatch, as_json):
    import json

    from pipeoptim.cli import main

    monkeypatch.setattr(advice_module, "ADVICE", {("image", 8): ASYNC})
    args = ["compare", "--task", "image", "--model", "mlp", "--limit", "256", "--batch-size", "64", "--epochs", "1",
            "--methods", "sequential", "--stages", "2", "--no-progress", "--out", str(tmp_path / "cmp")]
    assert main(args + (["--json"] if as_json else [])) == 0
    out = capsys.readouterr().out
    if as_json:
        report = json.loads(out)
        assert report["recommended"] == "pipeoptim"
        assert report["advice"].startswith("(no study at N = 2; the nearest studied depth) image, N = 8")
    else:
        last = out[out.index("which method to use: "):]
        assert all(len(line) <= 100 for line in last.splitlines())  # wrapped
        assert " ".join(line.strip() for line in last.splitlines()) == \
            "which method to use: (no study at N = 2; the nearest studied depth) " + ASYNC.describe()


NOT_FINISHED = ("Their confirmation on fresh seeds is still running (`python -m study.study3 --suite confirm "
                "--plan` says how far); until it has finished, use a synchronous pipeline: at equal updates "
                "every asynchronous method ended behind it (the second study, docs/results.md).")


def test_the_readme_says_what_the_package_recommends():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- advice: pipeoptim.lab.tasks.advice.ADVICE", "<!-- /advice -->"
    block = readme[readme.index(start):readme.index(end)].split("\n", 1)[1]
    bullets = [b.replace("\n  ", " ").strip() for b in block.split("\n- ") if b.strip()]
    bullets[0] = bullets[0].removeprefix("- ")
    # an entry per confirmed (task, N), then what is still running, if anything
    entries = [entry.describe() for entry in advice_module.ADVICE.values()]
    assert bullets[:len(entries)] == entries
    rest = sorted({"image", "sentiment", "lm", "translation"} - {task for task, _ in advice_module.ADVICE})
    assert bullets[len(entries):] == ([f"Not finished yet: {', '.join(rest)}. " + NOT_FINISHED] if rest else [])
    # the demo's printed advice is the one for its task and depth
    demo = readme[readme.index("which method to use: "):readme.index("```", readme.index("which method to use: "))]
    assert " ".join(line.strip() for line in demo.splitlines()) == "which method to use: " + advice("image", 4)[1]


@pytest.mark.skipif(shutil.which("mod2imp") is None, reason="needs the Bible modules and mod2imp "
                    "(make setup: sword-text-web sword-text-sparv libsword-utils)")
def test_compare_on_translation_ends_with_its_advice(tmp_path, capsys):
    """The paper's third task: `pipeoptim compare --task translation` ends with what the package
    says for translation (the equal-time study's entry once its translation cell is in; until
    then, that it has none and what is safe)."""
    from pipeoptim.cli import main

    args = ["compare", "--task", "translation", "--limit", "128", "--batch-size", "64", "--epochs", "1",
            "--methods", "sequential", "--stages", "2", "--no-progress", "--out", str(tmp_path / "cmp")]
    assert main(args) == 0
    out = capsys.readouterr().out
    last = out[out.index("which method to use: "):]
    assert " ".join(line.strip() for line in last.splitlines()) == "which method to use: " + advice("translation", 2)[1]


def test_the_table_is_the_data_file_that_pip_installs(tmp_path, monkeypatch):
    """ADVICE (and updates_to_target's UPDATES_TO_TARGET) are read from equal_time_study.json
    beside the module (study/tests/test_make_results3.py holds the file to the committed rows),
    which pyproject's package-data ships; a file of another kind is refused by name."""
    import json
    import tomllib
    from pathlib import Path

    from pipeoptim.lab.tasks import updates_to_target

    table = json.loads(advice_module.TABLE.read_text())
    assert advice_module.advice_table(table) == advice_module.ADVICE and list(advice_module.ADVICE) == [
        (e["task"], e["stages"]) for e in table["advice"]]
    assert updates_to_target.targets_table(table) == updates_to_target.UPDATES_TO_TARGET
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["pipeoptim.lab.tasks"]
    assert advice_module.TABLE.parent.name == "tasks" and any(advice_module.TABLE.match(p) for p in shipped)
    other = tmp_path / "equal_time_study.json"
    other.write_text(json.dumps({"format": "something-else", "advice": []}))
    monkeypatch.setattr(advice_module, "TABLE", other)
    advice_module.study_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="is not the equal-time study's table"):
            advice_module.study_table()
    finally:
        monkeypatch.undo()
        advice_module.study_table.cache_clear()
    assert advice_module.study_table() == table
