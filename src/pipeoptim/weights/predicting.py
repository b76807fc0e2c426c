"""Weight policies that predict: PipeOptim, XPipe, SpecTrain (docs/architecture.md, "Weight
versions per method" and "The prediction per optimizer").

A pass that predicts runs on ``W_hat = W - lr*s*Delta``, Delta being the stage optimizer's own
direction (:class:`~pipeoptim.weights.predict.Predictor`) or, with ``delta="ema"``, the average
of the updates applied; one cache per stage, whatever N.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..compat import CAN_SWAP_STORAGE, swap_storage_memory
from .base import WeightPolicy, WeightUse, local, nbytes
from .corrections import PREDICTION_CORRECTIONS, LrLookahead, UpdateAverage, horizon_rate
from .fused import Into, copy_all
from .predict import Predictor, predict_plan


class PredictingPolicy(WeightPolicy):
    """Runs a pass on predicted weights held in the live storage, with one cache per stage, so
    that a forward's graph keeps aliases of the live storage and its backward reads whatever is
    live then. Two ways, the same numbers:

    * swap (where the parameters own their storage and torch can swap two storages' memory,
      ``compat.swap_storage_memory``): ``W_hat`` is computed into the cache (``fused.Into``), then
      the memory of each parameter's storage and its cache's are swapped, which every alias sees
      at once, and swapped back after the pass. Nothing allocated, no restore pass.
    * write and restore (otherwise): the cache saves W, ``W_hat`` is written into the live
      storage, and the cache is copied back after the pass.
    """

    #: Private switch (tests, benchmarks): False forces the write-and-restore path.
    _swap_storage = CAN_SWAP_STORAGE

    def __init__(self, *args, sgd_momentum: str = "paper", horizon: str = "constant",
                 delta: str = "optimizer", ema_decay: Optional[float] = None, prediction_warmup: int = 0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)  # (the options' values: checked by checks.check_method_options)
        #: the optimizer's own direction (docs/architecture.md, "The prediction per
        #: optimizer"); also the diagnostic's baseline
        self.predictor = Predictor(self.optimizer, sgd_momentum=sgd_momentum)
        self.horizon = horizon
        self.delta = delta
        self.prediction_warmup = prediction_warmup
        #: delta="ema": the average of the updates applied (weights/corrections.py)
        self.average = UpdateAverage(self.optimizer, self.named, 0.9 if ema_decay is None else ema_decay) \
            if delta == "ema" else None
        #: horizon="scheduled": the scheduler's lrs for the updates to come (None: constant lr)
        self.lookahead: Optional[LrLookahead] = None
        self._applied_lrs: List[float] = []
        self.cache: Optional[List[torch.Tensor]] = None
        self._index = {p: i for i, (_, p) in enumerate(self.named)}
        self._homes: List[int] = []      # each parameter's data_ptr when the cache was made
        self._swap = False               # whether the cache is used by swapping
        self._plan_seen: object = None   # the predictor's plan the work lists were made for
        # per parameter group, for the current Delta (local shards): (group, W through p.data,
        # Delta in the same order, the Into that writes W + alpha*Delta into the cache)
        self._work: List[Tuple[dict, List[torch.Tensor], List[torch.Tensor], Into]] = []
        self._storages: List[tuple] = []  # (live storage, cache storage) of the predicted params

    def forward_steps(self, microbatch: int) -> float:
        """The prediction steps of ``microbatch``'s forward, corrections applied."""
        if self.in_sync_warmup(microbatch):
            return 0
        return self.ramp(self.base_forward_steps(microbatch))

    def base_forward_steps(self, microbatch: int) -> float:
        """The method's own step count for ``microbatch``'s forward (no correction)."""
        raise NotImplementedError

    def _forward_on_prediction(self, microbatch: int, steps: float) -> WeightUse:
        """``microbatch``'s forward on the live weights, predicted ``steps`` ahead for the pass."""
        self._forward_version[microbatch] = self.version
        restore = self._write_prediction(steps)
        return WeightUse(self.live_weights(), self.version, steps if restore else 0, restore)

    # -- corrections --------------------------------------------------------------------------
    @property
    def source(self):
        """Where Delta comes from: the optimizer (:class:`Predictor`) or ``delta="ema"``'s average."""
        return self.average if self.average is not None else self.predictor

    def use_lr_schedule(self, factory) -> None:
        if self.horizon == "scheduled" and factory is not None:
            self.lookahead = LrLookahead(self.optimizer, factory)

    def active_corrections(self) -> List[str]:
        """The corrections on that change this stage's predictions."""
        on = {"lr_correction": self.lr_correction != "none" and self.delay >= 1,
              "horizon": self.horizon != "constant", "delta": self.delta != "optimizer",
              "prediction_warmup": self.prediction_warmup > 0}
        return [name for name in PREDICTION_CORRECTIONS if on[name]]

    def ramp(self, steps: float, *, corrected: bool = True) -> float:
        """``prediction_warmup``: s * min(1, t / T) over the first T updates."""
        if corrected and self.prediction_warmup and self.version < self.prediction_warmup:
            return steps * (self.version / self.prediction_warmup)
        return steps

    def horizon_lr(self, index: int, group: dict, steps: float, disable: Sequence[str] = ()) -> float:
        """The lr mass W_hat moves along Delta for group number ``index``: ``lr * steps`` (the
        paper), or the scheduled lrs of the next ``steps`` updates (``horizon="scheduled"``),
        each divided by the delay correction's divisor."""
        corrected = "lr_correction" not in disable
        if self.lookahead is not None and "horizon" not in disable:
            count = int(math.ceil(steps))
            rates = self.lookahead.rates(index, self.version, count)
            rates = [lr / self.lr_divisor(self.version + j, corrected=corrected) for j, lr in enumerate(rates)]
            return horizon_rate(rates, steps)
        # lr / 1.0 is lr exactly: without a correction this is the paper's lr * s, bit for bit
        return float(group.get("lr", 1.0)) / self.lr_divisor(corrected=corrected) * steps

    @torch.no_grad()
    def predicted(self, steps: float, disable: Sequence[str] = ()) -> List[torch.Tensor]:
        """New tensors (in ``named`` order): the weights predicted ``steps`` (before the ramp)
        ahead with the corrections in ``disable`` off; W itself where there is no Delta."""
        source = self.predictor if "delta" in disable else self.source
        steps = self.ramp(steps, corrected="prediction_warmup" not in disable)
        out = {}
        if source.has_direction and steps:
            out = predict_plan(source.directions(),
                               lambda index, group: self.horizon_lr(index, group, steps, disable))
        return [out[p] if p in out else p.detach().clone() for _, p in self.named]

    def prediction_variants(self, microbatch: int) -> Dict[str, List[torch.Tensor]]:
        """For the diagnostic, before ``microbatch``'s forward: the weights it would use with no
        correction, and (when several are on) without each one."""
        active = self.active_corrections()
        if not active or self.in_sync_warmup(microbatch):
            return {}
        base = self.base_forward_steps(microbatch)
        variants = {"no correction": self.predicted(base, active)}
        if len(active) > 1:
            for name in active:
                variants[f"without {name}"] = self.predicted(base, [name])
        return variants

    def ever_predicts(self) -> bool:
        """Whether any pass of this stage may run on predicted weights (else no average is kept)."""
        return True

    def before_update(self) -> None:
        super().before_update()
        if self.average is not None and not self.ever_predicts():
            self.average = None  # e.g. the last stage of PipeOptim: nothing to predict, no buffer
        if self.average is not None:  # W before the update, into the cache (free between passes)
            self._ensure_cache()
            copy_all(self.cache, [p.data for _, p in self.named])
            self._applied_lrs = [float(g["lr"]) / self.lr_divisor() for g in self.optimizer.param_groups]

    def after_update(self) -> None:
        super().after_update()
        if self.average is not None:
            self.average.observe(self.cache, self._applied_lrs)

    def _ensure_cache(self) -> None:
        homes = [local(p).data_ptr() for _, p in self.named]
        if self.cache is None or homes != self._homes:
            self.cache = [torch.empty_like(p) for _, p in self.named]
            self._homes = homes
            self._swap = self._swap_storage and self._swappable()
            self._plan_seen = None
            self.note_memory()

    def _prepare(self) -> None:
        """The cache (allocated once, again only if a parameter moved to other memory) and the
        per-update work lists."""
        self._ensure_cache()
        plan = self.source.directions()
        if plan is self._plan_seen:
            return
        self._work, self._storages = [], []
        for group, params, deltas in plan:
            weights, own, caches = [], [], []
            for p, delta in zip(params, deltas):
                i = self._index.get(p)
                if i is None:
                    continue
                # p.data: its own version counter, so writing W_hat through it (write and
                # restore) does not count as a change of the parameter (the Predictor's key)
                weights.append(local(p.data))
                own.append(local(delta))
                caches.append(local(self.cache[i]))
                if self._swap and p.numel():
                    self._storages.append((p.untyped_storage(), self.cache[i].untyped_storage()))
            self._work.append((group, weights, own, Into(caches, weights, own)))
        self._plan_seen = plan

    def _swappable(self) -> bool:
        """Whether each parameter owns its whole storage (nothing else lives there, so swapping
        the storage's memory swaps exactly the parameter) and its cache has the same layout.
        Never for shards: FSDP gathers from the storage it made."""
        if self.sharded:
            return False
        seen = set()
        for (_, p), c in zip(self.named, self.cache):
            if p.numel() == 0:
                continue
            storage = p.untyped_storage()
            if (p.storage_offset() != 0 or c.stride() != p.stride() or c.device != p.device
                    or storage.nbytes() != p.numel() * p.element_size()
                    or c.untyped_storage().nbytes() != storage.nbytes()
                    or storage.data_ptr() in seen):
                return False
            seen.add(storage.data_ptr())
        return True

    @torch.no_grad()
    def _write_prediction(self, steps: float) -> Optional[Callable[[], None]]:
        """Make the live storage hold W - lr*steps*Delta; return how to put W back."""
        if steps == 0 or not self.source.has_direction:
            return None
        self._prepare()
        if self._swap:
            for index, (group, _, _, into_cache) in enumerate(self._work):
                into_cache("add", alpha=-self.horizon_lr(index, group, steps))
            storages = self._storages

            def swap() -> None:
                for live, buf in storages:
                    swap_storage_memory(live, buf)
            swap()
            return swap
        live = [p.data for _, p in self.named]
        copy_all(self.cache, live)
        for index, (group, weights, deltas, _) in enumerate(self._work):
            if weights:  # one multi-tensor add per group (the same kernel per element as torch.add)
                torch._foreach_add_(weights, deltas, alpha=-self.horizon_lr(index, group, steps))

        def restore() -> None:
            with torch.no_grad():
                copy_all(live, self.cache)
        return restore

    def copy_bytes(self) -> int:
        ema = nbytes(list(self.average.average.values())) if self.average is not None else 0
        return (nbytes(self.cache) if self.cache is not None else 0) + ema

    def state_dict(self) -> Dict[str, object]:
        state = {**super().state_dict(), "predictor": self.predictor.state_dict()}
        if self.average is not None:
            state["ema"] = self.average.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        super().load_state_dict(state)
        self.predictor.load_state_dict(state["predictor"])
        if self.average is not None and "ema" not in state and not self.ever_predicts():
            self.average = None  # saved by a stage that never predicts, as this one
        if self.average is not None:
            if "ema" not in state:
                raise ValueError("the saved state has no average of updates (it was saved without "
                                 "delta='ema'); resume with the options it was saved with")
            self.average.load_state_dict(state["ema"])


class PipeOptimPolicy(PredictingPolicy):
    """PipeOptim: the forward of micro-batch t runs on W_hat = W - lr * s * Delta, Delta being the
    stage optimizer's own update direction.

    ``steps``: ``exact`` (default) counts the updates this stage applies between the forward and
    the backward, from the schedule (min(t, N-1-k) within an epoch); ``paper`` uses N-1-k;
    ``code`` uses N-k, as the authors' released code does. ``backward``: ``latest`` (the paper)
    runs the backward on the live weights, holding one cache; ``predicted`` runs it on the same
    predicted weights as the forward, which keeps one predicted copy per in-flight micro-batch.
    """

    description = "forward on W - lr*s*Delta(optimizer), backward on the latest weights"

    def __init__(self, *args, steps: str = "exact", backward: str = "latest", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps_policy = steps
        self.backward_weights = backward
        self._held: Dict[int, List[torch.Tensor]] = {}

    def ever_predicts(self) -> bool:
        return self.delay > 0 or self.steps_policy == "code"

    def base_forward_steps(self, microbatch: int) -> float:
        if self.steps_policy == "exact":
            return self.updates_between(microbatch)
        depth = self.num_stages - 1 - self.stage
        return depth if self.steps_policy == "paper" else depth + 1

    def forward_weights(self, microbatch: int) -> WeightUse:
        steps = self.forward_steps(microbatch) if self.source.has_direction else 0
        if self.backward_weights == "predicted" and steps:
            self._forward_version[microbatch] = self.version
            tensors = self.predicted(self.base_forward_steps(microbatch))
            self._held[microbatch] = tensors
            self.note_memory()
            return WeightUse({n: t.requires_grad_(True) for (n, _), t in zip(self.named, tensors)},
                             self.version, steps)
        return self._forward_on_prediction(microbatch, steps)

    def forward_weights_kept(self, microbatch: int, use: WeightUse) -> bool:
        # backward="predicted": the forward's W_hat is held; else the live weights, unpredicted
        # and not updated before the backward
        return microbatch in self._held or (use.steps == 0 and self.updates_between(microbatch) == 0)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        if self.backward_weights == "predicted":
            yield WeightUse(use.weights, use.version, use.steps)
            self._held.pop(microbatch, None)
        else:
            yield WeightUse(use.weights, self.version)
        self._forward_version.pop(microbatch, None)

    def copy_bytes(self) -> int:
        return super().copy_bytes() + sum(nbytes(ts) for ts in self._held.values())


class XPipePolicy(PipeOptimPolicy):
    """XPipe: the micro-batched asynchronous pipeline (an update every M micro-batches) with each
    forward predicted over the exact number of updates before its backward, along the
    optimizer's direction (the XPipe paper uses Adam's), backward on the latest weights."""

    description = "micro-batched async pipeline, forward on Adam-direction predicted weights"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, steps="exact", backward="latest", **kwargs)


class SpecTrainPolicy(PredictingPolicy):
    """SpecTrain: momentum-direction prediction in both passes, s_f = floor(k/2) + N-k-1 for the
    forward and s_b = floor(k/2) for the backward (Chen et al.'s pipeline timing model)."""

    description = "momentum prediction in both passes (s_f, s_b)"

    @property
    def backward_steps(self) -> int:
        return self.stage // 2

    def ever_predicts(self) -> bool:
        return bool(self.base_forward_steps(0) or self.backward_steps)

    def base_forward_steps(self, microbatch: int) -> float:
        return self.stage // 2 + self.num_stages - self.stage - 1

    def forward_weights(self, microbatch: int) -> WeightUse:
        return self._forward_on_prediction(microbatch, self.forward_steps(microbatch))

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        steps = 0 if self.in_sync_warmup(microbatch) else self.ramp(self.backward_steps)
        restore = self._write_prediction(steps)
        try:
            yield WeightUse(use.weights, self.version, steps if restore else 0)
        finally:
            if restore is not None:
                restore()
        self._forward_version.pop(microbatch, None)
