"""Issue 49, finding 7: a plan for a model of your own, as a library gives it. ``pipeoptim.plan``
and ``pipeoptim plan --model-fn`` trace a transformers GPT-2 (a dict batch with labels, no
loss_fn: the model's own loss), cut it at its blocks, predict every method and micro-batch count
and recommend one by the rule for an unstudied model; the Pipeline runs the recommendation."""
from __future__ import annotations

import itertools

import json
import textwrap

import pytest
import torch

T = pytest.importorskip("transformers")

SOURCE = textwrap.dedent('''
    import torch
    import transformers as T


    def build():
        torch.manual_seed(0)
        config = T.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        ids = torch.randint(0, 100, (8, 32))
        return T.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}
''')
UNITS = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
         "transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
QUICK = dict(stages=2, batches=8, warmup=1, repeats=2, max_rounds=3)


def run(argv):
    """``pipeoptim ARGV`` with its errors raised (main prints them and returns 2)."""
    from pipeoptim.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def gpt2():
    namespace: dict = {}
    exec(SOURCE, namespace)
    return namespace["build"]()


def test_pipeoptim_plan_plans_a_transformers_gpt2_and_the_pipeline_runs_it():
    import pipeoptim

    model, batch = gpt2()
    plan = pipeoptim.plan(model, batch, methods=["gpipe", "1f1b-flush", "zb-h1", "interleaved", "pipedream"],
                          micro_batches=[1, 2], **QUICK)
    assert plan["model"] == "GPT2LMHeadModel" and plan["batch_size"] == 8
    assert plan["units"] == {"traced": True, "count": 9, "own_loss": True, "cut_points": UNITS}
    assert sum(plan["partition"]) == 9 and len(plan["partition"]) == 2
    assert plan["split_points"] == [UNITS[plan["partition"][0]]]
    # 9 candidates: 4 per M (gpipe, 1f1b-flush, zb-h1, pipedream), interleaved at M = 2 only
    assert len(plan["candidates"]) == 9
    reasons = {(s["method"], s["microbatches"]): s["reason"] for s in plan["skipped"]}
    assert list(reasons) == [("interleaved", 1)]
    assert reasons[("interleaved", 1)] == ("interleaved needs micro-batches that are a multiple of the stages "
                                           "(1, 2 stages)")
    interleaved = next(c for c in plan["candidates"] if c["method"] == "interleaved")
    assert len(interleaved["partition"]) == 4 and interleaved["split_points"] == [  # 2 stages x 2 pieces
        UNITS[k] for k in itertools.accumulate(interleaved["partition"][:-1])]
    for c in plan["candidates"]:
        assert c["samples_per_second"] > 0 and c["processes"] == 2 and c["stage_costs"] == "measured"
        assert c["speedup"] == pytest.approx(c["samples_per_second"] / plan["reference"]["samples_per_second"])
        assert c["reachable"] == (c["speedup"] <= 2.0)
    # the rule for an unstudied model: the fastest reachable synchronous candidate (2 % tie)
    fastest = max(c["samples_per_second"] for c in plan["candidates"] if c["synchronous"] and c["reachable"])
    assert plan["recommendation"]["synchronous"] and plan["predicted"]["samples_per_second"] >= 0.98 * fastest
    assert plan["recommendation"]["notes"][0] == ("a model of your own: no study measured the updates the "
                                                  "asynchronous methods need on it.")
    assert plan["recommendation"]["rule"].startswith("the fastest synchronous candidate (predicted samples/s)")
    assert plan["measurement"]["rounds"] in (2, 3) and len(plan["measurement"]["spread"]) >= 3
    assert plan["pipeline"] == {"method": plan["method"], "stages": 2, "partition": plan["partition"],
                                "micro_batches": plan["microbatches"]}
    # what the plan says runs: one step of the Pipeline with its keyword arguments, the model's own loss
    pipe = pipeoptim.Pipeline(model, **plan["pipeline"], optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    losses = pipe.step(batch) + pipe.flush()
    with torch.no_grad():
        expected = model(**batch).loss.item()
    assert len(losses) == 1 and float(losses[0]) == pytest.approx(expected, rel=1e-4)


def test_plan_model_fn_on_the_command_line(tmp_path, capsys):
    from pipeoptim.lab.planner import load_plan

    (tmp_path / "my_gpt.py").write_text(SOURCE)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model-fn", f"{tmp_path / 'my_gpt.py'}:build", "--stages", "2", "--micro-batches", "2",
            "--methods", "gpipe,zb-h1,pipedream", "--warmup", "1", "--repeats", "2", "--max-rounds", "3",
            "--batches", "8", "--threads", "1", "--out", str(out)]
    assert run(argv) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert ("your model / GPT2LMHeadModel: 2 stages, batch 8, cpu, 1 thread(s)\n"
            f"traced into 9 units, beginning at: {', '.join(UNITS)}\n") in text
    assert (plan["task"], plan["model"], plan["model_class"]) == (None, None, "GPT2LMHeadModel")
    assert plan["study"]["covered"] is False and plan["settings"]["optimizer"] == "adamw"
    assert [c["method"] for c in plan["candidates"]] == ["gpipe", "zb-h1", "pipedream"]
    assert plan["method"] in ("gpipe", "zb-h1")
    assert (f"recommended: {plan['method']} with 2 micro-batch(es), partition {plan['partition']} (stages begin at "
            f"{plan['split_points'][0]})") in text
    call = (f"Pipeline(model, method={plan['method']!r}, stages=2, partition={plan['partition']}, micro_batches=2, "
            f"optimizer=...)")  # the model computes its loss from the batch's labels: no loss_fn to give
    assert plan["units"]["own_loss"] and text.rstrip().endswith(f"(run it: {call})")
    # the plan file is not pipeoptim train's
    with pytest.raises(ValueError, match=r"is of a model of your own \(pipeoptim plan --model-fn\), which "
                                         r"pipeoptim train does not build: run it with Pipeline\(model, "):
        load_plan(out)


@pytest.mark.parametrize("argv, message", [
    (["--model-fn", "nothing"], "--model-fn 'nothing' must be MODULE:FUNCTION or FILE.py:FUNCTION"),
    (["--model-fn", "missing.py:build"], "--model-fn: no file missing.py; give FILE.py:FUNCTION"),
    (["--model-fn", "no_such_module_here:build"], "--model-fn: cannot import no_such_module_here"),
    (["--model-fn", "json:build"], "--model-fn: json has no function build; define def build"),
    (["--model-fn", "json:dumps", "--task", "lm"], "--model-fn plans your own model on the batch its function "
                                                      "returns; drop --task"),
    (["--model-fn", "json:dumps", "--model", "mlp", "--limit", "9"], "drop --model, --limit"),
])
def test_model_fn_mistakes_are_one_line_naming_the_fix(argv, message, tmp_path):
    with pytest.raises(ValueError, match=message) as info:
        run(["plan", *argv, "--out", str(tmp_path / "p.json")])
    assert "\n" not in str(info.value)


def test_a_function_returning_something_else_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("def build():\n    return 3\n")
    with pytest.raises(ValueError, match=r"--model-fn: build\(\) returned int; return \(model, batch\) or "
                                         r"\(model, batch, loss\)"):
        run(["plan", "--model-fn", f"{tmp_path / 'bad.py'}:build", "--out", str(tmp_path / "p.json")])


def test_a_model_with_no_loss_and_no_loss_fn_is_refused():
    import pipeoptim

    model, batch = gpt2()
    with pytest.raises(ValueError, match=r"a dict mini-batch with keys \['input_ids'\] has no 'labels': add the "
                                         r"labels as batch\['labels'\]"):
        pipeoptim.plan(model, {"input_ids": batch["input_ids"]}, stages=2)


def test_a_tasks_traced_model_is_planned_and_its_plan_file_read_by_train(tmp_path):
    """lm's gpt-tied-small is a module the Pipeline traces (tied head): plan used to refuse it, and
    interleaved on it."""
    from pipeoptim.errors import MissingDataError
    from pipeoptim.lab.planner import load_plan

    out = tmp_path / "plan.json"
    argv = ["plan", "--task", "lm", "--model", "gpt-tied-small", "--stages", "2", "--limit", "64", "--micro-batches",
            "2", "--methods", "gpipe,zb-h1,interleaved", "--stage-timing", "profile", "--scaling", "linear",
            "--warmup", "0", "--repeats", "1", "--batches", "4", "--threads", "1", "--json", "--out", str(out)]
    try:
        assert run(argv) == 0
    except MissingDataError:
        pytest.skip("the lm task's data is not installed")
    plan = json.loads(out.read_text())
    assert plan["units"]["traced"] and plan["units"]["count"] == len(plan["units"]["cut_points"])
    assert sum(plan["partition"]) == plan["units"]["count"] and plan["method"] in ("gpipe", "zb-h1", "interleaved")
    assert plan["skipped"] == []  # interleaved cuts the traced model into 2 stages x 2 pieces (issue 62)
    assert [len(c["partition"]) for c in plan["candidates"]] == [2, 2, 4]
    assert load_plan(out) == {"task": "lm", "model": "gpt-tied-small", "batch_size": 32, "stages": 2,
                              "partition": plan["partition"], "method": plan["method"], "micro_batches": 2}
