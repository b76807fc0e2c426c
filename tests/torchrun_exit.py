"""Run under torchrun by tests/test_torchrun.py: two-stage Pipelines end, one after the other, each
its own way, and each rank prints, from an atexit hook that runs after the Pipelines' own teardown,
its native (non-Python) threads before the first Pipeline, while each runs, after each one that
ends before the script does, and at exit, and how many of them are gloo's collective workers
("pt_gloo_runloop"). A worker alive at interpreter finalization can abort the process (it may
still be releasing a collective's tensor, which needs the GIL); none may be left.

Argument, how the Pipelines end, comma-separated, in order (each Pipeline starts from the same seed
and data, so those that finish give the same losses):
``close`` (``Pipeline.close()``, twice), ``with`` (a ``with`` block): the script goes on, and the
next Pipeline joins the job again; then, last, how the script ends:
``exit`` (the last Pipeline's script falls off the end), ``raise`` (the last stage's loss raises at
its third mini-batch, with receives still posted; its peer then fails on the lost connection),
``nan`` (the loss becomes NaN at the third mini-batch: the Pipeline's stop on a non-finite loss,
on every rank). ``user`` first: the script starts the process group itself, and imports
torch._dynamo after it, which keeps that group alive: the Pipelines must leave the user's group as
it was and nothing of their own (``user`` alone: then a Pipeline that falls off the end)."""
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


modes = sys.argv[1].split(",")
if modes[0] == "user":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import torch._dynamo  # noqa: F401 - keeps the default group alive (a default argument)
    modes = modes[1:] or ["exit"]
counts = {"rank": int(os.environ["RANK"]), "before": native_threads(), "workers_before": gloo_workers(),
          "pipelines": []}
# registered before the Pipelines register their teardown, so it runs after it (atexit is LIFO)
# one write() of the whole line: the ranks share torchrun's stdout, and Python's print writes the
# text and the newline apart when unbuffered, so two ranks' lines could interleave
atexit.register(lambda: os.write(1, (json.dumps({**counts, "at_exit": native_threads(),
                                                 "workers_at_exit": gloo_workers()}) + "\n").encode()))
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
accuracy = lambda out, y: (out.argmax(-1) == y).float().mean()  # noqa: E731


def pipeline(mode: str) -> pipeoptim.Pipeline:
    calls = []

    def loss_fn(out, target):
        calls.append(1)
        if mode == "raise" and len(calls) == 3:
            raise RuntimeError("a stage failed on purpose")
        loss = nn.functional.cross_entropy(out, target)
        return loss * float("nan") if mode == "nan" and len(calls) >= 3 else loss

    torch.manual_seed(0)
    return pipeoptim.Pipeline(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)), method="pipeoptim",
                              stages=2, loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), timeout=60)


for mode in modes:
    record = {"mode": mode}
    counts["pipelines"].append(record)
    pipe = pipeline(mode)
    record["running"] = native_threads()
    if mode == "with":
        with pipe:
            record["losses"] = pipe.fit(batches, epochs=1, eval_loader=batches[:2], metric=accuracy).losses
    else:
        record["losses"] = pipe.fit(batches, epochs=1, eval_loader=batches[:2], metric=accuracy).losses
    if mode == "close":
        pipe.close()
        pipe.close()
    if mode in ("close", "with"):
        record["after"], record["workers_after"] = native_threads(), gloo_workers()
