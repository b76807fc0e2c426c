"""Run under torchrun by tests/test_torchrun.py: a two-stage Pipeline ends, and each rank prints,
from an atexit hook that runs after the Pipeline's own teardown, its native (non-Python) threads
before the Pipeline, while it runs and at exit, and how many of them are gloo's collective workers
("pt_gloo_runloop"). A worker alive at interpreter finalization can abort the process (it may
still be releasing a collective's tensor, which needs the GIL); none may be left.

Argument, how the script ends: ``exit`` (falls off the end), ``close`` (``Pipeline.close()``, twice),
``with`` (a ``with`` block), ``raise`` (the last stage's loss raises at its third mini-batch, with
receives still posted; its peer then fails on the lost connection), ``nan`` (the loss becomes NaN at
the third mini-batch: the Pipeline's stop on a non-finite loss, on every rank), ``user`` (the script starts the
process group itself, and imports torch._dynamo after it, which keeps that group alive: the
Pipeline must leave the user's group as it was and nothing of its own)."""
import atexit
import json
import os
import sys
import threading

import torch
from torch import nn

import pipeoptim


def native_threads() -> int:
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())


def gloo_workers() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


mode = sys.argv[1]
if mode == "user":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import torch._dynamo  # noqa: F401 - keeps the default group alive (a default argument)
counts = {"rank": int(os.environ["RANK"]), "before": native_threads(), "workers_before": gloo_workers()}
# registered before the Pipeline registers its teardown, so it runs after it (atexit is LIFO)
# one write() of the whole line: the ranks share torchrun's stdout, and Python's print writes the
# text and the newline apart when unbuffered, so two ranks' lines could interleave
atexit.register(lambda: os.write(1, (json.dumps({**counts, "at_exit": native_threads(),
                                                 "workers_at_exit": gloo_workers()}) + "\n").encode()))
calls = []


def loss_fn(out, target):
    calls.append(1)
    if mode == "raise" and len(calls) == 3:
        raise RuntimeError("a stage failed on purpose")
    loss = nn.functional.cross_entropy(out, target)
    return loss * float("nan") if mode == "nan" and len(calls) >= 3 else loss


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
pipe = pipeoptim.Pipeline(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)), method="pipeoptim",
                          stages=2, loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), timeout=60)
counts["running"] = native_threads()
accuracy = lambda out, y: (out.argmax(-1) == y).float().mean()
if mode == "with":
    with pipe:
        pipe.fit(batches, epochs=1, eval_loader=batches[:2], metric=accuracy)
else:
    pipe.fit(batches, epochs=1, eval_loader=batches[:2], metric=accuracy)
if mode == "close":
    pipe.close()
    pipe.close()
    counts["after_close"] = native_threads()
