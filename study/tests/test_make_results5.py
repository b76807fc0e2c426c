"""study/make_results5.py, issue 41's section of the equal-time report: the translation
cell's rows and budgets merged into the study's, the paper's two claims read on translation by
the study's verdict rule (hand-made rows whose every number is known), and the advice waiting
for every planned run of the cell."""
from __future__ import annotations

import json

import pytest

from study import make_results3_arith, make_results5

VARIANTS = ("xpipe", "pipeoptim", "pipeoptim-2bw", "pipedream-2bw", "spectrain", "pipeoptim-2bw+ef")


@pytest.fixture(scope="module")
def report():
    return make_results5


def times():
    """Budgets as study3_times writes them (a +ef variant without its own: its base's)."""
    variants = {v: {"seconds_per_batch": 0.1} for v in VARIANTS if "+" not in v}
    budget = {"fastest": {"schedule": "zb-h1", "microbatches": 8}, "seconds_per_batch": 0.09,
              "budget_seconds": 110.0, "updates": {v: 1100 for v in variants}}
    cell = {"stages": {"8": {"variants": variants, "budget": budget}}}
    return {"format": "pipeoptim-study3-times", "version": 1, "cells": {"translation": {"adamw": cell, "muon": cell}}}


def row(variant, seed, final, lr=0.002, phase=None, updates=None):
    return {"task": "translation", "optimizer": "adamw", "variant": variant, "stages": 1 if variant == "sequential" else 8,
            "lr": lr, "seed": seed, "phase": phase or ("tune" if seed == 0 else "seeds"), "until": None,
            "updates": updates or (1224 if variant == "sequential" else 1100), "final_metric": final,
            "validation_metric": final, "evaluations": [], "diverged": None, "metric": "bleu",
            "higher_is_better": True, "lr_source": "the cell's grid"}


def test_the_claims_on_translation_by_the_verdict_rule(report):
    arith = make_results3_arith
    rows = [row("sequential", 0, 15.0, phase="tune"), row("sequential", 1, 16.0, phase="reference"),
            row("xpipe", 0, 14.8), row("xpipe", 1, 15.4),          # 15.1 ± 0.42: ties 15.5 ± 0.71
            row("pipeoptim", 0, 9.0), row("pipeoptim", 1, 9.2),    # 9.1: loses
            row("pipedream-2bw", 0, 8.0), row("pipedream-2bw", 1, 8.4),
            row("spectrain", 0, 12.0)]                             # one seed: no spread of its own
    settings = arith.settings_of(rows, times())
    lines = report.claim_lines(settings)
    # Welch's two-sided test at 0.05 on 2 seeds a side: 0.9 ahead of PipeDream-2BW at spreads 0.1
    # and 0.3 is p 0.09, a tie (the old rule, beyond the larger spread, called it a win); SpecTrain's
    # one seed is untested
    assert lines[0] == ("  - adamw, pipeoptim (M = 1): loses to GPipe (the synchronous pipeline) (-6.4 BLEU, Welch p "
                        "0.04); ties PipeDream-2BW (+0.9 BLEU, Welch p 0.09); untested against SpecTrain (-2.9 BLEU, "
                        "one seed: no test)")
    assert lines[1] == ("  - adamw, xpipe (PipeOptim at M = 2): ties GPipe (the synchronous pipeline) (-0.4 BLEU, "
                        "Welch p 0.58); beats PipeDream-2BW (+6.9 BLEU, Welch p 0.00); untested against SpecTrain "
                        "(+3.1 BLEU, one seed: no test)")
    assert report.claim_lines([]) == ["  - not in yet"]
    # the two claims counted: against GPipe one tie (xpipe) and one loss (pipeoptim): does not
    # hold; against every rival 1 win, 2 ties, 1 loss, 2 untested: does not hold
    assert report.claim_summary(settings) == [
        '  - "PipeOptim trains as well as synchronous training": does not hold on translation (0 wins, 1 tie, '
        '1 loss of 2 against the synchronous pipeline).',
        '  - "PipeOptim beats GPipe, PipeDream-2BW and SpecTrain": does not hold on translation (1 win, 2 ties, '
        '1 loss, 2 untested of 6).', ""]
    assert report.claim_summary([]) == []


def test_a_verdict_on_single_seeds_is_untested(report):
    arith = make_results3_arith
    rows = [row("sequential", 0, 15.0, phase="tune"), row("xpipe", 0, 15.0), row("spectrain", 0, 14.5)]
    lines = report.claim_lines(arith.settings_of(rows, times()))
    assert lines == ["  - adamw, xpipe (PipeOptim at M = 2): untested against GPipe (the synchronous pipeline) (+0.0 "
                     "BLEU, one seed: no test); untested against SpecTrain (+0.5 BLEU, one seed: no test)"]
    summary = report.claim_summary(arith.settings_of(rows, times()))
    assert summary[0] == ('  - "PipeOptim trains as well as synchronous training": cannot be told yet (one seed: '
                          'untested) on translation (0 wins, 0 ties, 0 losses, 1 untested of 1 against the '
                          'synchronous pipeline).')


def test_the_cell_joins_the_study_and_its_advice_waits_for_every_run(report, tmp_path):
    study_rows, study_times = [{"task": "image"}], {"cells": {"image": {}}}
    assert report.with_translation(study_rows, study_times, tmp_path) == (study_rows, study_times)  # nothing yet
    (tmp_path / "times.json").write_text(json.dumps(times()))
    (tmp_path / "runs.jsonl").write_text(json.dumps(row("sequential", 0, 15.0, lr=0.002)) + "\n")
    rows, merged = report.with_translation(study_rows, study_times, tmp_path)
    assert len(rows) == 2 and set(merged["cells"]) == {"image", "translation"}
    assert "translation" not in study_times["cells"]  # the study's own left as it was
    assert merged["cells"]["translation"]["adamw"]["stages"]["8"]["budget"]["updates"]["pipeoptim-2bw+ef"] == 1100
    runs = report.planned(tmp_path)
    assert sum(r.status == "done" for r in runs) == 1 and not report.complete(tmp_path)
    assert not report.complete(None)
    text = "\n".join(report.section_lines([], tmp_path))
    assert "**The cell is still running: 1 of" in text and "## Issue 41: translation at equal time" in text
