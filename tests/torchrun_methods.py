"""Run under torchrun by tests/test_torchrun.py: every method through Pipeline, one stage per
process; rank 0 prints one JSON line per entry with its losses and weight copies.
Arguments: entries (comma-separated), stages, then optionally the global clipping norm ("-": none)
and eval_every for fit. An entry is a method, optionally with settings of its own that replace
those two: ``gpipe+clip=0.05``, ``pipeoptim+eval=2`` (its line's "method" is the whole entry), so
that one job runs every case its tests read; ``+ef=1`` turns error feedback on, ``+opt=delay-nadamw``
trains with the delay-aware optimizer instead of SGD with momentum, ``+fp16=E`` runs in fp16 from the loss
scale 2**E (its line also holds stage 0's skipped updates and the scale), ``+wire=odd`` trains
tests/traced_models.py's ``odd_dtypes_model`` (complex64 and int16 crossing the cut; its line also
holds the dtypes every send of a link put on the wire). Each line also says whether ``model(device="meta")``
was whole there and what ``evaluate_model`` gave (a loss summed over two mini-batches)."""
import json
import sys

import torch
from torch import nn

import pipeoptim
import pipeoptim.delay_nadamw

entries, stages = sys.argv[1].split(","), int(sys.argv[2])
job_clip = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
job_eval_every = int(sys.argv[4]) if len(sys.argv) > 4 else None
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
for entry in entries:
    method, *settings = entry.split("+")
    settings = dict(setting.split("=") for setting in settings)
    clip = float(settings["clip"]) if "clip" in settings else job_clip
    eval_every = int(settings["eval"]) if "eval" in settings else job_eval_every
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)]
    if stages > 2:  # one model for every method: a layer with weights for each of stages x 2 chunks
        for _ in range(2 * stages - 3):
            layers[2:2] = [nn.Linear(16, 16), nn.Tanh()]
    elif pipeoptim.get_method(method).chunks > 1:  # 2 stages x 2 chunks: a fourth layer with weights
        layers[2:2] = [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    partition, sent = None, []
    if settings.get("wire") == "odd":  # what the links send: the dtypes on the wire, on every rank
        from traced_models import odd_dtypes_model

        model, partition = odd_dtypes_model(), [2, 1]
        link_module = __import__("pipeoptim.runtime.link", fromlist=["dist"])
        real_isend = link_module.dist.isend
        link_module.dist.isend = lambda tensor, *a, **k: (sent.append(str(tensor.dtype)), real_isend(tensor, *a, **k))[1]
    options = {"error_feedback": True} if settings.get("ef") == "1" else {}
    if settings.get("opt") == "delay-nadamw":
        optimizer = lambda p: pipeoptim.delay_nadamw.DelayNAdamW(p, lr=0.01)  # noqa: E731
    else:
        optimizer = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    pipe = pipeoptim.Pipeline(model, method=method, stages=None if method == "sequential" or partition else stages,
                              partition=partition,
                              loss_fn=nn.functional.cross_entropy, optimizer=optimizer,
                              clip_grad_norm=clip, clip_scope="global" if clip else "stage",
                              precision="fp16" if "fp16" in settings else "fp32", **options)
    for stage in pipe.stages if "fp16" in settings else ():  # the process's one scale, set by hand
        stage.loss_scaling.scale = 2.0 ** int(settings["fp16"])
    stepped = [loss for x, y in batches[:3] for loss in pipe.step(x, y)] + pipe.flush()
    result = pipe.fit(batches[3:], epochs=2, eval_every=eval_every,
                      eval_loader=batches[:2], metric=lambda out, y: (out.argmax(-1) == y).float().mean())
    # fit's model, read before pipe.model() gathers into the same copy: whole on every rank
    listed = lambda v: (torch.view_as_real(v) if v.is_complex() else v).tolist()  # noqa: E731 (JSON)
    fit_weights = {k: listed(v) for k, v in result.model.state_dict().items()}
    weights = {k: listed(v) for k, v in pipe.model().state_dict().items()}
    fit_model_whole = torch.tensor(float(fit_weights == weights))
    # issue 62: the whole model on a device of the caller's choice (meta: no values, every rank's copy),
    # and a function of the model evaluated through the stages (under torchrun: on their processes)
    whole = pipe.model(device="meta")
    on_meta = all(p.is_meta for p in whole.parameters()) and [n for n, _ in whole.named_parameters()] == \
        [n for n, _ in pipe.model().named_parameters()]
    evaluated = pipe.evaluate_model(lambda net: sum(nn.functional.cross_entropy(net.eval()(x), y).item()
                                                    for x, y in batches[:2]))
    if torch.distributed.is_initialized():  # every rank's answer, not only rank 0's
        torch.distributed.all_reduce(fit_model_whole, op=torch.distributed.ReduceOp.MIN)
    if partition:
        link_module.dist.isend = real_isend
        gathered = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if torch.distributed.is_initialized():
            torch.distributed.all_gather_object(gathered, sorted(set(sent)))
        sent = sorted({d for part in gathered if part for d in part})
    if pipe.rank == 0:
        print(json.dumps({"method": entry, "wire": sent, "stepped": stepped, "losses": result.losses,
                          "metric": result.metrics["epochs"][-1]["metric"],
                          "weight_versions": result.metrics["weight_versions"],
                          "processes": result.metrics["processes"], "weights": weights,
                          "fit_model_whole": bool(fit_model_whole), "fit_weights": fit_weights,
                          "whole_on_meta": on_meta, "evaluated_model": evaluated,
                          "skips": pipe.stages[0].record.skips,
                          "scale": getattr(pipe.stages[0].loss_scaling, "scale", None),
                          "evaluations": [{k: v for k, v in e.items() if k != "seconds"}
                                          for e in result.metrics["evaluations"]]}), flush=True)
