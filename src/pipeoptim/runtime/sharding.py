"""Each stage sharded over its data-parallel replicas with torch's FSDP2 (``shard_replicas``).

Under torchrun with N stages x D replicas, stage k's D processes hold one ``fully_shard`` copy of
the stage module on the "dp" dimension of a 2-D ``DeviceMesh`` ("pp", "dp") built from the
pipeline's own process groups: parameters, gradients and optimizer state are DTensors, each
process holding 1/D of them, and so is every weight version a policy keeps (a stash, 2BW's
buffers, PipeOptim's cache and predictions), since a policy makes its copies from the
parameters.

How a pass gets the weights it needs (docs/architecture.md, "Sharded replicas"): FSDP gathers the
shards when the module runs, so the stage calls its module directly and, for the span of the
pass, writes the version the pass needs into the live shards (:meth:`StageShards.hold`). The
asynchronous methods gather in every forward and backward (``reshard_after_forward=True``: the
backward gathers again, and so reads what the shards hold then) and reduce-scatter each backward's
gradients; the synchronous ones keep the gathered weights for the whole mini-batch, accumulate
unsharded gradients and reduce-scatter them once, before the update (torch's own pipelining
schedules drive FSDP the same way).
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compat import forget_sharding_cache, fsdp_reduce_gradients
from ..weights.base import local


def fsdp_available() -> bool:
    """Whether this torch has FSDP2's ``fully_shard`` (torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def pipeline_mesh(pipeline_group, replica_group, stages: int, replicas: int, device_type: str):
    """The job's 2-D ``DeviceMesh`` ("pp", "dp") over the groups the pipeline already made (so
    that they keep its timeout): rank ``d*N + k`` runs stage k of replica d."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(stages * replicas).reshape(replicas, stages).T
    return DeviceMesh.from_group([pipeline_group, replica_group], device_type, mesh=ranks,
                                 mesh_dim_names=("pp", "dp"))


def forget_meshes() -> None:
    """Drop torch's cached DTensor sharding decisions once a sharded Pipeline's groups are gone:
    a DeviceMesh compares equal to any other of the same ranks and names, so a later Pipeline's
    parameters would be handed the closed one's mesh, whose groups no longer resolve (torch
    2.13: "Could not resolve the process group")."""
    forget_sharding_cache()


class StageShards:
    """One stage module sharded over its replicas, and how the stage's passes and update use it.

    ``synchronous``: every micro-batch of a mini-batch runs on the same weights, so FSDP keeps them
    gathered from the first forward to the update and reduces the gradients once
    (:meth:`__call__`, the stage's ``grad_sync``); otherwise each pass gathers the shards, which
    then hold the version that pass needs, and each backward reduces its own gradients."""

    def __init__(self, mesh, synchronous: bool) -> None:
        self.mesh = mesh
        self.synchronous = synchronous
        self.module: Optional[nn.Module] = None
        self._named: Dict[str, nn.Parameter] = {}
        self._keeping: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

    def shard(self, module: nn.Module) -> nn.Module:
        """A sharded copy of ``module`` (the user's model keeps its own layers untouched and
        receives the trained weights when the model is gathered)."""
        from torch.distributed.fsdp import fully_shard

        part = copy.deepcopy(module)
        fully_shard(part, mesh=self.mesh["dp"], reshard_after_forward=not self.synchronous)
        part.register_forward_pre_hook(self._copy_gathered)  # after FSDP's own: the weights are gathered
        self.module = part
        self._named = dict(part.named_parameters())
        if self.synchronous:
            self._accumulate()
        return part

    def _accumulate(self) -> None:
        """Backwards before the update keep the weights gathered and the gradients unreduced."""
        self.module.set_is_last_backward(False)
        self.module.set_reshard_after_backward(False)
        self.module.set_requires_gradient_sync(False)

    @torch.no_grad()
    def hold(self, values: Optional[Dict[str, torch.Tensor]]) -> Callable[[], None]:
        """Write ``values`` (parameter name -> tensor: the version a pass runs on) into the live
        shards, except those that are the live shard itself; return what puts the live values
        back. A synchronous stage never needs it (one version per mini-batch)."""
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

    def shard_of(self, name: str) -> nn.Parameter:
        """The sharded parameter ``name`` (the module registers gathered copies while it holds them)."""
        return self._named[name]

    def keep_gathered(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """A list that the next forward fills with (gathered weight, a copy of its values), for
        its recomputation in the backward (``runtime/recompute.forward_values``): FSDP gathers
        into the same tensors for every pass, so writing the copies there makes the recomputed
        forward the original one, while the backward's own values are put back after it."""
        self._keeping = []
        return self._keeping

    def _copy_gathered(self, module: nn.Module, args) -> None:
        if self._keeping is not None:
            with torch.no_grad():
                self._keeping.extend((p, p.detach().clone()) for p in module.parameters() if p.requires_grad)
            self._keeping = None

    def gather(self) -> None:
        """Make FSDP gather the shards now, if it has not (a recomputation that runs before the
        backward reached the module's output)."""
        self.module.unshard()

    def __call__(self, params) -> None:
        """Before a synchronous stage's update: reduce-scatter the gradients of the mini-batch
        (averaged over the replicas) into the sharded ``.grad`` and free the gathered weights,
        as ``torch.distributed.pipelining`` does after its last backward; then back to
        accumulating for the next mini-batch."""
        if not self.synchronous:
            return
        module = self.module
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        fsdp_reduce_gradients(module)
        self._accumulate()

    def grad_norm(self, grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The 2-norm of the whole stage's gradients from the shards (a sum of squares over the
        replicas' group)."""
        import torch.distributed as dist

        total = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            total += local(g).float().pow(2).sum()
        dist.all_reduce(total, group=self.mesh["dp"].get_group())
        return total.sqrt()

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The stage module's state with every sharded tensor gathered (a collective over the
        stage's replicas: every one of them calls it)."""
        self.release()
        return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
                for name, value in self.module.state_dict().items()}

    def release(self) -> None:
        """Free the gathered weights (a synchronous stage keeps them from a forward, an
        evaluation's too, to its update): the module's parameters are the shards again, and its
        next pass gathers what they hold (after a checkpoint is loaded into them)."""
        self.module.reshard()
