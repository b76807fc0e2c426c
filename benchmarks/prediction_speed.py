"""What PipeOptim's prediction costs per forward, per MB of stage weights: before and after
issue 14's kernels, side by side in one process.

For momentum SGD and Adam, and a stage of about 4 MB and about 32 MB of fp32 weights (Linear
layers; 8 and 16 parameters) and one of about 1 MB in 128 small parameters (64 Linear(64, 64),
where a Python call per parameter weighs most), each round takes one optimizer step and then
times, for each implementation in turn (the order rotates every round), ``forwards`` calls of
``policy.forward_weights(t)`` followed by ``use.done()``: the prediction and, where there is one,
the restore; not the forward itself. The implementations share the module and the optimizer, so
they predict from the same state:

* ``old``: the code before issue 14, kept here verbatim: per parameter, W saved into the cache,
  ``predict_into`` over the live storage (Delta of an adaptive formula computed into a fresh
  tensor each forward), W copied back after the pass;
* ``per-parameter``: the library's path before issue 37's multi-tensor arithmetic, kept here:
  Delta once per update, one parameter at a time, ``W_hat`` computed into the cache by one
  ``torch.add(out=)`` per parameter, the cache's memory swapped with the live storage's and
  swapped back;
* ``new``: the library's path: the same with Delta per parameter group as multi-tensor
  operations and ``W_hat`` per group by one multi-tensor copy and add (on the CPU a tensor of
  8k elements or more keeps its one ``out=`` pass);
* ``new-write-restore``: the library's other path (parameters that do not own their storage, or
  a torch without ``UntypedStorage._swap_data_ptr_``): multi-tensor save and restore around the
  prediction written into the live storage.

With one forward per update (async 1F1B, PipeOptim's case) Delta's computation after each step
is inside every timed forward; with 4 (XPipe-like, M = 4) it is shared by them. Before timing,
the four are checked to give the same predicted bits. Medians over the rounds; writes
benchmarks/results/prediction_speed.json. The library before a change runs the same script
with ``PYTHONPATH`` pointing at that version's ``src``.

    .venv/bin/python -m benchmarks.prediction_speed [--rounds 21] [--forwards 1,4] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from pipeoptim.schedules import build_schedule
from pipeoptim.weights import PipeOptimPolicy, Predictor

SIZES = {"4MB": (512, 4), "32MB": (1024, 8), "1MB-128p": (64, 64)}  # (width, Linear layers)
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}
STAGES, STAGE = 4, 0   # stage 0 of 4 under the paper's steps: s = 3


# ---------------------------------------------------------------------------- the old code
def _old_delta(predictor, param, out):
    """Delta of momentum SGD (the buffer) or Adam (into ``out``, a new tensor when None), one
    parameter at a time, as ``Predictor._delta`` computed it before issue 37's multi-tensor
    formulas (the library's own now takes a group at once)."""
    state = predictor.optimizer.state.get(param)
    if not state:
        return None
    if "momentum_buffer" in state:
        return state["momentum_buffer"]
    group = predictor._group(param)
    step = float(state["step"])
    b1, b2 = group["betas"]
    out = torch.empty_like(param) if out is None else out
    torch.sqrt(state["exp_avg_sq"], out=out).div_(math.sqrt(1 - b2**step)).add_(group["eps"])
    torch.div(state["exp_avg"], out, out=out).div_(1 - b1**step)
    return out


def _old_predict_into(predictor, param, steps: float, out) -> bool:
    """``Predictor.predict_into`` before issue 14."""
    with torch.no_grad():
        w = param.detach()
        aliased = out.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        delta = _old_delta(predictor, param, None if aliased else out)
        if delta is None:
            return False
        alpha = -predictor.lr(param) * steps
        if delta is out:
            out.mul_(alpha).add_(w)
        else:
            torch.add(w, delta, alpha=alpha, out=out)
    return True


class OldPipeOptimPolicy(PipeOptimPolicy):
    """PipeOptim with ``PredictingPolicy._write_prediction`` as it was before issue 14."""

    @torch.no_grad()
    def _write_prediction(self, steps: float) -> Optional[Callable[[], None]]:
        if steps == 0 or not self.predictor.has_direction:
            return None
        if self.cache is None:
            self.cache = [torch.empty_like(p) for _, p in self.named]
            self.note_memory()
        for (_, p), saved in zip(self.named, self.cache):
            saved.copy_(p.data)
            _old_predict_into(self.predictor, p, steps, out=p.data)

        def restore() -> None:
            with torch.no_grad():
                for (_, p), saved in zip(self.named, self.cache):
                    p.data.copy_(saved)
        return restore


class PerParameterPredictor(Predictor):
    """The Predictor with Delta built one parameter at a time, as before issue 37."""

    def _build_plan(self) -> None:
        plan, by_param = [], {}
        if self.steps_taken > 0:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    params, deltas = [], []
                    for p in group["params"]:
                        self._group_of[p] = group
                        delta = _old_delta(self, p, self._scratch(group, p))
                        if delta is not None:
                            params.append(p)
                            deltas.append(delta)
                            by_param[p] = delta
                    plan.append((group, params, deltas))
        self._plan, self._delta_of = plan, by_param


class PerParameterPolicy(PipeOptimPolicy):
    """PipeOptim's swap path as it was before issue 37's multi-tensor arithmetic: Delta once per
    update but per parameter, ``W_hat`` written into the cache by one ``torch.add(out=)`` per
    parameter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.predictor.detach()
        self.predictor = PerParameterPredictor(self.optimizer)

    def _prepare(self) -> None:
        self._ensure_cache()
        plan = self.source.directions()
        if plan is self._plan_seen:
            return
        self._work, self._storages = [], []
        for group, params, deltas in plan:
            items = [(p.data, delta, self.cache[self._index[p]]) for p, delta in zip(params, deltas)]
            self._storages += [(p.untyped_storage(), self.cache[self._index[p]].untyped_storage())
                               for p in params if p.numel()]
            self._work.append((group, items))
        self._plan_seen = plan

    @torch.no_grad()
    def _write_prediction(self, steps: float) -> Optional[Callable[[], None]]:
        if steps == 0 or not self.source.has_direction:
            return None
        self._prepare()
        for index, (group, items) in enumerate(self._work):
            alpha = -self.horizon_lr(index, group, steps)
            for w, delta, buf in items:
                torch.add(w, delta, alpha=alpha, out=buf)
        storages = self._storages
        for live, buf in storages:
            live._swap_data_ptr_(buf)

        def swap_back() -> None:
            for live, buf in storages:
                live._swap_data_ptr_(buf)
        return swap_back


class WriteRestorePolicy(PipeOptimPolicy):
    _swap_storage = False


IMPLEMENTATIONS = {"old": OldPipeOptimPolicy, "per-parameter": PerParameterPolicy, "new": PipeOptimPolicy,
                   "new-write-restore": WriteRestorePolicy}


# ---------------------------------------------------------------------------- measuring
def stage_module(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def measure(size: str, optimizer: str, rounds: int, forwards: int) -> dict:
    width, layers = SIZES[size]
    module = stage_module(width, layers)
    params = list(module.parameters())
    megabytes = sum(p.numel() * p.element_size() for p in params) / 2**20
    opt = OPTIMIZERS[optimizer](params)
    microbatch = 10
    horizon = microbatch + len(IMPLEMENTATIONS) * (rounds * forwards + 1) + 10
    orders = build_schedule("async-1f1b", STAGES, 1, horizon).orders[STAGE]
    policies = {}
    for name, cls in IMPLEMENTATIONS.items():
        policy = cls(module, opt, stage=STAGE, num_stages=STAGES, steps="paper")
        policy.begin_epoch(orders)
        policies[name] = policy
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        for policy in policies.values():
            policy.after_update()

    step()
    # the same bits from all four, and W back afterwards
    live = [p.detach().clone() for p in params]
    seen = {}
    for name, policy in policies.items():
        use = policy.forward_weights(microbatch)
        microbatch += 1
        assert use.steps == STAGES - 1 - STAGE
        seen[name] = [w.detach().clone() for w in use.weights.values()]
        use.done()
        assert all(torch.equal(p.detach(), w) for p, w in zip(params, live)), name
    for name in policies:
        assert all(torch.equal(a, b) for a, b in zip(seen["old"], seen[name])), name
    assert policies["new"]._swap and policies["per-parameter"]._swap and not policies["new-write-restore"]._swap

    ms = {name: [] for name in policies}
    names = list(policies)
    for r in range(rounds):
        step()
        for name in names[r % len(names):] + names[:r % len(names)]:
            policy = policies[name]
            start = time.perf_counter()
            for _ in range(forwards):
                use = policy.forward_weights(microbatch)
                use.done()
                microbatch += 1
            ms[name].append((time.perf_counter() - start) * 1e3 / forwards)
    median = {n: statistics.median(v) for n, v in ms.items()}
    return {"size": size, "optimizer": optimizer, "megabytes": round(megabytes, 3),
            "parameters": len(params), "forwards_per_update": forwards, "rounds": rounds,
            "ms_per_forward": median,
            "ms_per_forward_per_mb": {n: v / megabytes for n, v in median.items()},
            "speedup_vs_old": {n: median["old"] / v for n, v in median.items()},
            "speedup_vs_per_parameter": {n: median["per-parameter"] / v for n, v in median.items()},
            "ms_per_forward_rounds": ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--forwards", default="1,4",
                        help="forwards per update, comma-separated (default 1,4)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "prediction_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for forwards in [int(f) for f in args.forwards.split(",")]:
        for size in SIZES:
            for optimizer in OPTIMIZERS:
                row = measure(size, optimizer, args.rounds, forwards)
                rows.append(row)
                per_mb = row["ms_per_forward_per_mb"]
                print(f"F/U {forwards} {size:>8} {optimizer:>13} ({row['megabytes']:.1f} MB): ms/forward/MB "
                      + "  ".join(f"{n} {v:.4f}" for n, v in per_mb.items())
                      + f"   new is {row['speedup_vs_old']['new']:.2f}x old, "
                      + f"{row['speedup_vs_per_parameter']['new']:.2f}x per-parameter", flush=True)
    report = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
              "stage": STAGE, "stages": STAGES, "steps": STAGES - 1 - STAGE, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
