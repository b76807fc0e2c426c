"""What the plain command runs: each task's default recipe, and the peak learning rates the
studies tuned per method.

A recipe is what the second study found for ``sequential`` (docs/results.md): the model, the
optimizer and its peak lr, linear warm-up over 5 % of the updates then cosine decay to 10 %,
gradient clipping where the task has it, the batch size and the epochs. ``pipeoptim train`` and
``compare`` fill every setting the command line leaves out from it; each flag overrides its own.

Where the study tuned a method's peak lr for a task and optimizer (4 log-spaced lrs at N = 8,
successive halving on the validation split; the same lr carried to N = 4), that lr is the
default for that method; elsewhere the recipe's (sequential's) lr, and the run says so.

This module imports nothing heavy (no torch): ``pipeoptim train --help`` and ``--recipe`` read it.
The Python API (``pipeoptim.Pipeline``) never reads it: it trains with the optimizer and scheduler
the user gives.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

from ...methods import get_method


@dataclass(frozen=True)
class Recipe:
    """A task's default training settings (one row of :data:`RECIPES`)."""

    model: str
    optimizer: str
    lr: float                  #: sequential's peak lr (the fallback for methods not tuned)
    lr_schedule: str           #: a name of pipeoptim.lab.lr_schedules
    clip_grad: Optional[float]  #: max gradient norm; None: no clipping
    batch_size: int
    epochs: int
    #: where the numbers come from (printed by ``--recipe``)
    source: str

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


#: task -> its default recipe
RECIPES: Dict[str, Recipe] = {
    # study 2: 89.65 % (momentum 0.01) and 90.74 % (AdamW 0.004) test accuracy, full data, 3 epochs
    "image": Recipe(model="vgg", optimizer="adamw", lr=0.004, lr_schedule="warmup-cosine", clip_grad=None,
                    batch_size=64, epochs=3, source="second study, sequential's best lr (90.7 % with AdamW)"),
    # study 2: 75.5 % test accuracy, full data, 3 epochs, clipped at 1.0
    "sentiment": Recipe(model="lstm-deep", optimizer="adamw", lr=0.008, lr_schedule="warmup-cosine",
                        clip_grad=1.0, batch_size=64, epochs=3,
                        source="second study, sequential's best lr (75.5 %)"),
    # study 2: test perplexity 57.6 after 2 epochs of 16,000 blocks, clipped at 1.0
    "lm": Recipe(model="gpt-narrow", optimizer="adamw", lr=0.004, lr_schedule="warmup-cosine", clip_grad=1.0,
                 batch_size=16, epochs=2, source="second study, sequential's best lr (perplexity 57.6)"),
    # not in the studies: the task's own check (Adam 1e-3 constant, plain loop, full data: BLEU 7.8
    # after 2 epochs, 14.4 after 4, 16.8 after 6), with the recipe's warm-up and cosine, clipped as
    # transformers are. 4 epochs of this recipe reached BLEU 9.96 (the cosine spends the last
    # updates at a small lr), so it runs 6
    "translation": Recipe(model="transformer", optimizer="adamw", lr=1e-3, lr_schedule="warmup-cosine",
                          clip_grad=1.0, batch_size=64, epochs=6,
                          source="the task's own check (Adam 1e-3: BLEU 16.8 after 6 epochs, plain loop); "
                                 "this recipe: BLEU 9.96 after 4 epochs"),
}

#: where the tuned lrs were measured (what the run prints beside them)
TUNED_AT = "N = 8 (second study, docs/results.md)"

#: (task, optimizer, method) -> the peak lr the second study chose on validation at N = 8
TUNED_LRS: Dict[Tuple[str, str, str], float] = {
    **{("image", "momentum", m): lr for m, lr in {
        "sequential": 0.01, "async-naive": 0.005, "pipedream": 0.0025, "pipedream-2bw": 0.01,
        "spectrain": 0.005, "xpipe": 0.01, "pipeoptim": 0.005}.items()},
    **{("image", "adamw", m): lr for m, lr in {
        "sequential": 0.004, "async-naive": 0.001, "pipedream": 0.001, "pipedream-2bw": 0.001,
        "spectrain": 0.002, "xpipe": 0.001, "pipeoptim": 0.001}.items()},
    **{("sentiment", "adamw", m): lr for m, lr in {
        "sequential": 0.008, "async-naive": 0.008, "pipedream": 0.004, "pipedream-2bw": 0.008,
        "spectrain": 0.008, "xpipe": 0.008, "pipeoptim": 0.008}.items()},
    **{("lm", "adamw", m): lr for m, lr in {
        "sequential": 0.004, "async-naive": 0.002, "pipedream": 0.004, "pipedream-2bw": 0.001,
        "spectrain": 0.002, "xpipe": 0.0005, "pipeoptim": 0.002}.items()},
}
#: what the lr source says of a synchronous method: every one computes sequential's updates, so
#: sequential's tuned lr (and the recipe's, which is sequential's) is theirs
AS_SEQUENTIAL = "as sequential, which every synchronous method equals"


def recipe(task: str) -> Recipe:
    """The default recipe of ``task``."""
    if task not in RECIPES:
        raise ValueError(f"no recipe for task {task!r}; tasks with one: {', '.join(RECIPES)}")
    return RECIPES[task]


def default_lr(task: str, optimizer: str, method: str) -> Tuple[Optional[float], str]:
    """(peak lr, where it comes from) for ``method`` on ``task`` with ``optimizer`` when the user
    gives no ``--lr``: the study's tuned lr, else the recipe's lr when ``optimizer`` is the
    recipe's, else None (the task's usual lr for that optimizer, which only the task knows). A
    synchronous method takes sequential's, which it equals (one rule, one wording: :data:`AS_SEQUENTIAL`)."""
    looked_up = "sequential" if get_method(method).synchronous else method
    who = method if looked_up == method else f"{method} ({AS_SEQUENTIAL})"
    tuned = TUNED_LRS.get((task, optimizer, looked_up))
    if tuned is not None:
        return tuned, f"tuned for {who}, {task}, {optimizer}, {TUNED_AT}; --lr overrides"
    if optimizer == recipe(task).optimizer:
        return recipe(task).lr, (f"not tuned for {who} on {task} with {optimizer}: the recipe's "
                                 f"(sequential's) lr; --lr overrides")
    return None, f"not tuned for {who} on {task} with {optimizer}: the task's usual lr for it; --lr overrides"


def tuned_lrs(task: str) -> Dict[str, Dict[str, float]]:
    """optimizer -> method -> the tuned peak lr, for ``task`` (empty where none was tuned)."""
    out: Dict[str, Dict[str, float]] = {}
    for (t, optimizer, method), lr in sorted(TUNED_LRS.items()):
        if t == task:
            out.setdefault(optimizer, {})[method] = lr
    return out


def describe(task: str) -> str:
    """The recipe of ``task`` and its tuned lrs, as ``--recipe`` prints them."""
    r = recipe(task)
    lines = [f"{task}: model {r.model}, {r.optimizer} peak lr {r.lr:g}, {r.lr_schedule} (5 % warm-up, "
             f"cosine to 10 %), clip {r.clip_grad if r.clip_grad is not None else 'none'}, batch "
             f"{r.batch_size}, {r.epochs} epochs", f"  from: {r.source}"]
    tuned = tuned_lrs(task)
    if tuned:
        lines.append(f"  peak lr tuned per method at {TUNED_AT}:")
        for optimizer, per_method in tuned.items():
            lines.append(f"    {optimizer}: " + ", ".join(f"{m} {lr:g}" for m, lr in per_method.items()))
    else:
        lines.append("  no lr tuned per method yet: every method starts from the recipe's lr")
    return "\n".join(lines)
