"""Weight policies: which weights each pass of each micro-batch uses, one class per method family.

A policy serves one stage. Before a forward it hands the stage a :class:`WeightUse`: the tensors
to call the stage's module with (through ``torch.func.functional_call``), the weight version they
carry and the prediction step count applied. Around a backward it may swap in other values, and
around an update it may keep the outgoing version alive. It never knows which executor runs it:
everything it needs comes from the stage's own action list (the schedule is data) and the
stage's optimizer.

Autograd safety on any PyTorch 2.x rests on one device: a forward never uses the parameters
themselves but *aliases* of their storage made with ``param.data`` (same memory, separate
autograd version counter). The optimizer may then update the parameters in place between a
forward and its backward without autograd's "modified by an inplace operation" error, and the
backward reads whatever the storage holds when it runs:

* the live weights, if nothing else happened (async-naive, PipeOptim's ``latest`` backward);
* an older version, if the policy moved the parameter to fresh storage before the update and
  left the old storage to the in-flight micro-batches (weight stashing, 2BW): a stash costs one
  copy per *update that in-flight work still needs*, never one per micro-batch;
* predicted values held by the live storage for the duration of a pass, W put back afterwards
  (PipeOptim, SpecTrain, XPipe): the prediction is computed into a single cache whose memory is
  swapped with the live storage's and swapped back, or written into the live storage and
  restored from the cache; two versions per stage, whatever N.

Versions count the stage's updates: version v is the weights after v optimizer steps.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from ..schedules.actions import Action, Kind
from .corrections import (DELTAS, HORIZONS, LR_CORRECTIONS, PREDICTION_CORRECTIONS, LrLookahead,
                          UpdateAverage, delay_divisor, horizon_rate)
from .predict import Predictor


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A leaf sharing ``tensor``'s storage with its own version counter, collecting a gradient."""
    return tensor.data.requires_grad_(True)


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class WeightUse:
    """The weights one pass of one micro-batch runs on."""

    weights: Dict[str, torch.Tensor]   #: parameter name -> tensor handed to functional_call
    version: int                       #: the weight version these values are (or are predicted from)
    steps: float = 0                   #: prediction steps applied on top of ``version`` (0: none)
    restore: Optional[Callable[[], None]] = field(default=None, repr=False)
    #: the pass runs the module's own parameters (``weights`` unused): only where no update can
    #: come between a forward and its backward, so autograd may accumulate into ``param.grad``
    direct: bool = False

    def done(self) -> None:
        """Called right after the pass: undo any temporary change to the live weights."""
        if self.restore is not None:
            self.restore()
            self.restore = None


class WeightPolicy:
    """Base: forwards and backwards on the live weights, nothing kept."""

    #: This policy's row of docs/architecture.md, "Weight versions per method", in words; shown
    #: in reports.
    description = "live weights in both passes"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int,
                 num_stages: int, lr_correction: str = "none", lr_correction_steps: Optional[int] = None,
                 **options) -> None:
        if options:
            raise ValueError(f"{type(self).__name__} takes no options, got {', '.join(options)}")
        if lr_correction not in LR_CORRECTIONS:
            raise ValueError(f"lr_correction must be one of {', '.join(LR_CORRECTIONS)}, got {lr_correction!r}")
        if lr_correction == "delay" and (lr_correction_steps is None or lr_correction_steps < 1):
            raise ValueError(f"lr_correction='delay' needs lr_correction_steps=T >= 1 (the updates over "
                             f"which the lr anneals from lr/delay to lr), got {lr_correction_steps!r}")
        self.stage = stage
        self.num_stages = num_stages
        self.optimizer = optimizer
        #: PipeMare's delay-scaled lr (weights/corrections.py): "none" or "delay"
        self.lr_correction = lr_correction
        self.lr_correction_steps = lr_correction_steps
        #: updates between a forward and its backward in the steady state (the correction's tau)
        self.delay = num_stages - 1 - stage
        self._sync_updates_end = 0         # versions below this are updates of a synchronous warm-up
        self._sync_micro: frozenset = frozenset()
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_bytes = nbytes([p for _, p in self.named])
        self.version = 0                   #: live version: updates applied so far
        self.epoch_start_version = 0
        self.copy_bytes_peak = 0
        self._forward_version: Dict[int, int] = {}
        self._order: List[Action] = []

    # -- schedule knowledge -----------------------------------------------------------------
    def begin_epoch(self, stage_actions: Sequence[Action], full_orders: Sequence[Sequence[Action]] = (),
                    *, open_ended: bool = False, synchronous_updates: int = 0) -> None:
        """The actions this stage will run next (and, for policies that need it, every rank's):
        the start of a schedule (a segment), at a drained point. ``open_ended``: the orders
        were built for a horizon and more mini-batches may follow the ones they list.
        ``synchronous_updates``: the schedule's first so many updates are a synchronous warm-up
        (``sync_warmup``): no prediction and no lr correction for them."""
        self.epoch_start_version = self.version
        self._consumed: Counter = Counter()  # forwards run so far in this schedule, per window
        self.open_ended = open_ended
        self.learn_orders(stage_actions, full_orders, synchronous_updates)

    def extend_epoch(self, stage_actions: Sequence[Action], full_orders: Sequence[Sequence[Action]] = (),
                     *, open_ended: bool = False, synchronous_updates: int = 0) -> None:
        """The same schedule, now known further (or ending sooner): a streamed segment's orders
        regenerated for more mini-batches, or its final orders once the data ends. The actions
        already run are a prefix of the new orders; what they consumed is kept."""
        self.open_ended = open_ended
        self.learn_orders(stage_actions, full_orders, synchronous_updates)

    def learn_orders(self, stage_actions: Sequence[Action], full_orders: Sequence[Sequence[Action]],
                     synchronous_updates: int = 0) -> None:
        """Read what this policy needs from the orders of the current schedule."""
        self._order = list(stage_actions)
        self._updates_before: Dict[tuple, int] = {}
        count = 0
        sync_micro = []
        for a in self._order:
            if a.kind is Kind.U:
                count += 1
            else:
                self._updates_before[(a.kind, a.index)] = count
                if a.kind is Kind.F and count < synchronous_updates:
                    sync_micro.append(a.index)
        self._sync_updates_end = self.epoch_start_version + synchronous_updates
        self._sync_micro = frozenset(sync_micro)

    def in_sync_warmup(self, microbatch: int) -> bool:
        """Whether ``microbatch`` belongs to a synchronous warm-up (``sync_warmup``)."""
        return microbatch in self._sync_micro

    def lr_divisor(self, update: Optional[int] = None, *, corrected: bool = True) -> float:
        """What update ``update``'s lr (default: the next update's) is divided by at this stage:
        PipeMare's ``delay ** (1 - min(t / T, 1))`` under ``lr_correction="delay"`` outside a
        synchronous warm-up, else 1."""
        update = self.version if update is None else update
        if not corrected or self.lr_correction != "delay" or update < self._sync_updates_end:
            return 1.0
        return delay_divisor(self.delay, update, self.lr_correction_steps)

    def use_lr_schedule(self, factory: Optional[Callable[[torch.optim.Optimizer], object]]) -> None:
        """The stage's scheduler factory, told before the real scheduler is made (the
        optimizer's groups still as the user built them); policies that look ahead keep it."""

    def updates_between(self, microbatch: int) -> int:
        """Updates this stage applies between micro-batch's forward and its backward."""
        backward = Kind.I if (Kind.I, microbatch) in self._updates_before else Kind.B
        return self._updates_before[(backward, microbatch)] - self._updates_before[(Kind.F, microbatch)]

    # -- passes -------------------------------------------------------------------------------
    def live_weights(self) -> Dict[str, torch.Tensor]:
        return {n: alias(p) for n, p in self.named}

    def forward_weights(self, microbatch: int) -> WeightUse:
        self._forward_version[microbatch] = self.version
        return WeightUse(self.live_weights(), self.version)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        """Around a backward; yields what the backward runs on (for the version trace)."""
        yield WeightUse(use.weights, self.version)
        self._forward_version.pop(microbatch, None)

    # -- updates ------------------------------------------------------------------------------
    def before_update(self) -> None:
        pass

    def after_update(self) -> None:
        self.version += 1

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """The policy's state at a drained point of the pipeline (nothing in flight)."""
        if self._forward_version:
            raise RuntimeError(f"stage {self.stage}: cannot save a policy with micro-batches in flight")
        return {"version": self.version, "copy_bytes_peak": self.copy_bytes_peak}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.version = int(state["version"])
        self.copy_bytes_peak = int(state["copy_bytes_peak"])

    # -- memory -------------------------------------------------------------------------------
    def copy_bytes(self) -> int:
        """Bytes of weight copies held now, beyond the live weights."""
        return 0

    def note_memory(self) -> None:
        self.copy_bytes_peak = max(self.copy_bytes_peak, self.copy_bytes())

    @property
    def versions_peak(self) -> float:
        """Weight versions held at the peak, the live weights included (measured)."""
        return 1 + (self.copy_bytes_peak / self.param_bytes if self.param_bytes else 0)


class SynchronousPolicy(WeightPolicy):
    """GPipe, 1F1B-flush, sequential: one version per mini-batch; no update between F and B."""

    description = "W(t) in both passes (one version per mini-batch)"

    def forward_weights(self, microbatch: int) -> WeightUse:
        # No update comes between a forward and its backward here (a flush before each), so the
        # module runs on its own parameters, as plain PyTorch does: no aliases, and gradients
        # accumulate into param.grad in autograd, as a plain loop's do (the same additions).
        self._forward_version[microbatch] = self.version
        return WeightUse({}, self.version, direct=True)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        if use.version != self.version:
            raise RuntimeError(f"stage {self.stage}: micro-batch {microbatch} ran forward on version "
                               f"{use.version} but its backward on {self.version}; a synchronous "
                               f"method needs a flush before every update")
        with super().backward_pass(microbatch, use) as used:
            yield used


class LatestPolicy(WeightPolicy):
    """async-naive: forward on the live (stale) weights, backward on the weights live then."""

    description = "latest weights in each pass (stale forward, inconsistent backward)"


class _VersionStore(WeightPolicy):
    """Keeps outgoing versions that in-flight or future forwards still need (stash, 2BW).

    Before an update, if the live version is still needed, the parameters move to fresh storage
    (a copy) and the old storage stays with the micro-batches that use it: their saved aliases
    keep reading the old values, and later forwards can alias it too.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: Dict[int, List[torch.Tensor]] = {}
        self.users: Counter = Counter()

    def extend_epoch(self, stage_actions, full_orders=(), *, open_ended: bool = False,
                     synchronous_updates: int = 0) -> None:
        super().extend_epoch(stage_actions, full_orders, open_ended=open_ended,
                             synchronous_updates=synchronous_updates)
        self._drop_unneeded()  # versions kept for forwards the final orders no longer hold

    def target_version(self, microbatch: int) -> int:
        """The version micro-batch's forward must use."""
        return self.version

    def future_needs(self, version: int) -> bool:
        """Whether a forward that has not run yet will need ``version``."""
        return False

    def weights_of(self, version: int) -> Dict[str, torch.Tensor]:
        if version == self.version:
            return self.live_weights()
        if version not in self.kept:
            raise RuntimeError(f"stage {self.stage}: weight version {version} is needed but was not "
                               f"kept (live is {self.version}, kept: {sorted(self.kept)})")
        return {n: alias(t) for (n, _), t in zip(self.named, self.kept[version])}

    def forward_weights(self, microbatch: int) -> WeightUse:
        version = self.target_version(microbatch)
        self._forward_version[microbatch] = version
        self.users[version] += 1
        return WeightUse(self.weights_of(version), version)

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        yield WeightUse(use.weights, use.version)  # the aliases saved at forward hold that version
        version = self._forward_version.pop(microbatch)
        self.users[version] -= 1
        self._drop_unneeded()

    def before_update(self) -> None:
        live = self.version
        if self.users[live] > 0 or self.future_needs(live):
            self.kept[live] = [p.data for _, p in self.named]
            for _, p in self.named:
                p.data = p.data.clone()
        self.note_memory()

    def after_update(self) -> None:
        super().after_update()
        self._drop_unneeded()

    def _drop_unneeded(self) -> None:
        for version in [v for v in self.kept if self.users[v] <= 0 and not self.future_needs(v)]:
            del self.kept[version]

    def copy_bytes(self) -> int:
        return sum(nbytes(ts) for ts in self.kept.values())


class StashingPolicy(_VersionStore):
    """PipeDream: the backward runs on the version its forward used (weight stashing).

    With ``vertical_sync`` every stage uses the version stage 0 used for that micro-batch, which
    every stage computes from the schedule (no version travels with the activations).
    """

    description = "forward on the latest weights, stashed for its backward"

    def __init__(self, *args, vertical_sync: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vertical_sync = vertical_sync
        self._stage0_version: Dict[int, int] = {}

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        if self.vertical_sync:
            if not full_orders:
                raise ValueError("vertical sync needs stage 0's order")
            count = 0
            self._stage0_version = {}
            for a in full_orders[0]:
                if a.stage != 0:
                    continue
                if a.kind is Kind.U:
                    count += 1
                elif a.kind is Kind.F:
                    self._stage0_version[a.index] = self.epoch_start_version + count
            self._pending = [i for i in sorted(self._stage0_version) if not self._consumed[i]]

    def target_version(self, microbatch: int) -> int:
        if not self.vertical_sync:
            return self.version
        self._pending.remove(microbatch)
        self._consumed[microbatch] += 1
        return self._stage0_version[microbatch]

    def future_needs(self, version: int) -> bool:
        if not self.vertical_sync:
            return False
        # beyond open-ended orders, stage 0's forwards use its last listed version or later
        if self.open_ended and self._stage0_version and version >= max(self._stage0_version.values()):
            return True
        return any(self._stage0_version[i] == version for i in self._pending)


class DoubleBufferPolicy(_VersionStore):
    """PipeDream-2BW: every micro-batch of update window t runs on the version stage 0 held when
    the window started (t-1 once the pipeline is full), so at most two versions are alive."""

    description = "older of two buffers for a whole update window"

    def learn_orders(self, stage_actions, full_orders, synchronous_updates: int = 0) -> None:
        super().learn_orders(stage_actions, full_orders, synchronous_updates)
        m = max(1, sum(1 for a in stage_actions if a.kind is Kind.F) //
                max(1, sum(1 for a in stage_actions if a.kind is Kind.U)))
        self.window = m
        count, self._window_version = 0, {}
        for a in (full_orders[0] if full_orders else stage_actions):
            if a.kind is Kind.U:
                count += 1
            elif a.kind is Kind.F and a.index % m == 0:
                self._window_version[a.index // m] = self.epoch_start_version + count
        self._pending_windows = Counter({w: m - self._consumed[w] for w in self._window_version})

    def target_version(self, microbatch: int) -> int:
        window = microbatch // self.window
        self._pending_windows[window] -= 1
        self._consumed[window] += 1
        return self._window_version[window]

    def future_needs(self, version: int) -> bool:
        # beyond open-ended orders, later windows use the last listed window's version or later
        if self.open_ended and self._window_version and version >= max(self._window_version.values()):
            return True
        return any(self._window_version[w] == version for w, left in self._pending_windows.items() if left > 0)


#: Whether this torch can swap the memory of two storages (``UntypedStorage._swap_data_ptr_``).
CAN_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _copy_all(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:  # pragma: no cover - torch < 2.1
        for d, s in zip(dst, src):
            d.copy_(s)


class _Predicting(WeightPolicy):
    """Runs a pass on predicted weights held in the live storage, with one cache per stage.

    Each pass that predicts reads ``W_hat = W - lr*s*Delta`` through the live parameters' own
    storage, so that the autograd graph of a forward keeps aliases of the live storage and its
    backward reads whatever is live then (docs/architecture.md, "Weight versions per method").
    Two ways, the same numbers:

    * swap (the default where the parameters own their storage and torch has
      ``UntypedStorage._swap_data_ptr_``): ``W_hat`` is computed into the cache in one pass
      (``torch.add(W, Delta, alpha=-lr*s, out=cache)``), then the memory of each parameter's
      storage and of its cache are swapped, which every alias sees at once; after the pass they
      are swapped back. No copy of W, no restore pass, nothing allocated per pass.
    * write and restore (otherwise): the cache saves W (one multi-tensor copy), ``W_hat`` is
      written into the live storage (``torch.add(W, Delta, alpha=-lr*s, out=W)``), and the cache
      is copied back after the pass.

    Delta comes from :meth:`Predictor.directions`, computed once per update.
    """

    #: Private switch (tests, benchmarks): False forces the write-and-restore path.
    _swap_storage = CAN_SWAP_STORAGE

    def __init__(self, *args, sgd_momentum: str = "paper", horizon: str = "constant",
                 delta: str = "optimizer", ema_decay: Optional[float] = None, prediction_warmup: int = 0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if horizon not in HORIZONS:
            raise ValueError(f"horizon must be one of {', '.join(HORIZONS)}, got {horizon!r}")
        if delta not in DELTAS:
            raise ValueError(f"delta must be one of {', '.join(DELTAS)}, got {delta!r}")
        if ema_decay is not None and delta != "ema":
            raise ValueError("ema_decay applies with delta='ema'")
        if prediction_warmup is None or prediction_warmup < 0:
            raise ValueError(f"prediction_warmup must be 0 (off) or a number of updates, got {prediction_warmup!r}")
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
        self._work: List[tuple] = []     # per group: (group, [(W, Delta, cache)])
        self._storages: List[tuple] = []  # (live storage, cache storage) of the predicted params

    def forward_steps(self, microbatch: int) -> float:
        """The prediction steps of ``microbatch``'s forward, corrections applied."""
        if self.in_sync_warmup(microbatch):
            return 0
        return self.ramp(self.base_forward_steps(microbatch))

    def base_forward_steps(self, microbatch: int) -> float:
        """The method's own step count for ``microbatch``'s forward (no correction)."""
        raise NotImplementedError

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
            for index, (group, params, deltas) in enumerate(source.directions()):
                alpha = -self.horizon_lr(index, group, steps, disable)
                for p, delta in zip(params, deltas):
                    out[p] = torch.add(p.detach(), delta, alpha=alpha)
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
            _copy_all(self.cache, [p.data for _, p in self.named])
            self._applied_lrs = [float(g["lr"]) / self.lr_divisor() for g in self.optimizer.param_groups]

    def after_update(self) -> None:
        super().after_update()
        if self.average is not None:
            self.average.observe(self.cache, self._applied_lrs)

    def _ensure_cache(self) -> None:
        homes = [p.data_ptr() for _, p in self.named]
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
            items = []
            for p, delta in zip(params, deltas):
                i = self._index.get(p)
                if i is None:
                    continue
                # p.data: its own version counter, so writing W_hat through it (write and
                # restore) does not count as a change of the parameter (the Predictor's key)
                items.append((p.data, delta, self.cache[i]))
                if self._swap and p.numel():
                    self._storages.append((p.untyped_storage(), self.cache[i].untyped_storage()))
            self._work.append((group, items))
        self._plan_seen = plan

    def _swappable(self) -> bool:
        """Whether each parameter owns its whole storage (nothing else lives there, so swapping
        the storage's memory swaps exactly the parameter) and its cache has the same layout."""
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
        live = [p.data for _, p in self.named]
        _copy_all(self.cache, live)
        for index, (group, items) in enumerate(self._work):
            alpha = -self.horizon_lr(index, group, steps)
            for w, delta, _ in items:
                torch.add(w, delta, alpha=alpha, out=w)

        def restore() -> None:
            with torch.no_grad():
                _copy_all(live, self.cache)
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


class PipeOptimPolicy(_Predicting):
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
        if steps not in ("exact", "paper", "code"):
            raise ValueError(f"steps must be exact, paper or code, got {steps!r}")
        if backward not in ("latest", "predicted"):
            raise ValueError(f"backward must be latest or predicted, got {backward!r}")
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
        self._forward_version[microbatch] = self.version
        if self.backward_weights == "predicted" and steps:
            tensors = self.predicted(self.base_forward_steps(microbatch))
            self._held[microbatch] = tensors
            self.note_memory()
            return WeightUse({n: t.requires_grad_(True) for (n, _), t in zip(self.named, tensors)},
                             self.version, steps)
        restore = self._write_prediction(steps)
        return WeightUse(self.live_weights(), self.version, steps if restore else 0, restore)

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


class SpecTrainPolicy(_Predicting):
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
        steps = self.forward_steps(microbatch)
        self._forward_version[microbatch] = self.version
        restore = self._write_prediction(steps)
        return WeightUse(self.live_weights(), self.version, steps if restore else 0, restore)

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


POLICIES = {cls.__name__: cls for cls in (SynchronousPolicy, LatestPolicy, StashingPolicy,
                                          DoubleBufferPolicy, PipeOptimPolicy, XPipePolicy,
                                          SpecTrainPolicy)}


#: Method options that shape the schedule, not a policy (:meth:`pipeoptim.methods.Method.build_schedule`).
SCHEDULE_OPTIONS = ("sync_warmup",)


def make_policy(name: str, module: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int,
                num_stages: int, **options) -> WeightPolicy:
    """Instantiate the policy class called ``name`` for one stage (options that shape the
    schedule instead are left out)."""
    options = {k: v for k, v in options.items() if k not in SCHEDULE_OPTIONS}
    return POLICIES[name](module, optimizer, stage=stage, num_stages=num_stages, **options)
