"""study/make_results1.py, the first study's report: its scoring (a diverged run scores 0), epochs
to the target, the diagnostic's ratio per stage and the figure, on hand-made rows; and
docs/results-v1.md being exactly what the committed rows (study/results/study/) give."""
from __future__ import annotations

import pytest

from study import make_results1 as report
from study.common import RESULTS, ROOT


def _row(method, seed, final, diverged=None, metric=(0.5, 0.7, 0.8)):
    return {"task": "image", "optimizer": "momentum", "stages": 4, "method": method, "seed": seed, "lr": 0.01,
            "sweep": False, "metric": "accuracy", "final_metric": final, "diverged": diverged,
            "best_metric": max(metric), "final_loss": 0.4, "weight_copies": [2, 2, 1, 1],
            "epochs_detail": [{"epoch": e, "metric": m} for e, m in enumerate(metric)],
            "losses": [1.0, 0.8, 0.6, 0.5], "prediction_error": [
                {"probes": 3, "prediction_error": 1e-3, "staleness_error": 4e-3}, {"probes": 0}]}


def test_scores_epochs_to_target_and_the_diagnostic():
    assert report.score(_row("pipeoptim", 0, 0.8)) == 0.8
    assert report.score(_row("pipeoptim", 0, None, diverged="loss nan")) == 0.0  # useless: the worst
    assert report.time_to_target(_row("pipeoptim", 0, 0.8), 0.7, True) == 2  # reached after epoch 2
    assert report.time_to_target(_row("pipeoptim", 0, 0.8), 0.9, True) is None
    assert report.time_to_target(_row("pipeoptim", 0, 0.8, diverged="nan"), 0.1, True) is None
    errors = report.stage_errors([_row("pipeoptim", 0, 0.8), _row("pipeoptim", 1, 0.8)])
    assert errors == [{"stage": 0, "prediction": 1e-3, "staleness": 4e-3, "ratio": pytest.approx(0.25)}]


def test_a_settings_table_and_figure(tmp_path):
    rows = [_row("sequential", 0, 0.80), _row("sequential", 1, 0.82), _row("pipeoptim", 0, 0.84),
            _row("pipeoptim", 1, None, diverged="loss nan")]
    st = report.Setting("image", "momentum", 4, rows, {})
    assert st.final("sequential") == pytest.approx((0.81, 0.0141421356))
    assert st.final("pipeoptim") == pytest.approx((0.42, 0.5939696962)) and st.diverged("pipeoptim") == 1
    table = report.table(st)
    assert table[0].startswith("| method | final accuracy | best accuracy | final training loss | epochs to 76.95 ")
    # the target is 95 % of sequential's 81.00 (76.95): reached after epoch 3; the diverged seed never
    assert table[3] == "| pipeoptim | 42.00 ± 59.40 (1 of 2 diverged) | 80.00 ± 0.00 | 0.400 ± 0.000 | 3, - | 2,2,1,1 | 1 | - |"
    assert report.curves(st, None) == "image-momentum-N4.png"  # named, not drawn
    assert report.curves(st, tmp_path) == "image-momentum-N4.png" and (tmp_path / "image-momentum-N4.png").stat().st_size


def test_docs_results_v1_is_what_the_committed_rows_give(tmp_path):
    text = report.generate(RESULTS / "study", tmp_path, plots=False)
    assert text == (ROOT / "docs" / "results-v1.md").read_text(), \
        "docs/results-v1.md is out of date: run .venv/bin/python -m study.make_results1"
    assert "324 of 324 runs" in text and text.count("![") == 12  # every setting's figure (docs/results/)
    assert all((ROOT / "docs" / "results" / f"{task}-{opt}-N{n}.png").exists() for task in
               ("image", "sentiment", "translation") for opt in ("momentum", "adam") for n in (4, 8))
