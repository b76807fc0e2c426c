"""fit's refusals, each a ValueError that names the fix: its options alone, when fit starts
(:func:`check_fit`), where a run drains (:func:`check_drains`, which the lab's launcher and the
command line ask before any process starts) and the loader's length (:func:`check_loader`). Each
names an option in the words of the interface in use (:func:`pipeoptim.errors.option`)."""
from __future__ import annotations

from typing import Any, Optional

from .errors import Shown, option


def check_fit(config: Any) -> None:
    """fit's options alone: what each must be, and the ones that contradict each other."""
    if config.epochs < 1:
        raise ValueError(f"{option('epochs')} must be at least 1, got {config.epochs}")
    if config.eval_loader is not None and config.evaluate is not None:
        raise ValueError("give evaluate=fn(model) or eval_loader (with metric), not both")
    if config.eval_every is not None and config.evaluate is None and config.eval_loader is None:
        raise ValueError("eval_every needs something to evaluate: give evaluate=fn(model) or "
                         "eval_loader (with metric)")
    check_drains(config.checkpoint_every, config.eval_every, config.continuous)
    if config.resume and config.checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    if config.eval_in_bubbles and (config.eval_every is None or config.eval_loader is None):
        missing = ([option("eval_every", Shown("K"))] if config.eval_every is None else []) + (
            ["eval_loader= (evaluate=fn(model) needs the whole model, drained)"] if config.eval_loader is None else [])
        raise ValueError(f"{option('eval_in_bubbles')} runs the evaluations of {option('eval_every')} of an "
                         f"eval_loader in the bubbles: give {' and '.join(missing)}")


def check_drains(checkpoint_every: Optional[int], eval_every: Optional[int], continuous: bool) -> None:
    """Where a run drains: the intervals, and a continuous run, which never does."""
    for name, every in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
        if every is not None and every < 1:
            raise ValueError(f"{option(name)} must be at least 1, got {every}")
        if continuous and every:
            raise ValueError(f"a continuous run never drains, so it cannot "
                             f"{'checkpoint' if name == 'checkpoint_every' else 'evaluate'} every K batches; "
                             f"drop {option('continuous')} or {option(name)}")


def check_loader(batches: Optional[int]) -> None:
    """The loader's length, where it has one."""
    if batches == 0:
        raise ValueError("the loader yields no mini-batches (is it empty, or is batch_size "
                         "larger than the data set with drop_last=True?)")
