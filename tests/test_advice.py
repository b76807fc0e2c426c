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
               runner_up_value=0.89, runner_up_spread=0.02, margin=0.03)
SYNC = Advice(task="lm", stages=4, method="zb-h1", synchronous=True, microbatches=16, options=(("beta1", "0.99"),),
              optimizer="nadam", lr=0.002, metric="perplexity", value=55.25, spread=0.5, seeds=3,
              runner_up="pipedream-2bw with muon", runner_up_value=58.0, runner_up_spread=1.0, margin=-2.75)


def test_the_command_trains_the_recommended_setting():
    assert ASYNC.command() == ("pipeoptim train --task image --method pipeoptim --stages 8 --micro-batches 2 "
                               "--optimizer momentum --lr 0.005 --lr-correction delay")
    assert SYNC.command() == ("pipeoptim train --task lm --method zb-h1 --stages 4 --micro-batches 16 "
                              "--optimizer nadam --lr 0.002 --beta1 0.99")
    # a switch is a bare flag (the command line's store_true), one left off is not written
    switched = Advice(**{**ASYNC.__dict__, "method": "pipeoptim-2bw", "options": (("error_feedback", "True"),
                                                                                   ("horizon_scheduled", "False"))})
    assert switched.command().endswith("--optimizer momentum --lr 0.005 --error-feedback")


def test_the_description_gives_the_margin_and_the_spread_in_the_metrics_unit():
    text = ASYNC.describe()
    assert text == ("image, N = 8: in the same time, pipeoptim, lr_correction delay (M = 2) with momentum "
                           "gives the best model: test accuracy 92.00 ± 1.00 over 3 seeds; next the synchronous "
                           "pipeline with momentum 89.00 (margin +3.00, seed spread 2.00: only just beyond it, so "
                           "another seed could make it a tie; the equal-time study (docs/results.md)). To train it: "
                           + ASYNC.command())
    assert "the synchronous pipeline (zb-h1, M = 16) with nadam" in SYNC.describe()
    assert ("test perplexity 55.2 ± 0.5 over 3 seeds; next pipedream-2bw with muon 58.0 (margin -2.8, lower is "
            "better, seed spread 1.0; the equal-time study") in SYNC.describe()
    # a margin within twice the spread is a close call: to the digit that tells margin and spread apart
    close = Advice(**{**SYNC.__dict__, "synchronous": False, "method": "xpipe", "options": (), "value": 46.680819,
                      "spread": 0.05947, "runner_up_value": 47.085416, "runner_up_spread": 0.398569,
                      "margin": -0.404597})
    assert ("(margin -0.405, lower is better, seed spread 0.399: only just beyond it, so another seed could make "
            "it a tie;") in close.describe()


def test_a_runner_up_better_on_the_mean_within_the_spread_is_said_so():
    # the synchronous pipeline is recommended where no asynchronous method beats it beyond the
    # seed spread, even where one has the better mean: the text must not call it the best model
    close = Advice(**{**SYNC.__dict__, "value": 58.5, "spread": 0.5, "margin": 0.5})
    assert close.describe() == (
        "lm, N = 4: in the same time, use the synchronous pipeline (zb-h1, M = 16) with nadam: test perplexity "
        "58.5 ± 0.5 over 3 seeds. pipedream-2bw with muon 58.0 is 0.5 lower on the mean, within the seed spread "
        "(1.0): no asynchronous method is better beyond it, and the synchronous pipeline trains the model "
        "non-pipelined training does (the equal-time study (docs/results.md)). To train it: " + SYNC.command())
    higher = Advice(**{**ASYNC.__dict__, "synchronous": True, "method": "zb-h1", "options": (), "value": 0.88,
                       "margin": -0.01, "runner_up": "xpipe with momentum"})
    assert "xpipe with momentum 89.00 is 1.00 better on the mean, within the seed spread (2.00)" in higher.describe()
    assert "gives the best model" not in higher.describe() and "gives the best model" in ASYNC.describe()


def test_bleu_is_higher_is_better_and_written_as_bleu():
    # translation's entry: the winner's mean ahead of the runner-up's is "the best model", not a
    # runner-up "lower on the mean" (BLEU, as accuracy and unlike perplexity, is higher-is-better)
    bleu = Advice(task="translation", stages=8, method="zb-h1", synchronous=True, microbatches=8, options=(),
                  optimizer="adamw", lr=0.004, metric="bleu", value=15.4, spread=0.35, seeds=3,
                  runner_up="pipeoptim-2bw with adamw", runner_up_value=14.8, runner_up_spread=0.3, margin=0.6)
    assert ("the synchronous pipeline (zb-h1, M = 8) with adamw gives the best model: test BLEU 15.4 ± 0.3 over "
            "3 seeds; next pipeoptim-2bw with adamw 14.8 (margin +0.6, seed spread 0.3: only just beyond it") \
        in bleu.describe()
    # ahead by no more than the spread: a tie on these seeds, not "beyond it"
    tied = Advice(**{**bleu.__dict__, "runner_up_value": 14.93, "runner_up_spread": 0.55, "margin": 0.47})
    assert "(margin +0.5, seed spread 0.6: within it, a tie on these seeds; the equal-time" in tied.describe()
    behind = Advice(**{**bleu.__dict__, "value": 14.6, "margin": -0.2})
    assert "pipeoptim-2bw with adamw 14.8 is 0.2 better on the mean, within the seed spread (0.3)" in behind.describe()


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


NOT_FINISHED = ("The study is still running for these (`study/study3.py --plan` says how far); until it "
                "has finished, use a synchronous pipeline: at equal updates every asynchronous method ended "
                "behind it (the second study, below in the same file).")


def test_the_readme_says_what_the_package_recommends():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- advice: pipeoptim.lab.tasks.advice.ADVICE", "<!-- /advice -->"
    block = readme[readme.index(start):readme.index(end)].split("\n", 1)[1]
    bullets = [b.replace("\n  ", " ").strip() for b in block.split("\n- ") if b.strip()]
    bullets[0] = bullets[0].removeprefix("- ")
    if not advice_module.ADVICE:
        assert len(bullets) == 1 and bullets[0].startswith("No finished recommendation yet")
    else:  # an entry per finished (task, N), then what is still running, if anything
        entries = [entry.describe() for entry in advice_module.ADVICE.values()]
        assert bullets[:len(entries)] == entries
        rest = sorted({"image", "sentiment", "lm"} - {task for task, _ in advice_module.ADVICE})
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
