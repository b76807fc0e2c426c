"""Run under torchrun by tests/test_sharding.py: each entry through Pipeline with N stages x D
replicas, replicated and sharded over the replicas (``shard_replicas``), every replica on its
shard of each mini-batch; rank 0 prints one JSON line per entry with both runs' losses, weights
and per-rank state bytes, and for a synchronous method a third run: ``sequential`` in rank 0's
process alone on the whole mini-batches (for the tied GPT with an asynchronous method: the same
method in rank 0's process alone, ``local``). An entry is ``[gpt:|drop:]method[+setting...]``: ``gpt:``
trains TinyGPT (head tied to the embedding) instead of an MLP, ``drop:`` the MLP with dropout; settings are ``clip=X`` (global
clipping), ``stageclip=X``, ``recompute``, ``muon`` (Muon on the hidden matrices, AdamW on the
rest), or a method option (``backward=predicted``,
``vertical_sync=1``). An entry the Pipeline refuses prints its error instead.

    script ENTRIES STAGES MICRO_BATCHES
"""
import json
import sys

import torch
from torch import nn

import pipeoptim
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.world import LocalWorld
from traced_models import TinyGPT, lm_batches, lm_loss

entries, stages, micro = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(1)
mlp_batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]


def model_for(kind: str, method: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return TinyGPT(layers=2)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    if kind == "drop":  # dropout, which training draws alike in both runs and evaluation must turn off
        layers[2:2] = [nn.Dropout(0.3)]
    if pipeoptim.get_method(method).chunks > 1:  # 2 stages x 2 chunks: a layer with weights for each
        layers[2:2] = [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def value(text: str):
    """A setting's value: a number where it reads as one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run(kind: str, method: str, settings: dict, shard: bool, alone: bool = False, local: bool = False) -> dict:
    settings = dict(settings)
    clip, stage_clip = settings.pop("clip", None), settings.pop("stageclip", None)
    recompute = settings.pop("recompute", None) is not None
    muon = settings.pop("muon", None) is not None
    options = {k: (bool(int(v)) if k == "vertical_sync" else value(v)) for k, v in settings.items()}
    pipe = pipeoptim.Pipeline(
        model_for(kind, method), method="sequential" if alone else method,
        stages=None if alone else stages, loss_fn=lm_loss if kind == "gpt" else nn.functional.cross_entropy,
        # (SGD for the GPT: AdamW would amplify the rounding noise of a gradient that is zero in
        # exact arithmetic, the attention's key bias, into differences of the bias itself)
        optimizer=make_optimizer("muon", 0.01) if muon
        else (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)) if method == "spectrain" or kind == "gpt"
        else (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
        micro_batches=None if alone else micro, shard_replicas=shard, recompute=recompute,
        clip_grad_norm=float(clip or stage_clip) if (clip or stage_clip) else None,
        clip_scope="global" if clip else "stage", world=LocalWorld() if alone or local else None,
        **({} if alone else options))
    batches = lm_batches(count=4) if kind == "gpt" else mlp_batches
    d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
    own = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in batches]
    if local:  # one replica on what the job's 2 run side by side: micro-batch j is their j-th ones
        own = [tuple(torch.cat([t.chunk(2)[r].chunk(micro)[j] for j in range(micro) for r in range(2)])
                     for t in batch) for batch in batches]
    # an evaluation at each epoch's end (a pipelined forward through the stages, sharded ones too)
    metric = (lambda out, y: lm_loss(out, y)) if kind == "gpt" else (lambda out, y: nn.functional.cross_entropy(out, y))
    result = pipe.fit(own, epochs=2, eval_loader=own[:2], metric=metric)
    weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
    return {"losses": result.losses, "weights": weights, "state_memory": result.metrics.get("state_memory"),
            "metrics": [e["metric"] for e in result.metrics["epochs"]]}


for entry in entries:
    kind, _, rest = entry.rpartition(":")
    method, *given = rest.split("+")
    settings = dict((s.split("=") + [""])[:2] for s in given)
    line = {"entry": entry}
    try:
        line["replicated"] = run(kind, method, settings, shard=False)
        line["sharded"] = run(kind, method, settings, shard=True)
    except ValueError as error:
        line["error"] = str(error)
    if torch.distributed.get_rank() == 0:
        if "error" not in line and pipeoptim.get_method(method).synchronous:
            line["sequential"] = run(kind, method, settings, shard=False, alone=True)
        elif "error" not in line and kind == "gpt":  # the tie's exchange per replica: as one replica
            line["local"] = run(kind, method, settings, shard=False, local=True)
        print(json.dumps(line), flush=True)
