"""pipeoptim.lab.plan_targets: the planner's time to target (predicted seconds per mini-batch x
the study's updates to the target) on made-up candidates against the package's real table of
updates to the target (UPDATES_TO_TARGET, itself held to the committed rows in test_make_results3.py)
and made-up advice (the tests install the entries they need: the committed ADVICE fills only as
the confirmation on fresh seeds finishes), the recommendation rule, and what the plan says where
no study covers the case."""
from __future__ import annotations

import pytest

from pipeoptim.lab.plan_targets import annotate, compare_command, notes
from pipeoptim.lab.tasks import advice as advice_module
from pipeoptim.lab.tasks.advice import Advice
from pipeoptim.recommendation import recommend
from pipeoptim.methods import get_method

BATCHES = 10

# Advice entries as the confirmation on fresh seeds writes them (made up; Welch's interval and the
# one-sided p, Holm-corrected over the four tasks, from the means, spreads and seeds given)
#: image at N = 8: asynchronous, pipeoptim-2bw with error feedback and AdamW, better by the test
IMAGE_EF = Advice(task="image", stages=8, method="pipeoptim-2bw", synchronous=False, microbatches=8,
                  options=(("error_feedback", "True"),), optimizer="adamw", lr=0.002, metric="accuracy",
                  value=0.9166, spread=0.0021, seeds=3, runner_up="the synchronous pipeline with adamw",
                  runner_up_value=0.9082, runner_up_spread=0.0018, runner_up_seeds=3, margin=0.0084, low=0.0039,
                  high=0.0129, p_value=0.013, verdict="better")
#: lm at N = 8: asynchronous, xpipe (M = 2) with Muon, a lower perplexity by the test
LM_XPIPE = Advice(task="lm", stages=8, method="xpipe", synchronous=False, microbatches=2, options=(),
                  optimizer="muon", lr=0.02, metric="perplexity", value=46.41, spread=0.13, seeds=3,
                  runner_up="the synchronous pipeline with muon", runner_up_value=46.98, runner_up_spread=0.14,
                  runner_up_seeds=3, margin=-0.57, low=-0.88, high=-0.26, p_value=0.010, verdict="better")
#: sentiment at N = 8: synchronous (zb-h1, its fastest schedule) with AdamW; the asynchronous arm
#: (xpipe) not better by the test
SENTIMENT_SYNC = Advice(task="sentiment", stages=8, method="zb-h1", synchronous=True, microbatches=8, options=(),
                        optimizer="adamw", lr=0.008, metric="accuracy", value=0.7524, spread=0.0124, seeds=5,
                        runner_up="xpipe with adamw", runner_up_value=0.7596, runner_up_spread=0.0083,
                        runner_up_seeds=5, margin=-0.0072, low=-0.0230, high=0.0086, p_value=0.32,
                        verdict="no detectable difference")
#: every made-up entry (tests/test_plan_feedback.py holds their variants to plan's default candidates too)
ADVICE_ENTRIES = (IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)


def use_advice(monkeypatch, *entries):
    """Make ``entries`` the study's advice: :data:`~pipeoptim.lab.tasks.advice.ADVICE`, the module
    global that ``advice`` (plan's and compare's) and ``advised_lr`` (the lr of a run) read."""
    table = {(e.task, e.stages): e for e in entries}
    monkeypatch.setattr(advice_module, "ADVICE", table)
    return table


def cand(method, m, samples_per_second, batch=64, memory=100):
    """A predicted candidate: ``batch`` / ``samples_per_second`` seconds per mini-batch."""
    return {"method": method, "microbatches": m, "synchronous": get_method(method).synchronous,
            "samples_per_second": samples_per_second, "batches": BATCHES,
            "makespan_seconds": BATCHES * batch / samples_per_second, "max_stage_memory": memory, "fits": True}


def plan(cands, *, task="image", model="vgg", batch_size=64, optimizer="momentum", stages=8):
    study = annotate(cands, task=task, model=model, batch_size=batch_size, optimizer=optimizer, stages=stages)
    best = recommend(cands, prefer=study["advised_variant"], order=[c["method"] for c in cands])
    said = notes(study, cands, best, task=task, model=model, stages=stages, optimizer=optimizer)
    return study, best, said


def test_image_ranks_by_time_to_target_and_recommends_what_the_advice_does(monkeypatch):
    use_advice(monkeypatch, IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)
    # zb-h1: 10 ms per mini-batch x 1900 updates (the synchronous pipeline's to the target, image
    # with momentum at N = 8) = 19 s; pipeoptim at M = 2 (XPipe's computation, 1.34211x the updates):
    # 4 ms x 1.34211 x 1900 = 10.2 s, sooner, yet the study's advice for image is another setting
    # (pipeoptim-2bw with error feedback and AdamW)
    cands = [cand("zb-h1", 8, 6400), cand("gpipe", 8, 4000), cand("pipeoptim", 2, 16000),
             cand("pipedream-2bw", 8, 8000), cand("pipeoptim", 1, 20000)]
    study, best, said = plan(cands)
    zb, gpipe, xpipe_like, twobw, m1 = cands
    assert (study["covered"], study["setting"], study["target_updates"]) == (True, "image, momentum, N = 8", 1900.0)
    assert zb["time_to_target_seconds"] == pytest.approx(19.0)
    assert gpipe["time_to_target_seconds"] == pytest.approx(30.4)
    assert xpipe_like["updates_ratio"] == 1.34211
    assert xpipe_like["time_to_target_seconds"] == pytest.approx(0.004 * 1.34211 * 1900)
    assert xpipe_like["ratio_source"] == "xpipe's runs (the same computation): 2550 updates, 2 seed(s)"
    assert twobw["time_to_target_seconds"] == pytest.approx(0.008 * 1.26316 * 1900)
    assert (m1["updates_ratio"], m1["time_to_target_seconds"], m1["ratio_source"]) == (
        None, None, "the study did not run pipeoptim at M = 1")
    assert [c["eligible"] for c in cands] == [True, True, False, False, False]
    assert (best["method"], best["microbatches"]) == ("zb-h1", 8)
    assert (study["advised_method"], study["advised_variant"]) == ("pipeoptim-2bw", "pipeoptim-2bw+ef")
    assert said[0] == ("ratios of updates to the target: image, momentum, N = 8 of the equal-time study "
                       "(docs/results.md).")
    assert said[1] == "the study's advice: " + IMAGE_EF.describe()
    assert said[1].startswith("the study's advice: image, N = 8: in the same time, pipeoptim-2bw, error_feedback "
                              "True (M = 8) with adamw gives a better model than the synchronous pipeline with adamw")
    assert said[2] == "(that advice is for adamw; this plan is for momentum: --optimizer adamw plans it)"
    assert said[3] == ("pipeoptim (M = 2) is predicted to reach the target sooner (10.2 s against 19.0 s), but at "
                       "equal time the study's advice here is pipeoptim-2bw+ef with adamw, not it, so it is not "
                       "recommended; to see it on your task: pipeoptim "
                       "compare --task image --model vgg --stages 8 --optimizer momentum --methods zb-h1,pipeoptim")


def test_a_task_without_confirmed_advice_says_so_and_recommends_the_synchronous_pipeline(monkeypatch):
    """While the study's confirmation runs, a studied setting has ratios but no advice entry: the
    plan says so (no "advice for None"), recommends the synchronous pipeline, and calls no
    asynchronous candidate eligible however soon it reaches the target."""
    use_advice(monkeypatch)
    cands = [cand("zb-h1", 8, 6400), cand("pipeoptim", 2, 16000)]
    study, best, said = plan(cands)
    assert (study["advised_variant"], best["method"]) == (None, "zb-h1")
    assert [c["eligible"] for c in cands] == [True, False]
    assert "None" not in " ".join(said)
    assert said[1].startswith("the study's advice: The equal-time study (docs/results.md) has no finished "
                              "recommendation for image yet")
    assert said[2].startswith("pipeoptim (M = 2) is predicted to reach the target sooner (10.2 s against 19.0 s), "
                              "but at equal time the study has no confirmed advice here yet, so it is not recommended")


def test_another_depth_takes_the_nearest_studied_one_and_m_equals_n_with_it(monkeypatch):
    use_advice(monkeypatch, IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)
    cands = [cand("zb-h1", 4, 6400), cand("pipedream-2bw", 4, 8000), cand("pipedream-2bw", 8, 8000)]
    study, best, said = plan(cands, stages=4)
    assert study["line"].endswith("(no study at N = 4; the nearest studied depth)")
    assert study["advice"] == "(no study at N = 4; the nearest studied depth) " + IMAGE_EF.describe()
    # the study ran 2BW at M = N: at N = 4 that is M = 4, not M = 8
    assert [c["updates_ratio"] for c in cands] == [1.0, 1.26316, None]
    assert best["method"] == "zb-h1"


def test_where_the_advice_is_asynchronous_the_time_to_target_decides(monkeypatch):
    use_advice(monkeypatch, IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)
    # LM with Muon at N = 8: xpipe gives the better model (the advice); it needs 1.5x the
    # synchronous pipeline's 2000 updates. At 5 ms per mini-batch against 10 ms: 15 s against 20 s
    fast = [cand("zb-h1", 8, 1600, batch=16), cand("xpipe", 2, 3200, batch=16), cand("pipeoptim", 2, 3200, batch=16),
            cand("pipedream-2bw", 8, 2000, batch=16)]
    study, best, said = plan(fast, task="lm", model="gpt-narrow", batch_size=16, optimizer="muon")
    assert [c["time_to_target_seconds"] for c in fast[:3]] == pytest.approx([20.0, 15.0, 15.0])
    assert [c["eligible"] for c in fast] == [True, True, True, False]  # pipeoptim M = 2 is xpipe's computation
    assert fast[3]["ratio_source"] == "pipedream-2bw: never reached (0 of 2 seeds reached it)"
    assert best["method"] == "xpipe"  # tied with pipeoptim M = 2: the study's method
    assert said[2:] == []
    # where this profile predicts xpipe slower to the target: 8 ms x 1.5 x 2000 = 24 s against 20 s
    slow = [cand("zb-h1", 8, 1600, batch=16), cand("xpipe", 2, 2000, batch=16)]
    study, best, said = plan(slow, task="lm", model="gpt-narrow", batch_size=16, optimizer="muon")
    assert best["method"] == "zb-h1"
    assert said[2] == ("the study's xpipe is predicted to reach the target later on this profile (24.0 s against "
                       "20.0 s), so the synchronous pipeline is recommended")
    # with AdamW no asynchronous method reached the target: none may be recommended
    adamw = [cand("zb-h1", 8, 1600, batch=16), cand("xpipe", 2, 6400, batch=16)]
    study, best, _ = plan(adamw, task="lm", model="gpt-narrow", batch_size=16, optimizer="adamw")
    assert adamw[1]["eligible"] is False
    assert adamw[1]["ratio_source"] == "xpipe: never reached (0 of 1 seeds reached it)"
    assert best["method"] == "zb-h1"


@pytest.mark.parametrize("case, line", [
    ({"model": "resnet"}, "the equal-time study (docs/results.md) ran image's model vgg, not resnet: no ratio of "
                          "updates to the target for it (--model vgg plans the studied one)"),
    ({"task": None, "model": None}, "a model of your own: the equal-time study (docs/results.md) has no ratio of "
                                    "updates to the target for it"),
    ({"optimizer": "nadam"}, "the equal-time study (docs/results.md) ran image with adamw, momentum, not nadam: no "
                             "ratio of updates to the target for it"),
    ({"batch_size": 32}, "the equal-time study (docs/results.md) ran image at batch 64, not 32: its ratios of "
                         "updates to the target need not hold (--batch-size 64 plans the studied one)"),
    ({"task": "translation", "model": "transformer"},
     "the equal-time study (docs/results.md) ran translation's model transformer-deep, not transformer: no ratio "
     "of updates to the target for it (--model transformer-deep plans the studied one)"),
    ({"task": "speech", "model": "conformer"},
     "the equal-time study (docs/results.md) did not run speech (it ran image, lm, sentiment, translation): no "
     "ratio of updates to the target for it"),
])
def test_where_no_study_covers_the_case_the_fastest_synchronous_one_and_the_one_to_try(case, line):
    cands = [cand("gpipe", 8, 5000), cand("zb-h1", 8, 6400), cand("pipeoptim", 2, 16000), cand("pipedream", 1, 12000)]
    study, best, said = plan(cands, **case)
    assert study["covered"] is False and study["advice"] is None and said[0] == line + "."
    assert [c["updates_ratio"] for c in cands] == [1.0, 1.0, None, None]
    assert all(c["time_to_target_seconds"] is None for c in cands)
    assert best["method"] == "zb-h1"  # the fastest synchronous one, not pipeoptim at 2.5x its throughput
    task, model = case.get("task", "image"), case.get("model", "vgg")
    assert said[1] == ("so the fastest synchronous candidate is recommended, zb-h1 (M = 8); the fastest asynchronous "
                       "one, pipeoptim (M = 2), predicts 16000 samples/s (2.50x), but what its staleness costs in "
                       "updates is unmeasured here; to try it: "
                       + compare_command(task, model, 8, case.get("optimizer", "momentum"), ["zb-h1", "pipeoptim"]))
    assert len(said) == 2


def test_the_command_to_try():
    assert compare_command("image", "resnet", 4, "momentum", ["zb-h1", "pipeoptim"]) == (
        "pipeoptim compare --task image --model resnet --stages 4 --optimizer momentum --methods zb-h1,pipeoptim")
    assert compare_command(None, None, 4, "adamw", ["zb-h1", "pipeoptim"]) == (
        "train them on your data for the same time and compare the models (pipeoptim.train with method='zb-h1' "
        "and method='pipeoptim')")


def test_recommend_by_time_to_target_its_ties_and_its_fallback():
    def timed(method, seconds, memory=100, m=1, eligible=True):
        return {**cand(method, m, 1000), "time_to_target_seconds": seconds, "max_stage_memory": memory,
                "eligible": eligible}

    rows = [timed("gpipe", 10.0), timed("zb-h1", 9.9, memory=120), timed("xpipe", 9.0)]
    assert recommend(rows, tie=0.0)["method"] == "xpipe"
    assert recommend(rows, tie=0.15)["method"] == "gpipe"          # a tie: synchronous, then less memory
    assert recommend(rows, tie=0.15, prefer="zb-h1")["method"] == "zb-h1"  # the study's method before memory
    assert recommend(rows, tie=0.05)["method"] == "xpipe"          # 10 / 9 is beyond 5 %
    # one that may not be recommended is passed over, however soon it reaches the target
    rows[2]["eligible"] = False
    assert recommend(rows, tie=0.0)["method"] == "zb-h1"
    # none may be (only asynchronous methods asked for): all that fit, by throughput where some lack a time
    only = [{**cand("pipedream", 1, 900), "eligible": False, "time_to_target_seconds": None},
            {**cand("pipeoptim", 1, 1000), "eligible": False, "time_to_target_seconds": None}]
    assert recommend(only)["method"] == "pipeoptim"
    with pytest.raises(ValueError, match="no method fits memory_limit=50 bytes per stage"):
        recommend(rows, memory_limit=50)


def test_the_synchronous_schedule_fastest_here_is_said_to_compute_the_studys_updates(monkeypatch):
    use_advice(monkeypatch, IMAGE_EF, LM_XPIPE, SENTIMENT_SYNC)  # sentiment: the synchronous pipeline, zb-h1
    cands = [cand("zb-h1", 8, 6400), cand("zb-v", 8, 8000)]
    study, best, said = plan(cands, task="sentiment", model="lstm-deep", optimizer="adamw", stages=4)
    assert best["method"] == "zb-v"
    assert said[1] == "the study's advice: (no study at N = 4; the nearest studied depth) " + SENTIMENT_SYNC.describe()
    assert said[2] == ("zb-v (M = 8) computes the updates of the study's zb-h1 (every synchronous schedule computes "
                       "sequential's): it is the fastest synchronous one on this profile")


def test_no_faster_asynchronous_candidate_is_not_one_to_try():
    cands = [cand("zb-h1", 8, 6400), cand("pipedream", 8, 6400)]
    study, best, said = plan(cands, model="resnet")
    assert best["method"] == "zb-h1"
    assert said[1] == ("so the fastest synchronous candidate is recommended, zb-h1 (M = 8); no asynchronous one is "
                       "predicted faster (the fastest, pipedream (M = 8), 6400 samples/s)")
