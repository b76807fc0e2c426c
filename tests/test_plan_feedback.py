"""The planner's candidates with error feedback (``pipeoptim-2bw+ef``): named as the study names
them, priced with the measured cost (time x FEEDBACK_TIME_RATIO, two more weight copies per
stage), matched to the study's ratios by their options, and carried into the plan file."""
from __future__ import annotations

import json

import pytest

from pipeoptim.lab.planner import load_plan, pipeline_call
from pipeoptim.methods import feedback_variants, split_variant, variant_name
from pipeoptim.recommendation import recommend, try_in_code
from pipeoptim.throughput import FEEDBACK_TIME_RATIO, predict
from test_planner import synthetic


def test_a_variant_name_is_a_method_and_its_options():
    assert split_variant("pipeoptim-2bw+ef") == ("pipeoptim-2bw", {"error_feedback": True})
    assert split_variant("zb-h1") == ("zb-h1", {})
    assert variant_name("pipedream-2bw", {"error_feedback": True}) == "pipedream-2bw+ef"
    assert variant_name("pipedream-2bw", {"error_feedback": False}) == "pipedream-2bw"
    assert feedback_variants() == ["pipedream-2bw+ef", "pipeoptim-2bw+ef", "pipeoptim-2bw+ef+aware"]
    with pytest.raises(ValueError, match=r"'zb-h1\+ef': \+ef \(error feedback\) applies to pipedream-2bw\+ef, "
                                         r"pipeoptim-2bw\+ef$"):
        split_variant("zb-h1+ef")
    # the prediction aware of the feedback (the study's pipeoptim-2bw+ef+aware): pipeoptim-2bw's only
    aware = {"error_feedback": True, "predict_feedback": True}
    assert split_variant("pipeoptim-2bw+ef+aware") == ("pipeoptim-2bw", aware)
    assert variant_name("pipeoptim-2bw", aware) == "pipeoptim-2bw+ef+aware"
    assert variant_name("pipeoptim-2bw", {"error_feedback": False, "predict_feedback": True}) == "pipeoptim-2bw"
    with pytest.raises(ValueError, match=r"'pipedream-2bw\+ef\+aware': \+ef\+aware \(error feedback, the prediction "
                                         r"aware of it\) applies to pipeoptim-2bw\+ef\+aware"):
        split_variant("pipedream-2bw+ef+aware")
    from pipeoptim.lab.plan_targets import methods_flags

    assert methods_flags(["zb-h1", "pipeoptim-2bw+ef+aware"]) == ("--methods zb-h1,pipeoptim-2bw --error-feedback "
                                                                  "--predict-feedback")
    assert methods_flags(["zb-h1", "pipeoptim-2bw+ef"]) == "--methods zb-h1,pipeoptim-2bw --error-feedback"
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        split_variant("magic")


def test_error_feedback_is_priced_with_its_measured_time_and_its_two_buffers():
    prof = synthetic([0.001] * 4, [0.002] * 4, params=[100] * 4)
    plain = predict("pipeoptim-2bw", prof, [1, 1, 1, 1], microbatches=4, batches=6, batch_size=8)
    fed = predict("pipeoptim-2bw", prof, [1, 1, 1, 1], microbatches=4, batches=6, batch_size=8,
                  options={"error_feedback": True})
    assert FEEDBACK_TIME_RATIO == 1.0194
    assert fed["makespan_seconds"] == pytest.approx(plain["makespan_seconds"] * 1.0194, rel=1e-12)
    assert fed["samples_per_second"] == pytest.approx(plain["samples_per_second"] / 1.0194, rel=1e-12)
    assert (fed["variant"], fed["options"], fed["feedback_time_ratio"]) == ("pipeoptim-2bw+ef",
                                                                           {"error_feedback": True}, 1.0194)
    assert (plain["variant"], plain["options"], plain["feedback_time_ratio"]) == ("pipeoptim-2bw", {}, 1.0)
    # the previous update and the scratch copy: 2 more weight copies on every stage
    assert [m["weight_versions"] for m in plain["memory"]] == [3, 3, 3, 1]
    assert [m["weight_versions"] for m in fed["memory"]] == [5, 5, 5, 3]
    assert fed["max_stage_memory"] - plain["max_stage_memory"] == 2 * 100


def test_the_rule_names_a_variant_and_the_code_to_try_it():
    rows = [{"method": "pipeoptim-2bw", "variant": name, "synchronous": False, "microbatches": 4,
             "samples_per_second": 100.0, "max_stage_memory": 10, "fits": True}
            for name in ("pipeoptim-2bw", "pipeoptim-2bw+ef")]
    assert recommend(rows, prefer="pipeoptim-2bw+ef")["variant"] == "pipeoptim-2bw+ef"
    assert recommend(rows, order=["pipeoptim-2bw+ef", "pipeoptim-2bw"])["variant"] == "pipeoptim-2bw+ef"
    assert recommend(rows)["variant"] == "pipeoptim-2bw"  # tied: the earlier one
    assert try_in_code(["zb-h1", "pipeoptim-2bw+ef"]) == (
        "train them on your data for the same time and compare the models (pipeoptim.train with method='zb-h1' "
        "and method='pipeoptim-2bw', error_feedback=True)")


def test_a_plan_with_error_feedback_sets_it_for_train_and_the_pipeline(tmp_path):
    plan = {"format": "pipeoptim-plan", "version": 1, "task": "image", "model": "vgg", "batch_size": 64,
            "stages": 2, "partition": [3, 3], "method": "pipeoptim-2bw", "microbatches": 2,
            "options": {"error_feedback": True},
            "pipeline": {"method": "pipeoptim-2bw", "stages": 2, "partition": [3, 3], "micro_batches": 2,
                         "error_feedback": True}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert load_plan(path) == {"task": "image", "model": "vgg", "batch_size": 64, "stages": 2, "partition": [3, 3],
                               "method": "pipeoptim-2bw", "micro_batches": 2, "error_feedback": True}
    assert pipeline_call(plan) == ("Pipeline(model, method='pipeoptim-2bw', stages=2, partition=[3, 3], "
                                   "micro_batches=2, error_feedback=True, optimizer=..., loss_fn=...)")
    path.write_text(json.dumps(dict(plan, method="zb-h1")))
    with pytest.raises(ValueError, match=r"options must be options zb-h1 takes, with their values \(none\)"):
        load_plan(path)


def test_image_with_adamw_recommends_what_the_advice_does_pipeoptim_2bw_with_error_feedback(monkeypatch):
    """Where the study's advice for image at N = 8 is pipeoptim-2bw with error feedback and AdamW
    (installed here: the committed advice fills as the confirmation finishes): it reached the target
    in 2000 updates over its 3 seeds (2100, 2100 and 1800: ratio 0.952381 of the synchronous
    pipeline's 2100), the plain one in 2400 (1.14286), which the advice does not name: it may not be
    recommended."""
    from pipeoptim.lab.plan_targets import notes
    from test_plan_targets import IMAGE_EF, cand, plan, use_advice

    use_advice(monkeypatch, IMAGE_EF)

    def fed(samples_per_second):
        return dict(cand("pipeoptim-2bw", 8, samples_per_second), options={"error_feedback": True},
                    variant="pipeoptim-2bw+ef")

    cands = [cand("zb-h1", 8, 6400), cand("pipeoptim-2bw", 8, 8000), fed(8000)]
    study, best, said = plan(cands, optimizer="adamw")
    zb, plain, ef = cands
    assert (study["setting"], study["target_updates"], study["advised_variant"]) == (
        "image, adamw, N = 8", 2100.0, "pipeoptim-2bw+ef")
    assert (ef["updates_ratio"], ef["ratio_source"]) == (0.952381, "pipeoptim-2bw+ef: 2000 updates, 3 seed(s)")
    assert ef["time_to_target_seconds"] == pytest.approx(0.008 * 2100 * 0.952381)
    assert plain["updates_ratio"] == 1.14286 and plain["ratio_source"] == "pipeoptim-2bw: 2400 updates, 3 seed(s)"
    assert [c["eligible"] for c in cands] == [True, False, True]
    assert best is ef and said[2:] == []
    # within the 2 % tie (21.3 s against 21.0 s): the study's method, the better model at equal time
    cands = [cand("zb-h1", 8, 6400), fed(6000)]
    assert plan(cands, optimizer="adamw")[1] is cands[1]
    # where this profile predicts it later: 64 / 5600 s x 2000 = 22.9 s against zb-h1's 21 s
    # (and pipeoptim at M = 2, XPipe's computation, sooner still, is not the advice: 4 ms x 1.28571 x 2100)
    cands = [cand("zb-h1", 8, 6400), fed(5600), cand("pipeoptim", 2, 16000)]
    study, best, said = plan(cands, optimizer="adamw")
    assert best["method"] == "zb-h1"
    assert said[2:] == [
        "the study's pipeoptim-2bw+ef is predicted to reach the target later on this profile (22.9 s against 21.0 s), "
        "so the synchronous pipeline is recommended",
        "pipeoptim (M = 2) is predicted to reach the target sooner (10.8 s against 21.0 s), but at equal time the "
        "study's advice here is pipeoptim-2bw+ef with adamw, not it, so it is not recommended; to see it on your "
        "task: pipeoptim compare --task image --model vgg --stages 8 --optimizer adamw --methods zb-h1,pipeoptim"]
    # timings that were not stable may be why: the plan says so
    said = notes(study, cands, best, task="image", model="vgg", stages=8, optimizer="adamw", stable=False)
    assert said[2].endswith("so the synchronous pipeline is recommended; the timings were not stable (the machine's "
                            "other work): plan again on a quieter machine, with --threads 1 per stage or more "
                            "--repeats, before trusting the difference")
    # the command that compares a +ef candidate names its method and the switch
    from pipeoptim.lab.plan_targets import compare_command

    assert compare_command("image", "vgg", 8, "adamw", ["zb-h1", "pipeoptim-2bw+ef"]) == (
        "pipeoptim compare --task image --model vgg --stages 8 --optimizer adamw --methods zb-h1,pipeoptim-2bw "
        "--error-feedback")


def test_compare_names_a_run_with_error_feedback_as_plan_does():
    from pipeoptim.cli.compare import format_table

    row = {"method": "pipeoptim-2bw", "options": {"error_feedback": True}, "final_metric": 0.9, "best_metric": 0.9,
           "final_loss": 0.3, "weight_copies": [5, 3], "samples_per_second": 100.0}
    lines = format_table([row, dict(row, options={})], "accuracy").splitlines()
    assert lines[2].startswith("pipeoptim-2bw+ef  0.9000") and lines[3].startswith("pipeoptim-2bw     0.9000")


def test_every_variant_the_advice_names_is_a_default_candidate_of_plan():
    """The committed advice (as many entries as the confirmation has finished, maybe none) and the
    made-up entries the plan tests install: plan predicts every variant they name by default."""
    from pipeoptim.lab.tasks.advice import ADVICE
    from pipeoptim.plan_defaults import DEFAULT_METHODS
    from test_plan_targets import ADVICE_ENTRIES

    entries = list(ADVICE.values()) + list(ADVICE_ENTRIES)
    named = {entry.variant() for entry in entries}
    assert {"zb-h1", "xpipe", "pipeoptim-2bw+ef"} <= named  # never vacuous, whatever the table holds
    assert sorted(named - set(DEFAULT_METHODS)) == []


def test_the_plan_tables_widen_their_method_column_to_the_longest_name():
    from pipeoptim.lab.planner import name_width

    short = {"candidates": [{"method": "zb-h1", "variant": "zb-h1"}], "skipped": [{"method": "gpipe"}]}
    assert name_width(short) == 16
    aware = {**short, "candidates": short["candidates"] + [{"method": "pipeoptim-2bw",
                                                            "variant": "pipeoptim-2bw+ef+aware"}]}
    assert name_width(aware) == len("pipeoptim-2bw+ef+aware") == 22
