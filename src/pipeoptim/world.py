"""Where a Pipeline's stages run: the one interface of the local and the torchrun case.

A :class:`~pipeoptim.pipeline.Pipeline` never asks which case it is in. It asks its *world*:
how many stages and replicas the job makes, which stages this process builds, which executor
runs a segment or forward-only work alone, how the losses of a segment reach every rank, how a
value of one stage or of every stage reaches every rank, how the model is evaluated, and when
the world ends. :class:`World` is the one-process case (:class:`LocalWorld` by name): every
stage in this process (one or several devices); :class:`~pipeoptim.torchrun.Torchrun` derives
from it, each process holding its rank's stages and sharing over the pipeline's control group.
:func:`save_checkpoint` and :func:`load_checkpoint` serve both, on the world's ``everyone`` and
``checkpoint_group`` (docs/architecture.md, "The Pipeline under torchrun"); the manifest is
written once every process's part of the checkpoint is complete."""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import nn

from .runtime.replicas import copy_to_replicas
from .checkpoint import (checkpoint_name, checkpoint_state, checksums, load_state, newest_whole, plan_load, prune,
                         read_manifest, save_manifest, write_state)
from .errors import CheckpointError, option
from .state_names import StateNames
from .methods import Method
from .runtime.layout import Layout, plan_layout
from .runtime.forward_only import NO_BATCHES, ForwardOnly, Weight, samples
from .runtime.executor import Executor
from .runtime.local import Mailbox
from .runtime.interfaces import GradientSync
from .runtime.segment import ScheduleFor
from .runtime.sharding import released
from .runtime.spec import RESUME_MATCHES
from .runtime.stage import Stage
from .schedules.fill import forward_alone
from .runtime.values import to_device

DeviceSpec = Union[str, torch.device, Sequence[Union[str, torch.device]]]
T = TypeVar("T")


class OnStageDevices(nn.Module):
    """The trained model as one module whose forward runs each stage's layers on that stage's
    device, moving the activations between them, and returns the output on the CPU: what a
    task's evaluation (written for a model on one device) can call when the stages are spread.
    ``train()``/``eval()`` reach the model inside."""

    def __init__(self, model: nn.Sequential, stages: Sequence[Stage]) -> None:
        super().__init__()
        self.model = model
        self._parts = [(stage.module, stage.device) for stage in stages]

    def forward(self, inputs: Any) -> Any:
        value = inputs
        for module, device in self._parts:
            value = module(to_device(value, device))
        return to_device(value, torch.device("cpu"))


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` is: its first parameter's device (or buffer's; the CPU for neither)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def one_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a device that tensors report (``cuda`` is the current CUDA device)."""
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {error}; give a device such as 'cpu' or 'cuda:0'") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {chosen}: no CUDA device is available here; give 'cpu'")
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def whole_model(model: nn.Module, device: torch.device,
                values: Optional[Dict[str, torch.Tensor]] = None) -> nn.Module:
    """``model`` with ``values`` (its state-dict names -> tensors; None: its own values) loaded,
    every parameter and buffer on ``device``: ``model`` itself where each already lies there
    (loaded in place), else a copy made now on ``device``, its tensors copied there one by one
    (never a second copy on another device), a tied parameter one tensor under all its names.
    A parameter whose memory is released (a sharded stage's original: ``sharding.released``)
    takes its value from ``values``."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    if device.type != "meta" and all(t.device == device and not released(t) for _, t in named):
        if values is not None:
            model.load_state_dict(values)
        return model
    memo: Dict[int, Any] = {}
    for name, tensor in named:
        if id(tensor) in memo:
            continue
        source = (values or {}).get(name, tensor)
        if released(source) and device.type != "meta":
            raise RuntimeError(f"{name} holds no values in this process (a sharded stage's, released) "
                               f"and none were gathered for it")
        moved = source.detach().to(device, copy=True)
        memo[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    return copy.deepcopy(model, memo)


def resolve_devices(devices: DeviceSpec, stages: int) -> List[torch.device]:
    """One device per stage. ``"auto"``: ``cuda:0..N-1`` when N GPUs are visible, the GPUs in
    contiguous blocks when fewer are (stage k on ``cuda:k*G//N``), else the CPU. One device
    (``"cpu"``, ``"cuda:1"``) puts every stage there; a list gives stage k ``devices[k]``.
    Its refusals live here, not in ``checks.py``: they need the machine's devices and the cut's
    stage count, known when the stages are placed."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(devices, str) and devices == "auto":
        if visible == 0:
            return [torch.device("cpu")] * stages
        return [torch.device("cuda", k * visible // stages) for k in range(stages)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices] * stages
    try:
        chosen = [torch.device(d) for d in devices]
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{option('devices')}: {error}; give 'auto', a device such as 'cpu' or 'cuda:0', or "
                         f"one per stage") from None
    if len(chosen) != stages:
        raise ValueError(f"{option('devices')} lists {len(chosen)} devices for {stages} stages; give one per "
                         f"stage, one device for all, or 'auto'")
    for d in chosen:
        if d.type == "cuda":
            index = d.index if d.index is not None else 0
            if index >= visible:
                raise ValueError(f"device {d} does not exist: {visible} CUDA device(s) visible; "
                                 f"use {option('devices', 'auto')} or fewer stages per GPU")
        elif d.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError("device mps is not available on this machine")
    return [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in chosen]


class World:
    """What a Pipeline needs from the place its stages run (see the module's docstring), with the
    one-process case as its behaviour: every stage in this process (on one device or several),
    every value already here. :class:`~pipeoptim.torchrun.Torchrun` overrides what differs."""

    rank = 0               #: this process's rank in the job (0 in one process)
    replica = 0            #: which replica of the pipeline this process belongs to
    replicas = 1           #: replicas of the pipeline (1 without data parallelism)
    processes = 1          #: processes of the job (1 in one process)
    #: True where the losses are checked and reported at each drain, on every rank at once
    #: (:meth:`share_losses`); False where they are reported as each completes
    losses_at_drain = False
    #: this process's completed losses are a part of each window's (a bidirectional run's last rank
    #: of one pipeline: its halves; with replicas: its replica's): kept for the drain, whose
    #: shared losses every rank returns, never returned by step()
    partial_losses = False
    #: forward-only work (an evaluation) can run in a synchronous segment's bubbles (one replica)
    fills_bubbles = True

    def layout(self, method: Method, stages: Optional[int], partition: Optional[Sequence[int]],
               chunks: Optional[int], data_parallel: Optional[int], tensor_parallel: int = 1) -> Layout:
        """The run's layout in this world (:func:`~pipeoptim.runtime.layout.plan_layout`; one
        process: no replicas, no tensor ranks, refused before by ``checks.check_one_process``)."""
        return plan_layout(method, stages=stages, partition=partition, chunks=chunks)

    def place(self, devices: DeviceSpec, stages: int) -> List[torch.device]:
        """The device of each stage (the ones this process does not hold: its own device)."""
        return resolve_devices(devices, stages)

    def own_rank(self, ranks: int) -> Optional[int]:
        """This process's rank in its pipeline of ``ranks`` (None: it builds every stage)."""
        return None

    def replica_sync(self, stages: int, replicas: int, sharded: bool) -> Optional[GradientSync]:
        """What averages the gradients of this process's stages over their replicas (None: one
        replica, as in one process, or sharded: FSDP reduces them)."""
        return None

    def stage_shards(self, stages: int, replicas: int, synchronous: bool) -> Callable[[], Any]:
        """What shards each stage this process builds over its replicas (``shard_replicas``)."""
        raise ValueError("shard_replicas shards each stage over its replicas' processes: launch with torchrun")

    def stage_tensors(self, stages: int, replicas: int, plan: Dict[str, Any], kinds: Dict[str, str],
                      names: Dict[int, List[str]]) -> Callable[[], Any]:
        """What splits each stage this process builds over its tensor ranks (``tensor_parallel``)."""
        raise ValueError("tensor_parallel splits each stage over processes: launch with torchrun")

    def connect(self, stages: List[Stage], replicas: int, placement: Optional[List[int]] = None) -> None:
        """Make the links between the stages (and the replicas), every rank at the same point;
        ``placement``: the pipeline rank of each stage (default: stage k on rank k). Here the
        stages hand their values over in memory."""

    def executor(self, stages: List[Stage], schedule_for: ScheduleFor, *, expected: Optional[int],
                 trace_offset: int, clip_global: Optional[float],
                 forward_only: Optional[ForwardOnly] = None) -> Executor:
        """A new executor of one segment over ``stages`` (``feed`` / ``finish`` /
        ``take_completed``), with the forward-only work its schedule's E actions run."""
        return Executor(stages, Mailbox(), schedule_for, expected=expected, trace_offset=trace_offset,
                        clip_global=clip_global, forward_only=forward_only)

    def forward_executor(self, stages: List[Stage], work: ForwardOnly) -> Executor:
        """A new executor of forward-only ``work`` alone over ``stages`` (the model's, once), on a
        drained pipeline (``Executor.feed_forward_only``): here every stage on one rank."""
        one_rank = [0] * stages[0].num_stages
        return Executor(stages, Mailbox(), lambda n: forward_alone(one_rank, stages[-1].index, n), forward_only=work)

    def run_alone(self, stages: List[Stage], work: ForwardOnly, items: Iterable[Tuple[Any, Any]]) -> None:
        """``work`` alone on the drained pipeline: each of ``items``, an ``(inputs, target)``
        pair, through ``stages`` as it is read (a loader is never held whole)."""
        executor = self.forward_executor(stages, work)
        for inputs, target in items:
            executor.feed_forward_only(inputs, target)
        executor.finish()
        if not len(work):
            raise ValueError(NO_BATCHES)

    def agree(self, value: T, what: str) -> T:
        """Rank 0's ``value`` on every rank of the job, before the stages are connected (a
        choice each rank would make differently, such as a partition from a profile)."""
        return value

    def share_losses(self, losses: List[float]) -> List[float]:
        """A drained segment's losses as every rank must record them."""
        return losses

    def replica_total(self, value: int, what: str) -> int:
        """The sum of ``value`` over this process's stage's replicas (each replica's own count)."""
        return value

    def share(self, value: T, src: int, what: str) -> T:
        """Stage ``src``'s ``value`` on every rank (``what``: the step, for errors)."""
        return value

    def all_stages(self, own: List[T], what: str) -> List[T]:
        """One value per stage, in stage order, on every rank; ``own`` holds this process's stages'."""
        return list(own)

    def everyone(self, value: T, what: str) -> List[T]:
        """Every process's ``value``, in rank order, on every process of the job (every replica's too)."""
        return [value]

    def checkpoint_group(self, background: bool = False) -> Any:
        """The process group a checkpoint is written and read over (None: this process alone);
        ``background``: another one, for the writes that go on beside training."""
        return None

    def evaluate(self, stages: List[Stage], loader: Iterable, score: Callable, weight: Weight = samples) -> float:
        """The mean of ``score(output, target)`` over the samples of ``loader`` (each mini-batch
        weighing ``weight(inputs, target)``), on every rank: forward-only work alone."""
        work = ForwardOnly(score=score, weight=weight)
        self.run_alone(stages, work, loader)
        return self.shared_mean(*work.scores.sums())

    def shared_mean(self, summed: float, count: int) -> float:
        """An evaluation's mean from the sum of its scores over ``count`` samples (where the
        last stage scored it), on every rank."""
        return summed / count

    def forward(self, stages: List[Stage], inputs: Any) -> Any:
        """The output of the whole model for ``inputs`` (one process only)."""
        outputs: Dict[int, Any] = {}
        self.run_alone(stages, ForwardOnly(on_output=outputs.__setitem__), [(inputs, None)])
        return outputs[0]

    def gather_model(self, model: nn.Module, stages: List[Stage], device: torch.device) -> nn.Module:
        """The trained model whole on ``device``, every stage's live weights in it
        (:func:`whole_model`; ``model``: this process's copy of the whole, built over)."""
        return whole_model(model, device)  # the stages' modules are the model's own layers

    def evaluate_model(self, model: nn.Module, stages: List[Stage], evaluate: Callable[[nn.Module], float],
                       evaluating: Callable[[], Any]) -> float:
        """``evaluate(the trained model)``, measured once and shared with every rank
        (``evaluating()``: the context in which the stages run as the model in eval mode)."""
        on_cpu = all(stage.device.type == "cpu" for stage in stages)
        value = float(evaluate(model if on_cpu else OnStageDevices(model, stages)))
        model.train()
        return value

    def comm_stats(self) -> Dict[str, Dict[str, float]]:
        """This process's messages to its neighbours so far: per link, bytes and seconds waited."""
        return {}

    def close(self) -> None:
        """End this process's part of the job (a second call does nothing)."""


class LocalWorld(World):
    """Every stage in this process: the executor runs them all, every value is already here
    (:class:`World`'s own behaviour, by name)."""


# -- the checkpoint of a run: one writer, one reader ------------------------------------------

class Loaded(NamedTuple):
    """A checkpoint loaded into the stages: its folder, its manifest, this process's saved RNG
    state (not applied yet)."""

    folder: Path
    manifest: Dict[str, Any]
    rng: Dict[str, Any]


class PendingCheckpoint:
    """A checkpoint whose files are being written (in the background, or just now): :meth:`finish`
    waits for this process's part, then, once every process's part is complete, rank 0 moves the
    folder into place, writes the manifest with every file's checksum and prunes the older
    checkpoints; nobody goes on before the manifest names the new checkpoint as the latest."""

    def __init__(self, world: World, store: Path, folder: Path, partial: Path, info: Dict[str, Any],
                 written: Any = None) -> None:
        self.world, self.store, self.folder, self.partial, self.info = world, store, folder, partial, info
        self.written = written  #: the background write's future (None: written already)

    def finish(self, problem: Optional[str] = None) -> Path:
        world = self.world
        if self.written is not None:
            try:
                self.written.result()
            except Exception as error:  # noqa: BLE001 - every rank must hear of it
                problem = f"{type(error).__name__}: {error}"
        _raise_any(world, problem and f"{self.folder}: cannot be written ({problem})", "writing the checkpoint")
        if world.rank == 0:
            if self.folder.exists():  # an older run's at this position (resumed from before it): not the latest
                shutil.rmtree(self.folder)
            os.replace(self.partial, self.folder)
            save_manifest(self.folder, self.info, checksums(self.folder))
            prune(self.store, keep=2)
        world.everyone(None, "waiting for the checkpoint's manifest")
        return self.folder


def save_checkpoint(world: World, store: Path, stages: List[Stage], position: Tuple[int, int],
                    fields: Dict[str, Any], *, background: bool = False,
                    names: Optional[StateNames] = None) -> Optional[PendingCheckpoint]:
    """Checkpoint a drained pipeline at ``position`` = (epoch, batch): every process of the job
    writes its part of one distributed checkpoint (replicas' equal values once, shards as
    shards) into a partial folder, then :meth:`PendingCheckpoint.finish` names it (``fields`` in
    its manifest as they are). ``background``: the files are written while training goes on,
    and the caller finishes the returned checkpoint later; else it is finished now (None).
    ``names``: a traced model's state-dict names (:func:`pipeoptim.checkpoint.checkpoint_state`)."""
    folder = store / checkpoint_name(*position)
    partial = store / f".partial-{folder.name}"  # renamed into place once whole
    if world.rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a run that died while writing
    world.everyone(None, "starting the checkpoint")
    epoch, batch = position
    # (as they are now: a checkpoint finished later must not record what came after it)
    info = json.loads(json.dumps({**fields, "epoch": epoch, "batch": batch}))
    pending = PendingCheckpoint(world, store, folder, partial, info)
    problem = None
    try:
        state = checkpoint_state(stages, world.rank, names)
        if background:
            pending.written = write_state(state, partial, world.checkpoint_group(background=True), background=True)
            return pending
        write_state(state, partial, world.checkpoint_group())
    except OSError as error:  # every rank must hear of it, or the others wait for it
        problem = str(error)
    pending.finish(problem)
    return None


def load_checkpoint(world: World, store: Path, stages: List[Stage], run_info: Dict[str, Any],
                    names: Optional[StateNames] = None) -> Tuple[Optional[Loaded], List[str]]:
    """Load this process's stages from the newest whole checkpoint in ``store`` (rank 0 picks it
    and checks its files, passing over a torn or damaged one: :func:`~pipeoptim.checkpoint.newest_whole`),
    whatever layout wrote it: the :class:`Loaded` checkpoint (None if the run has none yet) and
    why each newer one was passed over. A checkpoint refused on any rank is refused on all,
    with that rank's reason."""
    choice: Tuple[Optional[str], Optional[str], List[str]] = (None, None, [])  # (folder name, or why none; passed over)
    if world.rank == 0:
        try:
            expect = {k: v for k, v in run_info.items() if k in RESUME_MATCHES}
            folder, passed = newest_whole(store, expect=json.loads(json.dumps(expect)))
            choice = (folder.name if folder is not None else None, None, passed)
        except CheckpointError as error:
            choice = (None, str(error), [])
    name, problem, passed = world.everyone(choice, "agreeing on the checkpoint to resume from")[0]
    if problem:
        raise CheckpointError(problem)
    if name is None:
        return None, passed
    folder = store / name
    manifest, planned = _on_every_rank(world, "loading the checkpoint",
                                       lambda: (read_manifest(folder), plan_load(folder, stages, world.rank, names)))
    # every rank reads (before it, every rank knew of any rank's refusal)
    rng = _on_every_rank(world, "loading the checkpoint",
                         lambda: load_state(folder, stages, planned, world.checkpoint_group()))
    copy_to_replicas(stages)  # a bidirectional run read each piece once, into its first pipeline's stage
    return Loaded(folder, manifest, rng), passed


def _on_every_rank(world: World, what: str, work: Callable[[], T]) -> T:
    """``work()`` on this rank; a CheckpointError on any rank is raised on every rank (the first
    rank's), so that none goes on alone."""
    result, problem = None, None
    try:
        result = work()
    except CheckpointError as error:
        problem = str(error)
    _raise_any(world, problem, what)
    return result


def _raise_any(world: World, problem: Optional[str], what: str) -> None:
    """Raise the first rank's ``problem`` (a CheckpointError) on every rank, if any rank has one."""
    problems = [p for p in world.everyone(problem, what) if p]
    if problems:
        raise CheckpointError(problems[0])
