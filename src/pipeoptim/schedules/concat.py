"""Two schedules run one after the other: the synchronous warm-up of an asynchronous method;
and one mini-batch's schedule repeated (a user's own, ``Pipeline(schedule=...)``).

A schedule that drains at its end (every schedule here does) can be followed by another over the
next mini-batches: stage k runs all of the first schedule's actions, then all of the second's,
whose micro-batch and update numbers continue the first's. Nothing of the second depends on
the first beyond the weights, so the result is a valid schedule (the simulator checks it like
any other), and it keeps the streaming property of its parts (docs/architecture.md, "Schedules
as data"), which the executors rely on."""
from __future__ import annotations

from .actions import Action, Kind, Schedule


def concatenate(first: Schedule, second: Schedule, *, name: str) -> Schedule:
    """``first``, then ``second`` on the mini-batches after it. Both must be straight pipelines
    of the same stages and micro-batches per update. ``options["synchronous_updates"]`` records
    how many leading updates belong to ``first`` when ``first`` is synchronous."""
    if (first.num_stages, first.num_ranks, first.microbatches_per_update) != \
            (second.num_stages, second.num_ranks, second.microbatches_per_update):
        raise ValueError(f"cannot run {second.name} after {first.name}: different stages, ranks or "
                         f"micro-batches per update")
    if first.pipelines != second.pipelines or first.stage_to_rank != second.stage_to_rank:
        raise ValueError(f"cannot run {second.name} after {first.name}: different placements")
    shift_micro, shift_updates = first.num_microbatches, first.num_updates

    def shifted(action: Action) -> Action:
        shift = shift_updates if action.kind is Kind.U else shift_micro
        return Action(action.stage, action.kind, action.index + shift)

    orders = [list(a) + [shifted(x) for x in b] for a, b in zip(first.orders, second.orders)]
    options = {**second.options, "synchronous_updates": first.num_updates if first.synchronous else 0}
    return Schedule(name, first.num_stages, first.num_ranks,
                    first.num_microbatches + second.num_microbatches, first.microbatches_per_update,
                    orders, first.stage_to_rank, first.pipelines, synchronous=False, options=options)


def repeat(one: Schedule, batches: int) -> Schedule:
    """``one`` (a schedule of one update window that drains at its end) run ``batches`` times,
    micro-batch and update numbers continuing; its pairs too. A prefix of the schedule of more
    mini-batches, so it streams (docs/architecture.md, "Schedules as data")."""
    m, updates = one.num_microbatches, one.num_updates

    def shifted(action: Action, t: int) -> Action:
        return Action(action.stage, action.kind, action.index + t * (updates if action.kind is Kind.U else m))

    orders = [[shifted(a, t) for t in range(batches) for a in order] for order in one.orders]
    pairs = {shifted(f, t): shifted(b, t) for t in range(batches) for f, b in one.pairs.items()}
    return Schedule(one.name, one.num_stages, one.num_ranks, batches * m, one.microbatches_per_update,
                    orders, list(one.stage_to_rank), [list(c) for c in one.pipelines], one.synchronous,
                    dict(one.options), pairs)
