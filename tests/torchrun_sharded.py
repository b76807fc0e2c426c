"""Run under torchrun, as the ``sharded`` script of tests/conftest.py's 4-process job, for
tests/test_sharding.py: each entry through Pipeline with N stages x D
replicas, replicated and sharded over the replicas (``shard_replicas``), every replica on its
shard of each mini-batch; rank 0 prints one JSON line per entry with both runs' losses, weights
and per-rank state bytes, and for a synchronous method a third run: ``sequential`` in rank 0's
process alone on the whole mini-batches (for the tied GPT with an asynchronous method: the same
method in rank 0's process alone, ``local``). An entry is ``[gpt:|drop:]method[+setting...]``:
``gpt:`` trains TinyGPT with one block (the head tied to the embedding, on the other stage)
instead of an MLP, ``drop:`` the MLP with dropout; settings are ``clip=X`` (global clipping),
``stageclip=X``, ``recompute``, ``muon`` (Muon on the hidden matrices, AdamW on the rest), or a
method option (``backward=predicted``, ``vertical_sync=1``). An entry the Pipeline refuses
prints its error instead.

Four entries share the job's 4 processes instead of starting their own (a 4-process start costs
more than what they run), their files under SCRATCH: ``reshard``, tests/torchrun_reshard.py's run
at 2 stages x 2 replicas sharded, stopped on every rank after 5 mini-batches (its newest
checkpoint at 4), then resumed at 4 stages x 1 replica writing its checkpoints in the background
(a copy of the stopped run is left in SCRATCH/reshard/alone for a one-process resume); and
``gpt2-example``, examples/transformers_causal_lm.py run as torchrun would run it (``__main__``,
its own flags: EXAMPLE_ARGS), its printed lines returned; ``padded`` (:func:`padded`: every token
weighed once across replicas); and last ``cli``, the command line's
sharded run whose replicas follow the job's world size (:func:`command_line`).

    script ENTRIES STAGES MICRO_BATCHES [SCRATCH [EXAMPLE_ARGS...]]
"""
import gc
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

import pipeoptim
from pipeoptim.lab.optimizers import make_optimizer
from pipeoptim.world import LocalWorld
from traced_models import TinyGPT, lm_batches, lm_loss

entries, stages, micro = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
scratch = Path(sys.argv[4]) if len(sys.argv) > 4 else None
example_args = sys.argv[5:]
RANK = int(os.environ["RANK"])
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_causal_lm.py"


def settle() -> None:
    """Collect what the entries so far left, and freeze what lives on (the imports, torch's caches):
    each Pipeline's close() runs gc.collect(), which then walks only what was made since."""
    gc.collect()
    gc.freeze()


settle()

g = torch.Generator().manual_seed(1)
mlp_batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]


def model_for(kind: str, method: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return TinyGPT(layers=1)
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
    # a function of the whole model, its calls run through the (sharded) stages
    evaluated = pipe.evaluate_model(lambda net: sum(metric(net.eval()(x), y).item() for x, y in own[:2]))
    weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
    # the weights this process holds in its copy of the model beside what its stage trains on
    model_bytes = sum(p.untyped_storage().nbytes() for p in pipe._model.parameters())
    pipe.close()  # its groups destroyed now, not all at the job's end (see the loop's end)
    return {"losses": result.losses, "weights": weights, "state_memory": result.metrics.get("state_memory"),
            "metrics": [e["metric"] for e in result.metrics["epochs"]], "model_bytes": model_bytes,
            "evaluated": evaluated}


def reshard(folder: Path) -> dict:
    """The ``reshard`` entry: stopped at 2 x 2 sharded, resumed at 4 x 1 (see the docstring)."""
    from torchrun_reshard import Stopped, latest, train

    cut = folder / "cut"
    try:
        train(cut, 2, shard=True, stop_after=5)
        return {"error": "the 2 x 2 run was not stopped"}
    except Stopped as stop:
        line = {"stopped": str(stop), "latest_after_stop": latest(cut)}
    if RANK == 0:  # before the 4 x 1 run (which every rank joins only with rank 0) writes there
        shutil.copytree(cut, folder / "alone")
    line["resumed"] = train(cut, 4, shard=False, background=True)
    line["latest_after_resume"] = latest(cut)
    return line


def gpt2_example(out: Path) -> dict:
    """The ``gpt2-example`` entry: what the example printed (rank 0 prints, the other ranks not)."""
    import contextlib
    import io
    import runpy

    printed, argv = io.StringIO(), sys.argv
    sys.argv = [str(EXAMPLE), *example_args, "--out", str(out)]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        sys.argv = argv
    return {"stdout": printed.getvalue()}


#: the ``cli`` entry's command (tests/test_sharding.py's CLI_TRAIN, which the test holds it to)
CLI_TRAIN = ["train", "--task", "image", "--model", "mlp", "--method", "pipeoptim", "--stages", "2",
             "--limit", "256", "--epochs", "1", "--no-progress"]


def command_line(out: Path) -> dict:
    """The ``cli`` entry: ``pipeoptim train --runtime distributed --shard-replicas`` in the job's
    processes without ``--data-parallel`` (the replicas follow the world size); its batch losses
    and what its run folder records. It tears down the job's process group: the job's last entry."""
    import contextlib
    import io

    from pipeoptim.cli import main

    argv = [*CLI_TRAIN, "--runtime", "distributed", "--shard-replicas", "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):  # its report: the job's stdout is JSON lines
        code = main(argv)
    line = {"argv": argv, "code": code}
    if RANK == 0:
        rows = [json.loads(text) for text in (out / "metrics.jsonl").read_text().splitlines()]
        line["losses"] = [r["loss"] for r in rows if r["type"] == "batch"]
        line["config"] = json.loads((out / "config.json").read_text())
    return line


def padded(out: Path) -> dict:
    """The ``padded`` entry: tests/first_day.py's GPT-2 as it comes (its own loss) on padded
    mini-batches (labels -100), 2 stages x 2 replicas, replicated and sharded, the default method:
    replica 0 reads rows 0-1 of each mini-batch (13 real tokens), replica 1 rows 2-3 (2), so only
    a count over both replicas weighs every token once. Its losses, weights and the evaluation of
    the first two mini-batches after training."""
    from first_day import model, padded_batches, sgd

    line = {}
    for shard in (False, True):
        pipe = pipeoptim.Pipeline(model("gpt2"), optimizer=sgd, stages=2, micro_batches=2, shard_replicas=shard)
        d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
        own = [{k: v.chunk(replicas)[d] for k, v in batch.items()} for batch in padded_batches("gpt2")]
        losses = pipe.fit(own).losses
        evaluation = pipe.evaluate(own[:2])
        weights = {k: v.tolist() for k, v in pipe.model().state_dict().items()}
        pipe.close()
        line["sharded" if shard else "replicated"] = {"losses": losses, "weights": weights, "evaluation": evaluation}
    return line


SPECIAL = {"reshard": reshard, "gpt2-example": gpt2_example, "cli": command_line, "padded": padded}

for entry in entries:
    if entry in SPECIAL:
        try:
            line = {"entry": entry, **SPECIAL[entry](scratch / entry)}
        except Exception as error:  # noqa: BLE001 - reported in the entry's line, the job goes on
            import traceback

            line = {"entry": entry, "error": f"{error!r}\n{traceback.format_exc()[-3000:]}"}
        if RANK == 0:
            print(json.dumps(line), flush=True)
        settle()
        continue
    kind, _, rest = entry.rpartition(":")
    method, *given = rest.split("+")
    settings = dict((s.split("=") + [""])[:2] for s in given)
    line = {"entry": entry}
    try:
        line["replicated"] = run(kind, method, settings, shard=False)
        line["sharded"] = run(kind, method, settings, shard=True)
    except ValueError as error:
        line["error"] = str(error)
    if RANK == 0:
        if "error" not in line and pipeoptim.get_method(method).synchronous:
            line["sequential"] = run(kind, method, settings, shard=False, alone=True)
        elif "error" not in line and kind == "gpt":  # the tie's exchange per replica: as one replica
            line["local"] = run(kind, method, settings, shard=False, local=True)
        print(json.dumps(line), flush=True)
    settle()
