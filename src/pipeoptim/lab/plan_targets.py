"""Rank a plan's candidates by predicted time to a model as good as synchronous training's, and
recommend one with the equal-time study's voice (:mod:`pipeoptim.lab.planner` calls it).

A candidate's **time to target** is its predicted seconds per mini-batch times the updates it
needs to reach the target (99 % of sequential's validation metric, 101 % for perplexity): the
synchronous pipeline's updates in the study's setting for the task, optimizer and nearest N,
times the method's ratio to them (:mod:`pipeoptim.lab.tasks.updates_to_target`; 1 for a
synchronous method, which computes sequential's updates; None where the study did not run the
method at that micro-batch count, or saw it never reach the target). The recommendation
(:func:`recommend`) takes the shortest among the candidates that may be recommended: every
synchronous one, and an asynchronous one only where the study's advice for the task and depth
(:data:`pipeoptim.lab.tasks.advice.ADVICE`, what ``pipeoptim compare`` and the README say)
recommends it with this optimizer. Reaching the target sooner is not enough: in image and
sentiment some asynchronous methods reach 99 % first, yet at the end of the same time their
models are no better than the synchronous pipeline's beyond the seed spread, and the synchronous
one is the model non-pipelined training gives. Where no study covers the case (another task,
model, batch size or optimizer, or a model of the user's own), the fastest synchronous candidate
is recommended and the fastest asynchronous one named as the one to try with
``pipeoptim compare``. :func:`target_table` shows the candidates so ranked, as the plan prints them.

This module imports nothing heavy (no torch)."""
from __future__ import annotations

import math
import textwrap
from typing import Any, Dict, List, Optional, Sequence

from ..methods import split_variant
from ..recommendation import candidate_name, pieces_note, reach_notes, time_in_code, unstudied_notes
from .tasks.advice import Advice, advice, not_studied_here
from .tasks.updates_to_target import StudiedSetting, VariantRatio, studied_setting

RULE = ("the shortest predicted time to target (seconds per mini-batch x the updates to 99 % of sequential's "
        "validation metric, 101 % for perplexity: the synchronous pipeline's in the equal-time study for the "
        "task, optimizer and nearest N, times the method's ratio to them, 1 for a synchronous method) among "
        "candidates whose largest stage memory fits the memory limit: every synchronous one, and an "
        "asynchronous one only where the study's advice for the task and N recommends it (as pipeoptim compare "
        "says); within {tie:.0%} of the best counts as a tie, and ties go to the study's method (the better "
        "model at equal time), then a synchronous method, then less memory, then fewer micro-batches, then the "
        "earlier method. Where no study "
        "covers the task, model, batch size or optimizer: the fastest synchronous candidate, and the fastest "
        "asynchronous one is named as the one to try with pipeoptim compare")


def advised_variant(setting: Optional[StudiedSetting], entry: Optional[Advice],
                    optimizer: str) -> Optional[VariantRatio]:
    """The study's variant that ``entry`` (the advice for the task and depth) recommends, where it
    is asynchronous, with ``optimizer``, at ``setting``'s depth, and reached the target; else None."""
    if setting is None or entry is None or entry.synchronous or entry.optimizer != optimizer \
            or entry.stages != setting.stages:
        return None
    options = study_options(o for o in entry.options if o[0] != "beta1")  # beta1: the optimizer's, not the method's
    for v in setting.variants:
        if (v.method, v.microbatches, v.options) == (entry.method, entry.microbatches, options) and not v.same_as:
            return v if v.ratio is not None else None
    return None


def study_options(options: Any) -> tuple:
    """Method options as the study's table holds them: sorted (option, value) pairs, the value as
    text (``{"error_feedback": True}`` -> ``(("error_feedback", "True"),)``)."""
    pairs = options.items() if isinstance(options, dict) else options
    return tuple(sorted((k, f"{v:g}" if isinstance(v, float) else str(v)) for k, v in pairs))


def annotate(candidates: Sequence[Dict[str, Any]], *, task: Optional[str], model: Optional[str],
             batch_size: int, optimizer: str, stages: int) -> Dict[str, Any]:
    """Add to each candidate ``seconds_per_batch``, ``updates_ratio``, ``ratio_source``,
    ``time_to_target_seconds`` (None: unknown or never reached) and ``eligible`` (whether it may be
    recommended); return the plan's ``study`` section: whether a study covers the case and which
    setting, the target's updates, the advice for the task and depth."""
    setting, line = studied_setting(task, optimizer, stages, model, batch_size)
    entry, text = advice(task, stages) if task is not None and setting is not None else (None, None)
    advised = advised_variant(setting, entry, optimizer)
    for c in candidates:
        c["seconds_per_batch"] = c["makespan_seconds"] / c["batches"]
        variant = None
        if c["synchronous"]:
            ratio, source = 1.0, "synchronous: sequential's updates"
        elif setting is None:
            ratio, source = None, "not studied"
        else:
            variant = setting.lookup(c["method"], c["microbatches"], stages, study_options(c.get("options") or {}))
            ratio = None if variant is None else variant.ratio
            source = (variant.describe() if variant
                      else f"the study did not run {candidate_name(c)} at M = {c['microbatches']}")
        c["updates_ratio"], c["ratio_source"] = ratio, source
        c["time_to_target_seconds"] = (c["seconds_per_batch"] * ratio * setting.sync_updates
                                       if setting is not None and ratio is not None else None)
        c["eligible"] = bool(c["synchronous"] or (advised is not None and variant is not None and ratio is not None
                                                  and advised.variant in (variant.variant, variant.same_as)))
    return {"covered": setting is not None, "line": line, "setting": None if setting is None else setting.name(),
            "target": None if setting is None else setting.target,
            "target_updates": None if setting is None else setting.sync_updates,
            "advice": text, "advised_method": None if entry is None else entry.method,
            "advised_variant": None if entry is None else entry.variant(),
            "advised_synchronous": None if entry is None else entry.synchronous,
            "advised_optimizer": None if entry is None else entry.optimizer,
            "studied_stages": None if setting is None else setting.stages}


def methods_flags(names: Sequence[str]) -> str:
    """``--methods`` of a command for candidates named ``names`` (variants too: a ``+ef`` one is
    its method there, and ``--error-feedback`` follows, which the methods without it ignore in a
    comparison; a ``+ef+aware`` one adds ``--predict-feedback``)."""
    split = [split_variant(n) for n in names]
    flags = f"--methods {','.join(dict.fromkeys(m for m, _ in split))}"
    return flags + "".join(f" --{option.replace('_', '-')}" for option in ("error_feedback", "predict_feedback")
                           if any(o.get(option) for _, o in split))


def compare_command(task: Optional[str], model: Optional[str], stages: int, optimizer: str,
                    methods: Sequence[str]) -> str:
    """The ``pipeoptim compare`` that measures ``methods`` (candidates' names) against each other on the task."""
    if task is None:
        return ("train them on your data for the same time and compare the models (pipeoptim.train with "
                f"method={methods[0]!r} and method={methods[-1]!r})")
    flags = [f"--task {task}"] + ([f"--model {model}"] if model else []) + [
        f"--stages {stages}", f"--optimizer {optimizer}", methods_flags(methods)]
    return "pipeoptim compare " + " ".join(flags)


def bench_command(task: str, model: Optional[str], stages: int, best: Dict[str, Any], methods: Sequence[str]) -> str:
    """The ``pipeoptim bench`` that measures ``methods`` (candidates' names) on the task's model at the plan's M."""
    return " ".join(["pipeoptim bench --task", task] + (["--model", model] if model else []) + [
        f"--stages {stages} --micro-batches {best['microbatches']} {methods_flags(methods)}"])


def _m(c: Dict[str, Any]) -> str:
    return f"{candidate_name(c)} (M = {c['microbatches']})"


def notes(study: Dict[str, Any], cands: Sequence[Dict[str, Any]], best: Dict[str, Any], *, task: Optional[str],
          model: Optional[str], stages: int, optimizer: str, stable: bool = True) -> List[str]:
    """What the plan says beside its recommendation ``best``: whether a study covers the case
    (``study``: :func:`annotate`'s), the study's advice (and, where the timings were not
    ``stable`` and the plan departs from it, that they may be why), and the asynchronous candidate to try
    where the recommendation is not it (and, as the engine's rule says, the candidates no split can
    reach)."""
    out = [study["line"] + "."]
    check = time_in_code if task is None else (lambda methods: bench_command(task, model, stages, best, methods))
    if not study["covered"]:
        return out + unstudied_notes(cands, best, lambda methods: compare_command(task, model, stages, optimizer,
                                                                                   methods)) + pieces_note(
            cands, best, check)
    out += reach_notes(cands, best) + pieces_note(cands, best, check)
    fits = [c for c in cands if c["fits"] and c.get("reachable", True)]
    if not best["eligible"]:
        out.append(f"no synchronous candidate fits or was asked for: {_m(best)} is recommended on "
                   + ("time to target" if best.get("time_to_target_seconds") is not None else "throughput alone"))
    rivals = [c for c in fits if not c["synchronous"] and c is not best]
    out.append(f"the study's advice: {study['advice']}")
    studied = study.get("studied_stages")
    if not best["synchronous"] and studied not in (None, stages):  # the advice of another depth: not measured here
        plain = [c for c in fits if c["synchronous"] and c.get("time_to_target_seconds") is not None]
        against = [candidate_name(min(plain, key=lambda c: c["time_to_target_seconds"]))] if plain else []
        out.append(f"{_m(best)} is recommended by the study's N = {studied} {not_studied_here(stages)}: no run "
                   f"measured it at N = {stages}; to see it on your task before relying on it: "
                   + compare_command(task, model, stages, optimizer, [candidate_name(best), *against]))
    if study["advised_optimizer"] is not None and study["advised_optimizer"] != optimizer:
        out.append(f"(that advice is for {study['advised_optimizer']}; this plan is for {optimizer}: "
                   f"--optimizer {study['advised_optimizer']} plans it)")
    if best["synchronous"] and study["advised_synchronous"] and candidate_name(best) != study["advised_variant"]:
        out.append(f"{_m(best)} computes the updates of the study's {study['advised_method']} (every synchronous "
                   f"schedule computes sequential's): it is the fastest synchronous one on this profile")
    if study["advised_synchronous"] is False and best["synchronous"] and study["advised_optimizer"] == optimizer:
        mine = [c["time_to_target_seconds"] for c in fits if c["eligible"] and not c["synchronous"]]
        out.append(f"the study's {study['advised_variant']} is " + (
            f"predicted to reach the target later on this profile ({min(mine):.1f} s against "
            f"{best['time_to_target_seconds']:.1f} s)" if mine else "not among the candidates that fit")
            + ", so the synchronous pipeline is recommended" + ("" if stable or not mine else
            "; the timings were not stable (the machine's other work): plan again on a quieter machine, with "
            "--threads 1 per stage or more --repeats, before trusting the difference"))
    sooner = [c for c in rivals if c.get("time_to_target_seconds") is not None
              and c["time_to_target_seconds"] < best.get("time_to_target_seconds", math.inf) and not c["eligible"]]
    if sooner and best["synchronous"]:
        first = min(sooner, key=lambda c: c["time_to_target_seconds"])
        why = ("the study's confirmation found no asynchronous model better than the synchronous pipeline's "
               "here" if study["advised_synchronous"] else
               "the study has no confirmed advice here yet" if study["advised_synchronous"] is None else
               f"the study's advice here is {study['advised_variant']} with {study['advised_optimizer']}, not it")
        out.append(f"{_m(first)} is predicted to reach the target sooner ({first['time_to_target_seconds']:.1f} s "
                   f"against {best['time_to_target_seconds']:.1f} s), but at equal time {why}, so it is "
                   f"not recommended; to see it on your task: "
                   + compare_command(task, model, stages, optimizer, [candidate_name(best), candidate_name(first)]))
    return out


def name_width(plan: Dict[str, Any]) -> int:
    """The plan tables' method column: 16 characters, or the longest candidate's name."""
    names = [candidate_name(c) for c in plan["candidates"]] + [s["method"] for s in plan["skipped"]]
    return max([16] + [len(n) for n in names])


def target_table(plan: Dict[str, Any], top: Optional[int] = None) -> List[str]:
    """The candidates by predicted time to target (unknown ones last, by throughput): samples/s,
    the ratio of updates to the target and where it comes from, whether it may be recommended
    (``top``: the first ``top`` and the recommended one, then how many more)."""
    study = plan["study"]
    studied = study.get("studied_stages")
    near = f" {not_studied_here(plan['stages'])}" if studied not in (None, plan["stages"]) else ""
    head = (f"by predicted time to target ({study['setting']} of the equal-time study: "
            f"{study['target_updates']:.0f} updates of the synchronous pipeline to the target){near}:" if study["covered"]
            else "by predicted time to target (no study covers this case: ratios unknown but the synchronous 1):")
    w = name_width(plan)
    lines = [*textwrap.wrap(head, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False),
             f"{'method':<{w}} {'M':>2}   samples/s  updates x  to target s  may recommend  ratio from"]
    ranked = sorted(plan["candidates"], key=lambda c: (c.get("time_to_target_seconds") is None,
                                                       c.get("time_to_target_seconds") or 0.0,
                                                       -c["samples_per_second"]))
    chosen = [c for c in ranked if (candidate_name(c), c["microbatches"]) == (plan.get("variant") or plan["method"],
                                                                            plan["microbatches"])]
    shown = ranked if top is None else ranked[:top] + [c for c in chosen[:1] if c not in ranked[:top]]
    for c in shown:
        ratio, to_target = c.get("updates_ratio"), c.get("time_to_target_seconds")
        lines.append(f"{candidate_name(c):<{w}} {c['microbatches']:>2}  {c['samples_per_second']:>10.0f}  "
                     f"{(f'{ratio:.2f}' if ratio is not None else '-'):>9}  "
                     f"{(f'{to_target:.1f}' if to_target is not None else '-'):>11}  "
                     f"{'yes' if c.get('eligible', True) else 'no':<13}  {c.get('ratio_source', '')}")
    if len(shown) < len(ranked):
        lines.append(f"... and {len(ranked) - len(shown)} more (--verbose: every candidate, with the partitions, "
                     f"the memory and the rule; the plan file holds them all)")
    return lines
