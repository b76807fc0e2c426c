"""Evaluation under torchrun: a forward-only pass of each mini-batch through this process's
stages, the activations going from process to process on the pipeline's links, the score taken
at the model's last stage (docs/architecture.md, "The Pipeline under torchrun")."""
from __future__ import annotations

from typing import Callable, Iterable, List, Tuple

import torch

from .microbatch import batch_size
from .stage import Stage
from .transport import PipeComm
from .values import to_device
from .wire import signature


@torch.no_grad()
def scored_forward(comm: PipeComm, stages: List[Stage], loader: Iterable, score: Callable, last: int,
                   first_chain: bool = False) -> Tuple[float, int]:
    """(the sum over samples of ``score(output, target)``, on the process of stage ``last``, 0.0
    elsewhere; the samples) of ``loader``'s mini-batches through this process's ``stages``, in
    chain order. ``first_chain``: a bidirectional run's stages 0 .. ``last`` are the model once."""
    held = {stage.index for stage in stages}
    travels = (lambda boundary, microbatch: boundary < last) if first_chain else None
    count, values = 0, []
    for j, (inputs, target) in enumerate(loader):
        ident = -1 - j  # evaluation messages: their own numbers on the links
        key = signature((inputs, target, 1.0))
        comm.expect_more([(ident, key)], [], travels)  # on each link into this process's stages
        value = inputs
        for stage in stages:  # this process's chunks in chain order; the others between them
            k = stage.index
            if k > 0 and (k - 1) not in held:
                value = comm.recv("activation", ident, key, stage=k)
            with stage.autocast():
                value = stage.module(to_device(value, stage.device))
                if k == last:
                    values.append((score(value, to_device(target, stage.device)), batch_size(inputs)))
            if k < last and (k + 1) not in held:
                comm.send("activation", ident, key, value, stage=k)
        comm.poll()
        count += batch_size(inputs)
    comm.flush()
    return sum(float(v) * n for v, n in values), count
