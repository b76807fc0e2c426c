"""ZB-H1 (Qi et al., zero bubble pipeline parallelism): 1F1B with the backward split in two.

``I`` computes the input gradient, which the previous stage waits for; ``W`` computes the weight
gradient, which nobody waits for. Stage k runs 1F1B with I in place of B and defers its W's by
k micro-batches, so the chain of input gradients reaches stage 0 sooner and the deferred W's fill
the cool-down. Stage k then holds up to N micro-batches' activations, the same peak as stage 0 of
1F1B: the same memory, a smaller bubble.
"""
from __future__ import annotations

from .actions import Action, F, Kind, Schedule, U, check_positive, straight


def zb_h1(num_stages: int, microbatches: int, batches: int = 1) -> Schedule:
    check_positive(stages=num_stages, microbatches=microbatches, batches=batches)
    n, m = num_stages, microbatches
    orders = []
    for stage in range(n):
        warmup = min(n - 1 - stage, m)
        delay = min(stage, m)
        order = []
        for t in range(batches):
            base = t * m
            weights_done = 0

            def backward(j: int) -> list:
                nonlocal weights_done
                acts = [Action(stage, Kind.I, base + j)]
                if j - delay >= 0:
                    acts.append(Action(stage, Kind.W, base + j - delay))
                    weights_done += 1
                return acts

            order += [F(stage, base + i) for i in range(warmup)]
            for j in range(m - warmup):
                order.append(F(stage, base + warmup + j))
                order += backward(j)
            for j in range(m - warmup, m):
                order += backward(j)
            order += [Action(stage, Kind.W, base + j) for j in range(weights_done, m)]
            order.append(U(stage, t))
        orders.append(order)
    return Schedule("zb-h1", n, n, batches * m, m, orders, synchronous=True, **straight(n))
