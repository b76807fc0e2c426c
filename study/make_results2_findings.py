"""The second study's findings, as the report says them (study/make_results2.py): the
conclusions per claim, time to target against the synchronous pipeline, the diagnostic's reading
of each shortfall, the error-gap correlation, depth, throughput, the confirmations and the
caveats."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence

from study import make_results2_data  # (its seconds_per_batch looked up on call: a test replaces it)
from study import study2_plan
from study.common import fmt, mean_sd, verdict
from study.make_results2_data import (HEADLINE, LEVELS, RIVALS, SYNCHRONOUS_PIPELINES, Setting, digits_of,
                                           final_score, seeds_text, stage_errors, value)


def holds(tally: Dict[str, int]) -> str:
    """A claim over settings: holds when won or tied in at least three quarters, does not hold
    when lost in half or more, else holds in part (the first study's rule)."""
    total = sum(tally.values())
    if not total:
        return "untested (no setting has both methods' runs yet)"
    if tally.get("loses", 0) * 2 >= total:
        return "does not hold"
    return "holds" if (tally.get("wins", 0) + tally.get("ties", 0)) * 4 >= 3 * total else "holds in part"


def count(tally: Dict[str, int]) -> str:
    return f"{tally.get('wins', 0)} wins, {tally.get('ties', 0)} ties, {tally.get('loses', 0)} losses"


def diagnosis(st: Setting, variant: str) -> str:
    """What the diagnostic says of a method's shortfall in a setting."""
    errors = stage_errors(st.methods[variant].rows)
    if not errors:
        return "no diagnostic (every seed diverged)" if st.methods[variant].rows else "no runs"
    worst = max(errors, key=lambda e: e["prediction"])
    ratios = ", ".join("-" if e["ratio"] != e["ratio"] else f"{e['ratio']:.2f}" for e in errors)
    known = [e for e in errors if e["ratio"] == e["ratio"]]
    if all(abs(e["ratio"] - 1) < 1e-9 for e in known):
        reading = "no prediction: the error is the staleness itself"
    elif all(e["ratio"] < 1 for e in known):
        least = max(known, key=lambda e: e["ratio"])
        reading = (f"the prediction removes {1 - least['ratio']:.0%}-{1 - min(e['ratio'] for e in known):.0%} "
                   f"of the staleness error, least at stage {least['stage']}")
    else:
        worse = [str(e["stage"]) for e in errors if not e["ratio"] < 1]
        reading = f"the forward's weights are no closer than the latest at stage(s) {', '.join(worse)}"
    return (f"{reading}; the forward's weights are farthest from the backward's at stage {worst['stage']} "
            f"({worst['prediction']:.1e}); their error over the staleness error by stage: {ratios}")


def conclusions(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """The paper's claims and the issue's question, each as per-setting verdicts."""
    claim1: Dict[str, List[str]] = {v: [] for v in HEADLINE}
    tally1: Dict[str, Dict[str, int]] = {v: defaultdict(int) for v in HEADLINE}
    claim2: List[str] = []
    tally2: Dict[str, Dict[str, int]] = {r: defaultdict(int) for r in RIVALS}
    sooner: List[str] = []
    tally_sooner: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    shortfalls: List[str] = []
    for st in settings:
        if not st.methods["sequential"].rows:
            continue
        seq = st.final("sequential")
        d = digits_of(st)
        for variant in HEADLINE:
            if variant not in st.methods or not st.methods[variant].rows:
                continue
            word, diff, spread = verdict(st.final(variant), seq, st.higher)
            tally1[variant][word] += 1
            claim1[variant].append(f"  - {st.name()}: {word} ({value(st.final(variant)[0], st.scale, d)} against "
                                   f"{value(seq[0], st.scale, d)}, {diff * st.scale:+.{d}f} at a spread of "
                                   f"{spread * st.scale:.{d}f}; {seeds_text(st.seeds(variant))} against "
                                   f"{st.seeds('sequential')})")
        if "pipeoptim" in st.methods and st.methods["pipeoptim"].rows:
            parts = []
            for rival in RIVALS:
                if rival in st.methods and st.methods[rival].rows:
                    word, diff, _ = verdict(st.final("pipeoptim"), st.final(rival), st.higher)
                    tally2[rival][word] += 1
                    parts.append(f"{rival} {word} ({diff * st.scale:+.{d}f})")
            if parts:
                claim2.append(f"  - {st.name()}: " + ", ".join(parts))
        sync, sync_note = st.synchronous_time()
        line = []
        for variant in suite["methods"]:
            method = st.methods[variant]
            if not method.rows:
                continue
            ttt = st.time_to_target(variant)
            updates = st.updates_to_target(variant)
            if ttt is None and updates and any(u is None for u in updates):
                word = "never"
                reached = sum(u is not None for u in updates)
                line.append(f"{variant} does not reach it ({reached} of {seeds_text(len(updates))})")
            elif ttt is None or sync is None:
                continue
            else:
                word, _, _ = verdict(ttt, sync, higher=False)  # less time is better
                word = {"wins": "sooner", "ties": "ties", "loses": "later"}[word]
                line.append(f"{variant} {word} ({sync[0] / ttt[0]:.2f}x)")
            tally_sooner[variant][word] += 1
            behind, _, spread = verdict(st.final(variant), seq, st.higher)
            if word == "never" or behind == "loses":
                why = "does not reach the target" if word == "never" else \
                    f"falls behind sequential by {abs(st.final(variant)[0] - seq[0]) * st.scale:.{d}f} " \
                    f"(spread {spread * st.scale:.{d}f})"
                if word == "never" and behind == "loses":
                    why += f" and ends {abs(st.final(variant)[0] - seq[0]) * st.scale:.{d}f} behind"
                shortfalls.append(f"  - {st.name()}, {variant}: {why}; {diagnosis(st, variant)}")
        if line and sync is not None:
            sooner.append(f"  - {st.name()} (synchronous pipeline: {fmt(sync, 1.0, 1)} s{sync_note}): "
                          + "; ".join(line))
    out = ["**The question: does an asynchronous pipeline reach the target sooner?** Per setting, each "
           "method's predicted time to first reach the target on N devices against the synchronous "
           "pipeline's (sequential's updates at the faster of gpipe and 1f1b-flush), with the ratio "
           "synchronous time / method time (above 1: sooner):", ""]
    out += sooner or ["  - no setting has both sequential's runs and a time per mini-batch yet"]
    out += ["", "In short: " + "; ".join(
        f"{v}: {t.get('sooner', 0)} sooner, {t.get('ties', 0)} ties, {t.get('later', 0)} later, "
        f"{t.get('never', 0)} never" for v, t in tally_sooner.items()) + ".", ""]
    out += ["**Claim 1: PipeOptim trains as well as synchronous training** (final test metric against "
            "`sequential`, each at its own best learning rate):", ""]
    for variant in HEADLINE:
        out += [f"`{variant}`: {holds(tally1[variant])} ({count(tally1[variant])})", ""] + claim1[variant] + [""]
    out += ["**Claim 2: PipeOptim trains better than PipeDream, PipeDream-2BW, SpecTrain and XPipe** "
            "(PipeOptim's verdict and lead per setting): "
            + "; ".join(f"against {r}: {holds(tally2[r])} ({count(tally2[r])})" for r in RIVALS), ""]
    out += claim2 + [""]
    out += ["**Where an asynchronous method does not reach the target or falls behind `sequential` beyond "
            "the seed spread**, and what the diagnostic says:", ""]
    out += shortfalls or ["  - none"]
    return out + [""]


def depth_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """Does a shallower pipeline (less staleness: a delay of up to N - 1 updates at the first
    stage) bring each asynchronous method closer to sequential? Its final test metric minus
    sequential's, per cell and N, at the lr its sweep chose."""
    depths = sorted(suite["stages"], reverse=True)
    if len(depths) < 2:
        return []
    deep, shallow = depths[0], depths[-1]
    by_key = {(s.task, s.optimizer, s.stages): s for s in settings}
    rows, better, compared = [], 0, 0
    for task, optimizer in suite["cells"]:
        cell = [by_key.get((task, optimizer, n)) for n in depths]
        if any(st is None or not st.methods["sequential"].rows for st in cell):
            continue
        for variant in suite["methods"]:
            gaps = []
            for st in cell:
                if st.methods[variant].rows:
                    mean = st.final(variant)[0] - st.final("sequential")[0]
                    gaps.append((mean, st.seeds(variant), st))
                else:
                    gaps.append(None)
            if all(g is None for g in gaps):
                continue
            cells = ["-" if g is None else f"{g[0] * g[2].scale:+.{digits_of(g[2])}f} ({seeds_text(g[1])})"
                     for g in gaps]
            if gaps[0] is not None and gaps[-1] is not None:
                compared += 1
                better += (gaps[-1][0] - gaps[0][0]) * (1 if cell[0].higher else -1) > 0
            rows.append(f"| {task}, {optimizer} | {variant} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    metric_note = "percentage points of accuracy, negative: behind; perplexity, positive: behind"
    return [f"**Does a shallower pipeline close the gap?** Each asynchronous method's final test metric minus "
            f"sequential's ({metric_note}), at N = " + ", ".join(str(n) for n in depths)
            + f"; at N = {shallow} the first stage of an asynchronous 1F1B pipeline runs its forward up to "
            f"{shallow - 1} updates before its backward instead of {deep - 1} (pipedream-2bw: one update at any "
            f"N). Every N uses the lr the N = {deep} sweep chose. Of {compared} (method, "
            f"cell) pairs with runs at both, {better} end closer to sequential (or further ahead) at "
            f"N = {shallow}.", "",
            "| cell | method | " + " | ".join(f"N = {n}" for n in depths) + " |",
            "|---|---|" + "---|" * len(depths)] + rows + [""]


def ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank (as Spearman's correlation wants them)."""
    # statistics.correlation(method="ranked") does this from Python 3.12; the project supports 3.10
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (nan when either side is constant)."""
    try:
        return statistics.correlation(ranks(a), ranks(b))
    except statistics.StatisticsError:
        return math.nan


def error_gap_lines(settings: Sequence[Setting], suite: Dict[str, Any]) -> List[str]:
    """Does the diagnostic explain the gaps? Per setting, across the asynchronous methods, the rank
    correlation between the forward's weight error (mean over the stages) and how far the method
    ends behind sequential."""
    lines = []
    for st in settings:
        if not st.methods["sequential"].rows:
            continue
        seq = st.final("sequential")[0]
        points = []
        for variant in suite["methods"]:
            errors = stage_errors(st.methods[variant].rows)
            final = st.final(variant)[0]
            if errors and math.isfinite(final):
                behind = (seq - final) * (1 if st.higher else -1)
                points.append((variant, statistics.mean(e["prediction"] for e in errors), behind))
        if len(points) < 3:
            continue
        rho = spearman([p[1] for p in points], [p[2] for p in points])
        d = digits_of(st)
        low, high = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
        lines.append(f"  - {st.name()}: {rho:+.2f} over {len(points)} methods (smallest error: {low[0]}, "
                     f"{low[1]:.1e}, {low[2] * st.scale:.{d}f} behind; largest: {high[0]}, {high[1]:.1e}, "
                     f"{high[2] * st.scale:.{d}f} behind)")
    if not lines:
        return []
    return ["**Does the diagnostic explain the gaps?** Per setting, across the asynchronous methods, Spearman's "
            "rank correlation between the forward's weight error (its distance from the weights live at the "
            "backward, relative to those, averaged over the stages, probes and seeds) and how far the "
            "method's final test metric ends behind sequential's (+1: the larger the error, the further "
            "behind). Each method runs at its own lr, and the error grows with the lr, so this compares "
            "methods as tuned, not at equal step sizes:", ""] + lines + [""]


def throughput_section(settings: Sequence[Setting], times: Optional[Dict[str, Any]]) -> List[str]:
    """Claim 3 (1F1B's throughput with 2 weight copies), the predicted times and the N = 2 check."""
    out = ["**Claim 3: PipeOptim runs at asynchronous 1F1B's throughput with at most 2 weight copies.** ", ""]
    if times is None:
        return out + ["No time per mini-batch is in yet (`study/study2_times.py`).", ""]
    most_copies: List[float] = []
    ratios: List[float] = []
    for st in settings:
        po, naive = st.seconds("pipeoptim"), st.seconds("async-naive")
        flush = make_results2_data.seconds_per_batch(times, st.task, st.optimizer, st.stages, "1f1b-flush")
        gpipe = make_results2_data.seconds_per_batch(times, st.task, st.optimizer, st.stages, "gpipe")
        seq1 = make_results2_data.seconds_per_batch(times, st.task, st.optimizer, 1, "sequential")
        if None in (po, naive, flush, gpipe):
            continue
        copies = [c for v in ("pipeoptim",) if v in st.methods
                  for r in st.methods[v].ok for c in r.get("weight_copies") or []]
        pd_copies = [c for v in ("pipedream",) if v in st.methods
                     for r in st.methods[v].ok for c in r.get("weight_copies") or []]
        most_copies += copies
        ratios.append(naive / po)
        out.append(f"  - {st.name()}: predicted {po * 1000:.1f} ms per mini-batch: {naive / po:.2f}x "
                   f"async-naive's throughput, {flush / po:.2f}x 1f1b-flush's, {gpipe / po:.2f}x gpipe's"
                   + (f", {seq1 / po:.2f}x one device's" if seq1 else "")
                   + (f"; at most {max(copies):g} weight copies per stage (pipedream: up to {max(pd_copies):g})"
                      if copies and pd_copies else ""))
    if ratios:
        verdict_word = "holds" if min(ratios) >= 0.95 and (not most_copies or max(most_copies) <= 2) else "does not hold"
        out += ["", f"Verdict: {verdict_word} (predicted {min(ratios):.2f}-{max(ratios):.2f}x async-naive's "
                    f"throughput; at most {max(most_copies) if most_copies else float('nan'):g} weight copies "
                    f"per stage in the runs)."]
    measured = [entry["methods"]["pipeoptim"]["measured_seconds_per_batch"]
                / entry["methods"]["async-naive"]["measured_seconds_per_batch"]
                for per_optimizer in (times.get("check_n2") or {}).get("cells", {}).values()
                for entry in per_optimizer.values()]
    out += ["", "The simulator does not charge the prediction's own cost (the same time for every "
            "asynchronous 1F1B method)"
            + (f"; measured on the distributed runtime at N = 2 (below), PipeOptim takes "
               f"{min(measured):.2f}-{max(measured):.2f}x async-naive's time per mini-batch." if measured else "."),
            ""]
    check = times.get("check_n2")
    if check:
        out += check_lines(check)
    return out


def check_lines(check: Dict[str, Any]) -> List[str]:
    """The simulator against the distributed runtime at N = 2 (times.json's check_n2 section,
    ``study/study2_times.py --check-n2``)."""
    lines = ["**The simulator against the distributed runtime at N = 2** (`study/study2_times.py "
             "--check-n2`: `pipeoptim bench`, one process per stage on this machine's 2 cores, against the "
             "simulator's prediction for the same mini-batches from the same kind of profile; "
             "sequential: one process, one thread):", "",
             "| task | optimizer | method | predicted ms / mini-batch | measured | measured / predicted |",
             "|---|---|---|---|---|---|"]
    ratios, loads, speedups = [], [], []
    for task, per_optimizer in sorted(check.get("cells", {}).items()):
        for optimizer, entry in sorted(per_optimizer.items()):
            loads += [entry["load_average"]["start"][0], entry["load_average"]["end"][0]]
            speedups.append((task, optimizer, *(
                min(entry["methods"][m][key] for m in SYNCHRONOUS_PIPELINES) / entry["methods"]["pipeoptim"][key]
                for key in ("seconds_per_batch", "measured_seconds_per_batch"))))
            for method, row in entry["methods"].items():
                ratio = row.get("measured_over_predicted")
                if ratio is not None and method != "sequential":
                    ratios.append(ratio)
                measured = row.get("measured_seconds_per_batch")
                lines.append(f"| {task} | {optimizer} | {method} | {row['seconds_per_batch'] * 1000:.2f} | "
                             f"{'-' if measured is None else f'{measured * 1000:.2f}'} | "
                             f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    if ratios:
        lines += ["", f"On 2 devices the distributed runtime takes {min(ratios):.2f}-{max(ratios):.2f}x the "
                      f"predicted time per mini-batch (transfers, which the prediction counts as free, are in "
                      f"the measurement; 1-minute load average {min(loads):.1f}-{max(loads):.1f} while "
                      f"measuring). What the time to target turns on is the asynchronous pipeline's speed-up "
                      f"over the faster synchronous one: "
                      + "; ".join(f"{t} {o}: predicted {p:.2f}x, measured {m:.2f}x" for t, o, p, m in speedups)
                      + ". The times to target use the predictions as they are: where the measurement's "
                        "speed-up is smaller, a 'sooner' ratio overstates the asynchronous methods' lead by "
                        "as much."]
    return lines + [""]


def confirmations(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]], settings: Sequence[Setting]) -> List[str]:
    """gpipe and 1f1b-flush against sequential at its lr and seed 0 (equal by construction)."""
    out = []
    confirm = suite["confirm"]
    for task in dict.fromkeys(t for t, o in suite["cells"] if o == confirm["optimizer"]):
        st = next(s for s in settings if (s.task, s.optimizer) == (task, confirm["optimizer"]))
        seq = st.methods["sequential"]
        if not seq.rows:
            continue
        base = seq.rows[0]
        for variant in confirm["methods"]:
            row = rows.get(study2_plan.row_key(study2_plan.Run("confirm", task, confirm["optimizer"], variant,
                                                     max(suite["stages"]), 0, seq.lr).key_fields()))
            if row is None:
                continue
            if row.get("diverged"):
                out.append(f"  - {task}, {variant}: diverged ({row['diverged']})")
                continue
            spread = mean_sd([final_score(r, st.higher) for r in seq.rows])[1]
            out.append(f"  - {task}, {variant} (N = {row['stages']}, {row.get('microbatches')} micro-batches): "
                       f"final test {st.metric} {value(row['final_metric'], st.scale, 4)} against sequential's "
                       f"{value(base['final_metric'], st.scale, 4)}"
                       + (f" (sequential's standard deviation over {len(seq.rows)} seeds: "
                          f"{value(spread, st.scale, 2)})" if len(seq.rows) > 1 else "")
                       + f"; final training loss {row['final_loss']:.6f} against {base['final_loss']:.6f} "
                       f"(difference {row['final_loss'] - base['final_loss']:+.1e})")
    if not out:
        return []
    return ["**gpipe and 1f1b-flush against sequential** (one confirmation run each, at sequential's best "
            "lr, seed 0). They compute sequential's updates, equal within 1e-6 in the test suite's short "
            "runs; over thousands of updates two things separate them: the gradient of a mini-batch is "
            "summed over micro-batches in another order (rounding, which training amplifies, as any "
            "change of seed does), and a model with dropout (the LSTM, the GPT; not the VGG) draws its "
            "masks per micro-batch, in the order the runtime runs the stages' forwards, which differs between "
            "the two schedules. So the two pipelines equal each other on the VGG, not with dropout; "
            "against sequential, read the difference beside sequential's own seed spread:", ""] + out + [""]


def caveats(settings: Sequence[Setting], suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> List[str]:
    """What the data allow and what they do not, counted from the rows."""
    seeds_in: Dict[int, int] = defaultdict(int)  # settings by the fewest seeds any of their methods has
    for st in settings:
        counts = [len(m.rows) for m in st.methods.values() if m.rows]
        if counts:
            seeds_in[min(counts)] += 1
    diverged: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for row in rows.values():
        diverged[row["variant"]][1] += 1
        diverged[row["variant"]][0] += bool(row.get("diverged"))
    clipped = [t for t, spec in suite["tasks"].items() if spec["clip_grad"]]
    n_small = min(suite["stages"])
    out = ["**Caveats the data show.**", ""]
    out.append("  - Seeds: " + (", ".join(f"{n} setting{'s' if n != 1 else ''} rest on {k} seed{'s' if k != 1 else ''}"
                                         for k, n in sorted(seeds_in.items())) or "no setting has runs yet")
               + f" (the plan has {len(suite['seeds'])}); with one seed there is no spread, and a tie can only "
                 "be an exact equality, so those verdicts are weaker than they read.")
    out.append(f"  - N = {n_small} runs each method at the lr its N = {max(suite['stages'])} sweep chose: a "
               "method whose best lr grows with less staleness is under-tuned there (sequential is not), "
               f"so the N = {n_small} results are a lower bound for the asynchronous methods.")
    out.append("  - The halving stops 2 of the 4 lrs after a third of the run: the sensitivity plots' hollow "
               "points are one-third values, and an lr that would have overtaken after a third is missed.")
    out.append("  - Runs that diverged (loss NaN or infinite), of the rows in, per method: "
               + ", ".join(f"{v} {d}/{n}" for v, (d, n) in sorted(diverged.items())) + ".")
    if clipped:
        out.append(f"  - Clipping ({', '.join(clipped)}): synchronous methods clip by the whole model's norm, "
                   "as sequential does; an asynchronous stage never holds one mini-batch's whole gradient, "
                   "so it clips by its own norm, a looser clip in total.")
    out.append("  - Time to target is updates times a predicted time per mini-batch: the simulator from "
               "a profile of the model on this machine's CPU, for N devices as fast as that CPU and free "
               "transfers; the prediction's own cost is not charged (the N = 2 check "
               "measures it, with the simulator's error). The target is seen only at evaluations, so updates to "
               "target are upper bounds, coarse by one evaluation interval.")
    out.append("  - The models are small enough for 2 CPU cores (an 8-block VGG, an 8-block LSTM, a GPT with "
               "d 64 and 8 layers); the asynchronous methods' staleness is set by N, not by the model, "
               "but larger models and longer runs may change how much it costs.")
    out.append("  - `pipeoptim+lr_correction` is the correction the first look (issue 15, "
               "`study/results/first_look.md`, one seed, final test metric) found to be the only one "
               "that helped; the study's validation sweeps compare it with plain `pipeoptim` in every cell. "
               + correction_text(suite, rows))
    return out + [""]


def correction_text(suite: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> str:
    """The correction choice on the validation split (study2's ``correction`` phase), per cell."""
    corrections = suite.get("corrections")
    if not corrections:
        return "No other correction entered the study."
    names = {v: v.replace(corrections["base"] + "+", "+") for v in corrections["candidates"]}
    head = (f"Whether another correction beside it would do better was checked on the validation split at "
            f"N = {max(suite['stages'])}, seed 0 and its best lr (whole runs): the delay-scaled lr alone against "
            f"it with {' and with '.join(f'`{n}`' for n in names.values())}")
    cells = []
    for task, optimizer in suite["cells"]:
        choice = study2_plan.correction_choice(suite, rows, task, optimizer)
        if choice is None:
            cells.append(f"{task} x {optimizer}: not run yet")
            continue
        scores = ", ".join(f"{names.get(v, 'alone')} {'diverged' if x is None else f'{x:.4g}'}"
                           for v, x in choice["scores"].items())
        verdict = ("the delay-scaled lr alone stays best" if choice["chosen"] == corrections["base"] else
                   f"`{names[choice['chosen']]}` would be better" if choice["chosen"] else "all diverged")
        cells.append(f"{task} x {optimizer} ({choice['metric']}: {scores}): {verdict}")
    return head + ". " + "; ".join(cells) + "."


def level_lines(st: Setting) -> List[str]:
    """Whether sequential reached the level the issue asks of the task."""
    seq = st.methods["sequential"]
    if not seq.rows or st.task not in LEVELS:
        return ["`sequential`'s level: not in yet."]
    bar, reads = LEVELS[st.task]
    mean, _ = st.final("sequential")
    met = mean >= bar if st.higher else mean <= bar
    return [f"`sequential`'s level: a final test {st.metric} of {value(mean, st.scale, digits_of(st))} "
            f"({seeds_text(len(seq.rows))}); the issue asks for {reads}: {'met' if met else 'not met'}."]


TRANSLATION = ("**Translation was left out.** In the first study (`docs/results-v1.md`) `sequential` reached "
               "BLEU 2.55 with Adam (mean of 3 seeds, at the end of its runs); the issue asks for BLEU 8 within the budget before the "
               "task enters the study, and the study's whole budget (8 hours of the 2 cores, shared by every "
               "method, seed and learning rate) is far below what a transformer needs on the verse pairs to "
               "get there, so its runs would compare methods that have not learned to translate.")
