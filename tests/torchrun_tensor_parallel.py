"""Run under torchrun by tests/test_tensor_parallel.py (the ``tensor-parallel`` and
``tensor-checkpoints`` scripts of tests/conftest.py's 4-process job, and its 8-process job), or in
one process for the reference: each entry's model on 2 stages (``mlp-1``: one), each stage split
over T = 2 tensor ranks, in D = WORLD_SIZE / (stages x 2) replicas, each on its shard of every mini-batch (in one
process: T = 1, on the replicas' shards side by side, as their averaged gradients add up). Rank 0
prints one JSON line per entry with the losses, what step() and flush() returned, the trained
model's loss on two mini-batches evaluated through the pipeline and its weights (``pipe.model()``,
gathered).

    script ENTRIES [REPLICAS]   (ENTRIES: MODEL:METHOD[:sharded],...; MODEL: mlp, an nn.Sequential
                                 with our plan (mlp-1: on one stage); llama, a transformers Llama
                                 with its own plan; llama-tied, its head tied to its embedding;
                                 sharded: each split stage sharded over its replicas, FSDP2)
    script checkpoints FOLDER   (:func:`checkpoints`: from T = 1 to T = 2 and back)
"""
import json
import os
import sys

import torch
from torch import nn

import pipeoptim

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
T = 2 if WORLD > 1 else 1
MICRO = 2


def mlp():
    """Two blocks of Linear-ReLU-Linear: column-wise then row-wise (the Megatron pairing)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6), nn.Tanh(),
                          nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
    batches = [(torch.randn(8, 6), torch.randn(8, 4)) for _ in range(3)]
    return model, plan, batches, nn.functional.mse_loss


def llama(tied: bool = False):
    """A tiny transformers Llama (2 heads, 2 key/value heads) with its own plan; ``tied``: its head
    tied to its embedding (on the other stage: both split over the vocabulary)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    batches = [(torch.randint(0, 24, (4, 8)), torch.randint(0, 24, (4, 8))) for _ in range(3)]

    def loss(out, y):
        return nn.functional.cross_entropy(out.logits.reshape(-1, 24), y.reshape(-1))
    return model, None, batches, loss


MODELS = {"mlp": mlp, "mlp-1": mlp, "llama": llama, "llama-tied": lambda: llama(tied=True)}
CHUNKED = {"interleaved", "zb-v", "dualpipev", "bitpipe"}

class Stopped(Exception):
    """Raised on every rank at once after the mini-batches a cut run trains."""


def checkpointed(run, stop_after: int = 0, world=None) -> dict:
    """The mlp under 1f1b-flush with a checkpoint every 2 mini-batches in RUN, resumed from the
    newest there, T = 2 under torchrun, T = 1 in one process (or with ``world``); raises
    :class:`Stopped` after ``stop_after`` mini-batches (0: never). Its losses and weights."""
    from pathlib import Path

    seen = [0]

    def on_batch(i, loss):
        seen[0] += 1
        if stop_after and seen[0] >= stop_after:
            raise Stopped()
    torch.manual_seed(0)
    model, plan, _, loss_fn = mlp()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    split = world is None and T > 1
    pipe = pipeoptim.Pipeline(model, method="1f1b-flush", partition=[4, 3], loss_fn=loss_fn, micro_batches=MICRO,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), world=world,
                              **({"tensor_parallel": 2, "tensor_plan": plan} if split else {}))
    try:
        result = pipe.fit(data, epochs=1, checkpoint_dir=Path(run) / "checkpoints", checkpoint_every=2,
                          resume=True, on_batch=on_batch)
        return {"losses": result.losses, "weights": {k: v.tolist() for k, v in pipe.model().state_dict().items()}}
    finally:
        pipe.close()


def main(entries: str, side: int = 0) -> None:
    """Each entry's run; rank 0 prints its line (``side``: in one process, the micro-batches of
    that many replicas side by side)."""
    for entry in entries.split(","):
        name, method, *sharded = entry.split(":")
        torch.manual_seed(0)
        model, plan, batches, loss_fn = MODELS[name]()
        extra = {"tensor_parallel": T, "tensor_plan": plan, "shard_replicas": bool(sharded)} if T > 1 else {}
        # mlp-1: one stage, so that 4 processes hold 2 replicas x 2 tensor ranks
        stages = {"partition": [2, 2, 2, 1] if method in CHUNKED else [4, 3] if name == "mlp" else [7]} \
            if name.startswith("mlp") else {"stages": 2}
        pipe = pipeoptim.Pipeline(model, method=method, loss_fn=loss_fn, partitioner="uniform", micro_batches=MICRO,
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), clip_grad_norm=1.0,
                                  **stages, **extra)
        d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
        if replicas > 1:
            batches = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in batches]
        elif side:  # what that many replicas run side by side
            batches = [tuple(torch.cat([t.chunk(side)[r].chunk(MICRO)[j] for j in range(MICRO) for r in range(side)])
                             for t in batch) for batch in batches]
        stepped = [loss for x, y in batches for loss in pipe.step(x, y)] + pipe.flush()
        evaluated = pipe.evaluate(batches[:2], lambda out, y: float(loss_fn(out, y)))
        trained = pipe.model()
        if pipe.rank == 0:
            print(json.dumps({"entry": entry, "tensor": T, "replicas": replicas, "losses": pipe.losses,
                              "stepped": stepped, "evaluated": evaluated,
                              "weights": {k: v.tolist() for k, v in trained.state_dict().items()}}), flush=True)


def checkpoints(folder) -> None:
    """Checkpoints across T (in a torchrun job): FOLDER/one-to-two, a cut run of one process
    (rank 0, T = 1: ``LocalWorld``) resumed with T = 2, rank 0 printing its end; FOLDER/two-to-one,
    a run with T = 2 cut after 4 mini-batches, its newest checkpoint left for one process to resume."""
    import time
    from pathlib import Path

    from pipeoptim.world import LocalWorld

    one, two = Path(folder) / "one-to-two", Path(folder) / "two-to-one"
    if int(os.environ["RANK"]) == 0:
        try:
            checkpointed(one, stop_after=4, world=LocalWorld())
        except Stopped:
            (one / "cut").write_text("")
    while not (one / "cut").exists():  # the other ranks wait for it
        time.sleep(0.05)
    resumed = checkpointed(one)
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"entry": "one-to-two", **resumed}), flush=True)
    try:
        checkpointed(two, stop_after=4)
    except Stopped:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "checkpoints":
        checkpoints(sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
