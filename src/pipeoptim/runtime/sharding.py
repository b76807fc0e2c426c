"""Each stage sharded over its replicas with torch's FSDP2 (``shard_replicas``).

Under torchrun with N stages x D replicas, stage k's D processes hold one ``fully_shard`` copy of
the stage module on the "dp" dimension of a 2-D ``DeviceMesh`` ("pp", "dp"): parameters,
gradients, optimizer state and every weight version a policy keeps are DTensors, 1/D each.

FSDP gathers the shards when the module runs, so the stage calls its module directly, with the
version the pass needs written into the live shards for its span (:meth:`StageShards.hold`;
docs/architecture.md, "Sharded replicas"). The asynchronous methods gather in every forward and
backward and reduce-scatter each backward's gradients; the synchronous ones keep the gathered
weights for the whole mini-batch and reduce-scatter once, before the update (as torch's own
pipelining schedules drive FSDP).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..compat import device_module, forget_sharding_cache, fsdp_gather_streams, fsdp_reduce_gradients, is_dtensor
from ..weights.base import local


def fsdp_available() -> bool:
    """Whether this torch has FSDP2's ``fully_shard`` (torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def pipeline_mesh(pipeline_group, replica_group, stages: int, replicas: int, device_type: str):
    """The job's 2-D ``DeviceMesh`` ("pp", "dp") over the pipeline's groups (with their timeout):
    rank ``d*N + k`` runs stage k of replica d."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(stages * replicas).reshape(replicas, stages).T
    return DeviceMesh.from_group([pipeline_group, replica_group], device_type, mesh=ranks,
                                 mesh_dim_names=("pp", "dp"))


def forget_meshes() -> None:
    """Drop torch's cached DTensor sharding decisions once a sharded Pipeline's groups are gone
    (a later Pipeline's equal mesh would be handed the closed one's groups)."""
    forget_sharding_cache()


def released(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no values: its storage freed (:meth:`StageShards.release_original`,
    as FSDP frees its own) or on the ``meta`` device."""
    return tensor.is_meta or (tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0)


class StageCopy:
    """What a stage trains that is a copy of the Pipeline's layers split over processes (its
    replicas' FSDP shards, :class:`StageShards`; its tensor ranks' DTensors,
    ``runtime/tensor_parallel.StageTensors``): the original's memory released, refilled for an
    evaluation, and a pass's version written into the live parameters."""

    def __init__(self) -> None:
        self.module: Optional[nn.Module] = None
        #: the device mesh the copy is split over: its "dp" dimension (the replicas' shards), "tp"
        #: (the tensor ranks' parts), or both (set by the subclass)
        self.mesh: Any = None
        #: the module it was made from (the Pipeline's copy of the model's layers), its
        #: parameters released (:meth:`release_original`)
        self.original: Optional[nn.Module] = None
        self._sizes: Dict[int, int] = {}  #: id(parameter of the original) -> its storage's bytes
        self._named: Dict[str, nn.Parameter] = {}

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The stage module's state, whole: each DTensor gathered (a collective: every process the
        stage is split on calls it)."""
        return {name: value.full_tensor() if is_dtensor(value) else value
                for name, value in self.module.state_dict().items()}

    def grad_norm(self, grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The 2-norm of the whole stage's gradients from this process's parts: a gradient split
        over the tensor ranks summed over them, one whole there counted once; sharded over the
        replicas, every part summed over them too."""
        import torch.distributed as dist

        total = torch.zeros(2, dtype=torch.float32, device=device)  # [split over tp, whole there]
        for g in grads:
            names = (g.device_mesh.mesh_dim_names or ()) if is_dtensor(g) else ()
            split = "tp" in names and g.placements[names.index("tp")].is_shard()
            total[0 if split else 1] += local(g).float().pow(2).sum()
        if "dp" in self._dims():
            dist.all_reduce(total, group=self._group("dp"))
        if "tp" in self._dims():
            dist.all_reduce(total[:1], group=self._group("tp"))
        return total.sum().sqrt()

    def any_replica(self, flag: torch.Tensor) -> torch.Tensor:
        """``flag`` (0-dim, 1.0: this process's part found an inf or nan: fp16's found-inf flag,
        ``runtime/loss_scaling.py``) over the processes the stage is split on: the replicas'
        shards where sharded, else its tensor ranks."""
        import torch.distributed as dist

        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group("dp" if "dp" in self._dims() else "tp"))
        return flag

    def _dims(self) -> Tuple[str, ...]:
        return self.mesh.mesh_dim_names or ()

    def _group(self, name: str) -> Any:
        return (self.mesh if self.mesh.ndim == 1 else self.mesh[name]).get_group()

    def release_original(self) -> None:
        """Free the parameters' memory of the module the shards were made from (the Pipeline's
        copy of the model's layers), as FSDP frees its gathered weights: each keeps its shape,
        dtype and device over a storage resized to nothing (:func:`released`), so that a stage
        split D ways holds 1/D of its weights, not 1 + 1/D. Its buffers stay (small, the
        module's own state beside the shards'). What reads the whole weights reads them from the
        shards: ``Pipeline.model()`` gathers them (:meth:`full_state_dict`), a traced model's
        evaluation fills them in for its span (:meth:`filled`). Called once every stage of the
        process is built (a weight tied across two of its stages is read by both builds)."""
        for param in self.original.parameters():
            storage = param.untyped_storage()
            self._sizes[id(param)] = storage.nbytes()
            storage.resize_(0)

    @contextlib.contextmanager
    def filled(self) -> Iterator[None]:
        """The module the shards were made from holding the stage's gathered state for the span
        (a collective: every replica of the stage enters it), its parameters released again
        afterwards; its buffers keep the values copied in. A traced model's eval-mode graph runs
        over those parameters and buffers (``prepare.EvalMode``)."""
        state = self.full_state_dict()
        params = dict(self.original.named_parameters())
        with torch.no_grad():
            for name, buffer in self.original.named_buffers():
                if name in state:
                    buffer.copy_(state[name])
            for name, param in params.items():
                param.untyped_storage().resize_(self._sizes[id(param)])
                param.copy_(state[name])
        try:
            yield
        finally:
            for param in params.values():
                param.untyped_storage().resize_(0)

    @torch.no_grad()
    def write(self, values: Optional[Dict[str, torch.Tensor]]) -> Callable[[], None]:
        """Write ``values`` (parameter name -> tensor: the version a pass runs on) into the live
        parameters' local tensors, except those that are the live storage itself; return what
        puts the live values back."""
        saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for name, value in (values or {}).items():
            param = self._named.get(name)
            if param is None:
                continue
            shard, source = local(param.data), local(value.detach())
            if shard.data_ptr() == source.data_ptr():
                continue
            saved.append((shard, shard.clone()))
            shard.copy_(source)

        def restore() -> None:
            with torch.no_grad():
                for shard, live in saved:
                    shard.copy_(live)
        return restore

class StageShards(StageCopy):
    """One stage module sharded over its replicas, and how the stage's passes and update use it.
    ``synchronous``: FSDP keeps the weights gathered from the first forward to the update and
    reduces the gradients once (:meth:`__call__`, the stage's ``grad_sync``)."""

    def __init__(self, mesh, synchronous: bool) -> None:
        super().__init__()
        self.mesh = mesh
        self.synchronous = synchronous
        self.device_type: str = mesh.device_type if mesh is not None else "cpu"
        self._keeping: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

    def shard(self, module: nn.Module, original: Optional[nn.Module] = None) -> nn.Module:
        """A sharded copy of ``module`` (``module`` keeps its parameters until :meth:`release_original`);
        ``original``: ``module`` is a private copy of it already (split over tensor ranks,
        ``runtime/tensor_parallel.py``), sharded itself: torch's order, tensor parallelism then
        FSDP over the replicas of a mesh whose "tp" dimension its DTensors use."""
        from torch.distributed.fsdp import fully_shard

        part = copy.deepcopy(module) if original is None else module
        fully_shard(part, mesh=self.mesh["dp"], reshard_after_forward=not self.synchronous)
        part.register_forward_pre_hook(self._copy_gathered)  # after FSDP's own: the weights are gathered
        self.module, self.original = part, module if original is None else original
        self._named = dict(part.named_parameters())
        if self.synchronous:
            self._last_backward(False)
        return part

    def _last_backward(self, last: bool) -> None:
        """Not ``last``: backwards before the update keep the weights gathered and the gradients
        unreduced; ``last``: the next backward (or reduction) reduces and frees them."""
        self.module.set_is_last_backward(last)
        self.module.set_reshard_after_backward(last)
        self.module.set_requires_gradient_sync(last)

    @torch.no_grad()
    def hold(self, values: Optional[Dict[str, torch.Tensor]]) -> Callable[[], None]:
        """Write ``values`` (parameter name -> tensor: the version a pass runs on) into the live
        shards, except those that are the live shard itself; return what puts the live values back.
        Called before every pass of the stage (with nothing to write too): FSDP's next gathers
        wait for what the current stream holds now (:meth:`gathers_after_writes`)."""
        restore = self.write(values)
        self.gathers_after_writes()
        return restore

    def gathers_after_writes(self) -> None:
        """Make FSDP2's next all-gathers of the stage wait for the work queued on the current
        stream so far: the version :meth:`hold` wrote, the live values an earlier pass's restore
        put back, the optimizer's step. A forward's gather waits for the current stream by
        FSDP's own rule (the root's pre-forward), a backward's does not: it reads the shards on
        FSDP's copy-in stream (torch 2.13's ``FSDPParamGroup.unshard`` in ``PRE_BACKWARD``), which
        could run before the writes landed and gather the forward's version. So an event recorded
        on the current stream here, after the writes, is waited on by FSDP's all-gather streams
        (``compat.fsdp_gather_streams``; where this torch hides them, the host waits for the
        current stream). The restore after a pass needs no wait: FSDP made the current stream
        wait for the pass's gather before the pass's compute, and the restore comes after it.
        On the CPU every operation runs in order on the host: nothing to do. What only a GPU
        can confirm: that torch's FSDP2 issues no copy-in of this module between here and the
        pass (no prefetch: one FSDP module per stage), and the numbers of a sharded
        asynchronous run on CUDA equal the replicated run's (tests/test_sharding.py, on gloo)."""
        if self.device_type == "cpu":
            return
        handle = device_module(self.device_type)  # torch.cuda: FSDP's own device handle
        streams = fsdp_gather_streams(self.module)
        if streams is None:
            handle.current_stream().synchronize()
            return
        if streams:
            written = handle.current_stream().record_event()
            for stream in streams:
                stream.wait_event(written)

    def shard_of(self, name: str) -> nn.Parameter:
        """The sharded parameter ``name`` (the module registers gathered copies while it holds them)."""
        return self._named[name]

    def keep_gathered(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """A list that the next forward fills with (gathered weight, a copy of its values), for
        its recomputation (``runtime/recompute.forward_values``): FSDP gathers into the same
        tensors for every pass, so the copies written there recompute the original forward."""
        self._keeping = []
        return self._keeping

    def _copy_gathered(self, module: nn.Module, args) -> None:
        if self._keeping is not None:
            with torch.no_grad():
                self._keeping.extend((p, p.detach().clone()) for p in module.parameters() if p.requires_grad)
            self._keeping = None

    def gather(self) -> None:
        """Make FSDP gather the shards now (a recomputation before the backward reached the module)."""
        self.module.unshard()

    def __call__(self, params) -> None:
        """Before a synchronous stage's update: reduce-scatter the mini-batch's gradients (averaged
        over the replicas) into the sharded ``.grad`` and free the gathered weights; then back to
        accumulating for the next mini-batch."""
        if self.synchronous:
            self._last_backward(True)
            fsdp_reduce_gradients(self.module)
            self._last_backward(False)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The stage module's state, gathered (a collective: every replica of the stage calls it),
        its gathered weights freed first."""
        self.release()
        return super().full_state_dict()

    def release(self) -> None:
        """Free the gathered weights (a synchronous stage keeps them to its update): the next pass
        gathers what the shards hold (after a checkpoint is loaded into them)."""
        self.module.reshard()
