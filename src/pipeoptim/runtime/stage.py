"""One pipeline stage: its passes F, B (I and W) and U on its module.

Whichever executor calls it (every stage in one process, or one per process), activations and
gradients go in and out as tensors or tuples of tensors; the stage never sends anything itself.
The weight versions are its policy's; what it reports goes to the observers it is given
(``runtime/record.py``, ``runtime/probes.py``, ``runtime/held.py``); what it calls on its
collaborators is declared in ``runtime/interfaces.py``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from ..weights.base import local, nbytes
from ..weights.error_feedback import GradientDelay
from ..weights.policies import WeightPolicy, WeightUse
from . import recompute, split_backward, weight_grads
from .compiled import CompiledForward
from .defaults import PRECISIONS
from .held import HeldActivations, signature
from .interfaces import DelayAware, GradientSync, OverlappedSync
from .loss_scaling import LossScaler
from .probes import PredictionProbes
from .record import StageRecord, TraceEntry, UpdateEntry  # noqa: F401 (the entries: read here by fit.py)
from .tensor_parallel import in_layout, plain
from .sharding import StageShards
from .tied import TiedWeights
from .values import Activation, as_tuple, detach_for_send, leaf_inputs, to_device


def _check_scalar(loss: Any) -> None:
    if not torch.is_tensor(loss) or loss.numel() != 1:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (e.g. a mean over the batch), got "
                         f"{shape}; reduce it, e.g. with reduction='mean'")


class Stage:
    """Stage ``index`` of ``num_stages``: runs forwards, backwards and updates for its module.

    Collaborators (None: none): ``shards`` (the module sharded over the stage's replicas: passes
    call it directly, with the version they need written into its shards), ``tensor`` (the module
    split over the stage's tensor ranks: passes run on its DTensors, a backward with its version
    written into the live storage the forward's aliases share), ``tied`` (weights
    shared with other stages), ``grad_sync`` (the gradients reduced over the stage's replicas
    before each update: the world's ``replica_sync``, or the stage's shards), ``loss_scaling`` (fp16: the
    process's loss scale, runtime/loss_scaling.py; made here if not given). Observers: ``record``,
    ``probes``, ``held``."""

    def __init__(self, index: int, num_stages: int, module: nn.Module,
                 optimizer: torch.optim.Optimizer, policy: WeightPolicy, *,
                 loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
                 scheduler: Optional[Any] = None, clip_grad_norm: Optional[float] = None,
                 precision: str = "fp32", device: Optional[torch.device] = None,
                 recompute: bool = False, compile: Optional[str] = None,
                 first: Optional[bool] = None, last: Optional[bool] = None,
                 shards: Optional[StageShards] = None, tensor: Optional[Any] = None,
                 tied: Optional[TiedWeights] = None, replica_of: Optional[int] = None, takes_target: bool = False,
                 grad_sync: Optional[GradientSync] = None, record: Optional[StageRecord] = None,
                 probes: Optional[PredictionProbes] = None, held: Optional[HeldActivations] = None,
                 loss_scaling: Optional[LossScaler] = None, clock: Optional[Callable[[], float]] = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.index, self.num_stages = index, num_stages
        self.module, self.optimizer, self.policy, self.loss_fn = module, optimizer, policy, loss_fn
        self.scheduler = scheduler  #: stepped right after every update (update j: the same lr on every stage)
        self.clip_grad_norm = clip_grad_norm  #: per-stage clipping (max norm) before each update; None: none
        self.precision = precision
        #: fp16: the loss scale (runtime/loss_scaling.py), one per process, shared by its stages
        self.loss_scaling = loss_scaling if loss_scaling is not None or precision != "fp16" else LossScaler()
        self.unscaled = False  #: fp16: this update's gradients are unscaled (the executor's agreement)
        #: where this stage's parameters live and its passes run; inputs are moved here
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        #: keep only the input of each micro-batch in flight; rerun the forward in its backward
        self.recompute = recompute
        self.compiled = CompiledForward(module, compile) if compile else None
        self.shards, self.tied, self.grad_sync = shards, tied, grad_sync
        self._overlapped = grad_sync if isinstance(grad_sync, OverlappedSync) else None
        self.tensor = tensor  #: runtime/tensor_parallel.StageTensors (None: the stage whole on this process)
        self._delay_aware = isinstance(optimizer, DelayAware)  # (a Protocol test costs tens of us: once)
        #: the first and last stage of its pipeline (default: of the one chain 0 .. N-1; a mirrored
        #: method's second pipeline starts and ends too)
        self.is_first = index == 0 if first is None else first
        self.is_last = index == num_stages - 1 if last is None else last
        #: a bidirectional run's second-pipeline stage: the index of the stage whose piece it copies
        self.replica_of = replica_of
        #: the last stage's module takes the target as a second argument (a model that computes
        #: its own loss from the labels)
        self.takes_target = takes_target
        #: what the passes report: the version trace, the updates' learning rates, busy seconds and counts
        self.record = record if record is not None else StageRecord(index)
        #: the seconds the record's times are read from (a timer of stages on an accelerator: one that
        #: waits for the device first, ``profile.Clock.now``)
        self.clock = clock if clock is not None else time.perf_counter
        self.probes = probes if probes is not None else PredictionProbes()
        self.held = held if held is not None else HeldActivations()
        self.trace_offset = 0  #: added to the micro-batch numbers in the trace (:meth:`start_segment`)
        #: how stale the next update's gradients are (what error feedback and a delay-aware optimizer read)
        self.delays = GradientDelay()
        self._buffers: Optional[List[torch.Tensor]] = None
        self._kept_bytes: Dict[int, int] = {}
        #: per micro-batch in flight: the tied weights' values from their owner (a holder's own leaves)
        self._tied_values: Dict[int, Dict[str, torch.Tensor]] = {}
        self._synced = self._replicas_synced = False
        self._saved: Dict[int, Tuple[Activation, Tuple[torch.Tensor, ...], WeightUse]] = {}
        #: micro-batches whose input half ran and whose weight half has not (split backward)
        self._weight_halves: Dict[int, Tuple[Any, WeightUse, contextlib.ExitStack, WeightUse]] = {}

    @property
    def overlapped(self) -> Optional[OverlappedSync]:
        """The stage's gradient sync where it reduces the last backward's gradients as they become
        final (the executor starts it before that backward), None where it reduces at the update."""
        return self._overlapped

    # -- actions ------------------------------------------------------------------------------
    def forward(self, microbatch: int, inputs: Activation, target: Optional[torch.Tensor] = None,
                loss_scale: float = 1.0) -> Activation:
        """Forward of one micro-batch. The last stage also computes the (scaled) loss and
        returns its value as a float; other stages return the activation to send on."""
        start = self.clock()
        probe = self.probes.every and self.probes.before_forward(microbatch, self.trace_offset + microbatch,
                                                                 self.policy)
        use = self.policy.forward_weights(microbatch)
        direct = use.direct or self.shards is not None
        held_back = None
        try:  # from here on the live storage may hold predicted weights until use.done()
            if probe:
                self.probes.forward_weights(microbatch, use, self.policy)
            extra = self.tied.forward_values(microbatch, use.weights) if self.tied is not None else {}
            weights = {**use.weights, **(self.tensor.wrap(extra) if self.tensor is not None else extra)} \
                if extra else use.weights
            if extra:
                self._tied_values[microbatch] = extra
            if self.shards is not None:  # the pass's version (and the owner's tied values) into the shards
                held_back = self.shards.hold({**({} if use.direct else use.weights), **extra})
            inputs = to_device(inputs, self.device)
            leaves = leaf_inputs(inputs) if not self.is_first else inputs
            target = to_device(target, self.device) if self.is_last else None

            def run(values: Activation) -> Activation:
                args = (values, target) if self.takes_target else (values,)
                if self.compiled is not None:
                    output = self.compiled(None if direct else weights, args)
                else:
                    output = self.module(*args) if direct else functional_call(self.module, weights, args)
                if self.tensor is not None:  # what a style's collective still owes, waited for
                    output = plain(output)
                if self.is_last:
                    output = self.loss_fn(output, target)
                    # a micro-batch with no real item (its labels all -100): a mean over nothing is
                    # nan, and weighs nothing; its gradient is zero, as in the whole mini-batch's loss
                    output = torch.nan_to_num(output) * 0.0 if loss_scale == 0 else output * loss_scale
                    _check_scalar(output)
                return output

            if self._buffers is None:  # updated in place (BatchNorm's statistics): found once
                self._buffers = list(self.module.buffers())
            # what the forward saves that is a weight, not an activation (the tied values included)
            # (read inside the forward: a sharded stage's weights are those FSDP gathered)
            not_activations = lambda: [*(self.module.parameters() if self.shards is not None  # noqa: E731
                                         else self.parameters()), *self._buffers,
                                       *([] if direct else weights.values())]
            with torch.enable_grad(), self.autocast(), \
                    self.held.forward(microbatch, not_activations, signature(leaves, target),
                                      refresh=self.shards is not None):
                if self.recompute:
                    kept = self._keep_forward_values(microbatch, use)
                    output = recompute.checkpointed(run, leaves, kept, before=self.shards.gather
                                                    if self.shards is not None else None)
                    self._count_kept(microbatch, kept)
                else:
                    output = run(leaves)
                # fp16: the backward starts from the loss times the scale; the loss reported stays
                scaled = self.loss_scaling.scaled(output) if self.is_last and self.loss_scaling is not None \
                    else output
        finally:
            if held_back is not None:
                held_back()
            use.done()
        self.policy.note_memory()
        self._saved[microbatch] = (leaves, as_tuple(scaled), use)
        self.held.keep(microbatch, (() if self.is_first else as_tuple(leaves))
                       + (() if self.is_last else as_tuple(output)))
        self._passed("F", microbatch, use, start)
        if self.is_last:  # on an accelerator the 0-dim tensor: queuing work never waits for the device
            return float(output.detach()) if self.device.type == "cpu" else output.detach()
        return detach_for_send(output)

    def _keep_forward_values(self, microbatch: int, use: WeightUse) -> Optional[recompute.KeptValues]:
        """What the recomputation of this forward runs on: nothing where the forward's tensors
        still hold its values at the backward, else a copy (a sharded stage's: of the weights
        FSDP gathers for this forward, whole, written back where FSDP gathers the backward's)."""
        if use.direct or self.policy.forward_weights_kept(microbatch, use):
            return None
        if self.shards is not None:
            return self.shards.keep_gathered()
        return recompute.copy_forward_values(list(use.weights.values()))

    def _count_kept(self, microbatch: int, kept: Optional[recompute.KeptValues]) -> None:
        size = sum(copy.numel() * copy.element_size() for _, copy in kept or ())
        if size:
            self._kept_bytes[microbatch] = size
            self.policy.recompute_copy_bytes += size

    def autocast(self):
        """The autocast context of this stage's passes (bf16, fp16: ``torch.autocast``; parameters,
        gradients, optimizer state and the prediction stay fp32)."""
        if self.precision != "fp32":
            return torch.autocast(device_type=self.device.type,
                                  dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)
        return contextlib.nullcontext()

    def backward(self, microbatch: int, grad_output: Optional[Activation] = None) -> Optional[Activation]:
        """Backward of one micro-batch; returns the gradient to send to the previous stage
        (None for the first stage). ``grad_output`` matches the forward's output tuple, with
        None for entries that carry no gradient."""
        start = self.clock()
        leaves, tensors, grads, use = self._backward_start(microbatch, grad_output)
        hooks = self._announce(use)  # the last backward before an update
        try:
            with self.policy.backward_pass(microbatch, use) as used:
                held_back = self._hold_backward_values(microbatch, use, used)
                try:
                    if tensors:
                        torch.autograd.backward(tensors, grads)
                finally:
                    held_back()
        finally:
            for hook in hooks:
                hook.remove()
        self._backward_done(microbatch, "B", use, used, start)
        return self._to_previous(leaves, lambda v: v.grad if v.requires_grad else None)

    def backward_input(self, microbatch: int, grad_output: Optional[Activation] = None) -> Optional[Activation]:
        """The input half of a split backward (a schedule's ``I``): the gradient to send to the
        previous stage, as :meth:`backward` returns it; what the weight gradients need stays
        for :meth:`backward_weight` (``runtime/split_backward.py``). The policy's backward pass
        spans both halves (it is entered here and left by the weight half)."""
        start = self.clock()
        leaves, tensors, grads, use = self._backward_start(microbatch, grad_output)
        inputs = [v for v in as_tuple(leaves) if torch.is_tensor(v) and v.requires_grad]
        if self.shards is not None:  # what the graph holds: the weights FSDP gathered (kept to the update)
            weights = [p for p in self.module.parameters() if p.requires_grad]
        else:
            weights = self.parameters() if use.direct else list(use.weights.values())
            if self.tied is not None:  # a weight another stage owns, read here: its gradient is summed too
                weights += self.tied.read_not_owned()
        weights += list(self._tied_values.get(microbatch, {}).values())
        scope = contextlib.ExitStack()
        used = scope.enter_context(self.policy.backward_pass(microbatch, use))
        scope.callback(self._hold_backward_values(microbatch, use, used))
        try:
            # a compiled forward's backward is one graph: both halves' gradients at once
            halves = split_backward.backward_together if self.compiled is not None else \
                split_backward.backward_input
            found, pending = halves(tensors, grads, inputs, weights)
        except BaseException:
            scope.close()
            raise
        self._weight_halves[microbatch] = (pending, use, scope, used)
        self._passed("I", microbatch, used, start)
        by_leaf = {id(v): g for v, g in zip(inputs, found)}
        return self._to_previous(leaves, lambda v: by_leaf.get(id(v)))

    def backward_weight(self, microbatch: int) -> None:
        """The weight half of a split backward (a schedule's ``W``): the weight gradients of the
        micro-batch whose input half ran, accumulated into the parameters' ``.grad``."""
        start = self.clock()
        pending, use, scope, used = self._weight_halves.pop(microbatch)
        overlap = self._overlapping()  # the last W before an update
        hooks = self._announce(use) if pending.full else []
        try:
            with scope:
                split_backward.backward_weight(pending, weight_grads.announce_groups(
                    self._overlapped.ready_all, use, self.parameters()) if overlap else None)
        finally:
            for hook in hooks:
                hook.remove()
        self._backward_done(microbatch, "W", use, used, start)

    def _backward_start(self, microbatch: int, grad_output: Optional[Activation]):
        """``microbatch``'s saved forward: its leaves, the outputs its backward starts from and
        their gradients (None: the loss's 1), and the weights it ran on."""
        leaves, outputs, use = self._saved.pop(microbatch)
        if self.probes.every:
            self.probes.at_backward(microbatch, self.trace_offset + microbatch, self.policy)
        if self.is_last:
            return leaves, list(outputs), [None], use
        grad_output = to_device(grad_output, self.device)
        pairs = [(o, g) for o, g in zip(outputs, as_tuple(grad_output))
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        return leaves, [o for o, _ in pairs], [g for _, g in pairs], use

    def _overlapping(self) -> bool:
        """Whether the gradients are reduced over the replicas as this backward makes them final."""
        return self._overlapped is not None and self._overlapped.overlapping

    def _announce(self, use: WeightUse) -> List[Any]:
        """The hooks that announce each parameter's final gradient to an overlapping sync."""
        if not self._overlapping():
            return []
        return weight_grads.announce_on_accumulate(self._overlapped.ready, use, self.parameters(), self.policy.named)

    def _hold_backward_values(self, microbatch: int, use: WeightUse, used: WeightUse) -> Callable[[], None]:
        """A sharded stage: the backward's version (and the owner's tied values of
        ``microbatch``) into the shards FSDP gathers for it, and how to put the live values back;
        a stage split over tensor ranks: the backward's version into the live storage its forward's
        aliases share; nothing otherwise."""
        if self.shards is None:
            if self.tensor is not None:
                return self.tensor.write(self.policy.backward_values(use, used))
            return lambda: None
        return self.shards.hold({**(self.policy.backward_values(use, used) or {}),
                                 **self._tied_values.get(microbatch, {})})

    def _backward_done(self, microbatch: int, kind: str, use: WeightUse, used: WeightUse, start: float) -> None:
        """The weight gradients of ``microbatch`` are in: onto the parameters, a tied weight's to
        its owner (asynchronous methods; a sharded holder's is its copy's, which FSDP reduced:
        its shard goes to the owner's same shard); its recomputation's copy and activations go."""
        weight_grads.collect(use, self.policy.named)
        if self.tied is not None:
            extra = self._tied_values.pop(microbatch, {})
            if self.shards is not None:
                for name, leaf in extra.items():
                    copy = self.shards.shard_of(name)
                    leaf.grad = local(copy.grad) if copy.grad is not None else None
                    copy.grad = None
            self.tied.backward_done(microbatch, extra)
        self.policy.recompute_copy_bytes -= self._kept_bytes.pop(microbatch, 0)
        self.held.release(microbatch)
        self._passed(kind, microbatch, used, start)

    def _to_previous(self, leaves: Activation, grad_of: Callable[[torch.Tensor], Any]) -> Optional[Activation]:
        """The gradient to send to the previous stage, one per input leaf (None: the first stage)."""
        if self.is_first:
            return None
        grads_in = tuple(grad_of(v) if torch.is_tensor(v) else None for v in as_tuple(leaves))
        return grads_in if isinstance(leaves, tuple) else grads_in[0]

    def _passed(self, kind: str, microbatch: int, used: WeightUse, start: float) -> None:
        self.record.passed(kind, self.trace_offset + microbatch, used, self.clock() - start)
        self.delays.saw(kind, microbatch, used.version)

    @contextlib.contextmanager
    def running(self, module: nn.Module) -> Iterator[None]:
        """Within: the stage's passes run ``module`` in place of its own (a traced model's
        eval-mode graph over the same parameters, for an evaluation)."""
        own, self.module = self.module, module
        try:
            yield
        finally:
            self.module = own

    def start_segment(self, trace_offset: int) -> None:
        """A segment of the run begins: its micro-batch j is number ``trace_offset + j`` of the run
        in the trace and the probes."""
        self.trace_offset = trace_offset

    def unscale_gradients(self) -> torch.Tensor:
        """fp16: this update's gradients unscaled by the process's loss scale; the found-inf flag
        (0-dim, on the stage's device), over the shards of every replica where the stage is
        sharded, of every tensor rank where split (the executor's agreement on the update reads it:
        runtime/loss_scaling.UpdateAgreement)."""
        found = self.loss_scaling.unscale([local(g) for g in self.grads()], self.device)
        if self.shards is not None:
            found = self.shards.any_replica(found)
        if self.tensor is not None:
            found = self.tensor.any_replica(found)
        self.unscaled = True
        return found

    def gradient_delay(self) -> int:
        """The next update's delay (:class:`~pipeoptim.weights.error_feedback.GradientDelay`)."""
        return self.delays.of(self.policy.version)

    def update(self, grad_scale: Optional[torch.Tensor] = None, skip: bool = False) -> None:
        """One optimizer step from the gradients accumulated since the last one, then the
        scheduler's step. ``grad_scale`` multiplies the gradients first (a clipping coefficient
        computed over several stages); without it, ``clip_grad_norm`` clips this stage's own.
        ``skip`` (fp16: some stage's gradients held an inf or nan): no update at all, the
        gradients dropped (runtime/loss_scaling.py)."""
        start = self.clock()
        self.sync_gradients()
        self._synced = self._replicas_synced = False
        if self.loss_scaling is not None and not self.unscaled:
            raise RuntimeError(f"stage {self.index}: fp16's gradients are unscaled by the executor's agreement "
                               f"on the update (runtime/loss_scaling.UpdateAgreement) before Stage.update")
        self.unscaled = False
        if skip:
            self.delays.take(self.policy.version)
            self.optimizer.zero_grad(set_to_none=True)
            self.policy.skipped_update()
            self.record.skipped(self.policy.version, self.clock() - start)
            return
        if grad_scale is None and self.clip_grad_norm is not None and (self.shards or self.tensor) is not None:
            # torch's clip_grad_norm_ coefficient, from the norm over the shards
            grad_scale = (self.clip_grad_norm / (self.grad_norm() + 1e-6)).clamp(max=1.0)
        if grad_scale is not None:
            grads = [local(g) for g in self.grads()]
            if grads:
                with torch.no_grad():
                    torch._foreach_mul_(grads, grad_scale.to(grads[0].device))
        elif self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_grad_norm)
        self.policy.before_update()
        groups = self.optimizer.param_groups
        divisor = self.policy.lr_divisor()
        if divisor != 1.0:  # a delay correction: this update only, the scheduler's lr put back after
            scheduled = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] = g["lr"] / divisor
        self.record.updating(self.policy.version, tuple(float(g["lr"]) for g in groups), nbytes(self.grads()))
        delay, feedback = self.delays.take(self.policy.version), self.policy.feedback
        if self._delay_aware:
            self.optimizer.set_pipeline_delay(delay)
        if feedback is not None:
            feedback.before_step()
        self.optimizer.step()
        if feedback is not None:
            feedback.after_step(delay)
        if divisor != 1.0:
            for g, lr in zip(groups, scheduled):
                g["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.tied is not None:
            self.tied.after_update()
        self.policy.after_update()
        self.record.took("U", self.clock() - start)

    # -- helpers ------------------------------------------------------------------------------
    def parameters(self) -> List[nn.Parameter]:
        return [p for _, p in self.policy.named]

    def grads(self) -> List[torch.Tensor]:
        return [p.grad for _, p in self.policy.named if p.grad is not None]

    def sync_gradients(self) -> None:
        """Average the gradients over the stage's replicas and sum a tied weight's over its
        holders, once per update (before its norm is taken for global clipping, or by the update
        itself)."""
        if not self._synced:
            if self.tensor is not None:  # each gradient in its parameter's layout, shard by shard
                for param in self.module.parameters():
                    in_layout(param)
            if self.tied is not None and self.tied.round is not None:
                self.tied.round.reduce()  # every stage of this process: their replicas, then the ties
            else:
                self.sync_replicas()
                if self.tied is not None:
                    self.tied.before_update()
            self._synced = True

    def sync_replicas(self) -> None:
        """Average the gradients over the stage's replicas, once per update (part of
        :meth:`sync_gradients`; runtime/tied.TieRound asks every stage of a process first)."""
        if not self._replicas_synced and self.grad_sync is not None:
            # (a synchronous method's copy of a weight another stage owns, with its own)
            held = [t.param for t in self.tied.held() if t.holders[0] != self.index] if self.tied is not None else []
            self.grad_sync(self.parameters() + held)
        self._replicas_synced = True

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of this stage's accumulated gradients (a 0-dim tensor on its device)."""
        grads = self.grads()
        if self.copied is not None:  # split over processes: the norm of the whole, from every part
            return self.copied.grad_norm(grads, self.device)
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    @property
    def copied(self) -> Optional[Any]:
        """What trains a copy of this stage's layers split over processes (its FSDP shards, else its
        tensor ranks' part; sharded and split, the shards own the original), None: its own layers."""
        return self.shards if self.shards is not None else self.tensor

    @property
    def compilations(self) -> Optional[int]:
        """The graphs torch.compile has made of this stage's forward so far (None: eager)."""
        return self.compiled.compilations if self.compiled is not None else None

    @property
    def in_flight(self) -> int:
        """Micro-batches whose backward has not finished (weight half included)."""
        return len(self._saved) + len(self._weight_halves)
