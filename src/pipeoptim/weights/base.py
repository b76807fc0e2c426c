"""Weight policies: the interface and the policies without copies (synchronous, latest).

A policy serves one stage. Before a forward it hands the stage a :class:`WeightUse`: the tensors
to call the stage's module with (``torch.func.functional_call``), their weight version and the
prediction steps applied; around a backward it may swap in other values, around an update keep
the outgoing version. It knows only the stage's action list and optimizer, never the executor.
Forwards run on *aliases* of the storage (``param.data``: same memory, its own autograd version
counter), so an update between a forward and its backward is safe (docs/architecture.md, "Weight
versions per method"). Version v is the weights after v updates."""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch
from torch import nn

from ..schedules.actions import Action, Kind
from .corrections import delay_divisor
from .error_feedback import UpdateFeedback
from .fused import local, nbytes


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A leaf sharing ``tensor``'s storage with its own version counter, collecting a gradient."""
    return tensor.data.requires_grad_(True)


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
                 error_feedback: bool = False, sharded: bool = False) -> None:
        # the options' values arrive checked (pipeoptim.checks.check_method_options)
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
        #: error_feedback=True: the update's error fed back (weights/error_feedback.py); the
        #: stage runs it around each optimizer step
        self.feedback = UpdateFeedback(self.named) if error_feedback else None
        self.version = 0                   #: live version: updates applied so far
        self.epoch_start_version = 0
        self._skipped: list = []
        self.copy_bytes_peak = 0
        #: bytes of forward weights a recomputing stage holds for its recomputations (see
        #: :meth:`forward_weights_kept`), counted with the copies
        self.recompute_copy_bytes = 0
        self._forward_version: Dict[int, int] = {}
        #: the parameters are shards of the stage over its replicas (``runtime/sharding.py``) or its
        #: tensor ranks' part (``runtime/tensor_parallel.py``): versions are kept as copies, never
        #: by moving the live storage (FSDP gathers from it, a DTensor keeps its local tensor)
        self.sharded = sharded

    # -- schedule knowledge -----------------------------------------------------------------
    def begin_epoch(self, stage_actions: Sequence[Action], full_orders: Sequence[Sequence[Action]] = (),
                    *, open_ended: bool = False, synchronous_updates: int = 0) -> None:
        """The actions this stage will run next (and, for policies that need it, every rank's):
        the start of a schedule (a segment), at a drained point. ``open_ended``: the orders
        were built for a horizon and more mini-batches may follow the ones they list.
        ``synchronous_updates``: the schedule's first so many updates are a synchronous warm-up
        (``sync_warmup``): no prediction and no lr correction for them."""
        self.epoch_start_version = self.version
        self._skipped = []  # fp16: the positions among this schedule's updates of those skipped
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
        self._updates_before: Dict[tuple, int] = {}
        count = 0
        sync_micro = []
        for a in stage_actions:
            if a.kind is Kind.U:
                count += 1
            else:
                self._updates_before[(a.kind, a.index)] = count
                if a.kind is Kind.F and count < synchronous_updates:
                    sync_micro.append(a.index)
        self._sync_updates_end = self.applied(synchronous_updates)
        self._sync_micro = frozenset(sync_micro)

    def applied(self, updates: int) -> int:
        """The version after this schedule's first ``updates`` updates, less those skipped."""
        return self.epoch_start_version + updates - sum(1 for u in self._skipped if u < updates)

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

    def forward_weights_kept(self, microbatch: int, use: WeightUse) -> bool:
        """Whether the tensors micro-batch's forward ran on (``use``) still hold the same values
        when its backward runs (no update in between, a stash, a held prediction). A stage that
        recomputes its forward in the backward needs those values; where this is False it keeps
        a copy."""
        return False

    @contextmanager
    def backward_pass(self, microbatch: int, use: WeightUse) -> Iterator[WeightUse]:
        """Around a backward; yields what the backward runs on (for the version trace)."""
        yield WeightUse(use.weights, self.version)
        self._forward_version.pop(microbatch, None)

    def backward_values(self, use: WeightUse, used: WeightUse) -> Optional[Dict[str, torch.Tensor]]:
        """Inside :meth:`backward_pass`: the values the backward of the forward ``use`` runs on
        (``used``: what the pass yielded), for a sharded stage to write into its shards while
        FSDP gathers them; None: the live weights. Without sharding the tensors the forward
        saved already hold them."""
        return None if use.direct else used.weights

    # -- updates ------------------------------------------------------------------------------
    def before_update(self) -> None:
        pass

    def after_update(self) -> None:
        self.version += 1

    def skipped_update(self) -> None:
        """An update not applied (fp16: an inf or nan in some stage's gradients): the version
        stays, and so does every count read from it; the versions read from the schedule after
        this update come one sooner."""
        self._skipped.append(self.version - self.epoch_start_version + len(self._skipped))
        if self._sync_updates_end > self.version:
            self._sync_updates_end -= 1

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """The policy's state at a drained point of the pipeline (nothing in flight)."""
        if self._forward_version:
            raise RuntimeError(f"stage {self.stage}: cannot save a policy with micro-batches in flight")
        state = {"version": self.version, "copy_bytes_peak": self.copy_bytes_peak}
        if self.feedback is not None:
            state["error_feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.version = int(state["version"])
        self.copy_bytes_peak = int(state["copy_bytes_peak"])
        if self.feedback is not None:
            if "error_feedback" not in state:
                raise ValueError("the saved state has no error feedback (it was saved without "
                                 "error_feedback=True); resume with the options it was saved with")
            self.feedback.load_state_dict(state["error_feedback"])

    # -- memory -------------------------------------------------------------------------------
    def copy_bytes(self) -> int:
        """Bytes of weight copies held now, beyond the live weights."""
        return 0

    def note_memory(self) -> None:
        feedback = self.feedback.nbytes() if self.feedback is not None else 0
        self.copy_bytes_peak = max(self.copy_bytes_peak, self.copy_bytes() + self.recompute_copy_bytes + feedback)

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

    def forward_weights_kept(self, microbatch: int, use: WeightUse) -> bool:
        return True  # no update between a forward and its backward

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

    def forward_weights_kept(self, microbatch: int, use: WeightUse) -> bool:
        return self.updates_between(microbatch) == 0
