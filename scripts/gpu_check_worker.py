"""The rows of scripts/gpu_check.py's table, trained: run under torchrun (one stage per process,
NCCL on ``cuda:LOCAL_RANK`` with ``--device cuda``, gloo with ``--device cpu``), or by python alone
(every stage in this one process). Rank 0 prints one JSON line per run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_check_worker.py \\
        --device cuda --rows 1f1b-flush,pipeoptim+bf16 --updates 8

A row is ``METHOD[+bf16][+compiled][+checkpoint][+sharded]``: METHOD trains the tied GPT below
(a traced model, its head's weight the embedding's, 2 stages) for K mini-batches of synthetic
tokens, K updates; ``bf16`` under autocast; ``compiled`` with ``compile=`` the ``--compile``
backend; ``checkpoint`` with a DCP checkpoint every K//2 mini-batches (``fit(checkpoint_dir=...)``),
trained twice: uninterrupted, then stopped on every rank after K//2 + 1 mini-batches and resumed
to the end by a new Pipeline from the newest checkpoint; ``sharded`` 2 stages x 2 replicas, each
stage sharded over its replicas (``shard_replicas=True``, 4 processes), each replica on its half
of every mini-batch. A job runs the rows of its own size (``processes``: 2, or 4 for
``sharded``) and skips the others.

Each line: the row, where it ran (processes, the process group's backend, precision, compile
backend), its training losses, each stage's graphs (``compilations``), ``loss``: the loss after
the K updates, of the trained model (``pipe.model()``, gathered) on a held-out mini-batch, in
plain torch and fp32 on rank 0, and whether the trained model's head is still its embedding; a
checkpoint row's, of the resumed run, with ``latest`` (the checkpoint it resumed from) and
``uninterrupted`` (that run's losses and loss). A rank other than 0 prints a row's line only
when the row failed there.

After the job's rows, rank 0 alone (``LocalWorld``, every stage on its device) trains each
asynchronous row again in one process (``processes: 1``, uninterrupted, one replica on the
whole mini-batches) and ``sequential`` in each precision (its line also holds ``initial``: the
held-out loss before any update): what the driver compares with. Run by python alone, it
trains every row so, and nothing else.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import pipeoptim  # noqa: E402
from pipeoptim.world import LocalWorld  # noqa: E402

#: the rows a check runs by default: every method family on the tied GPT, then what a run adds
ROWS = ["1f1b-flush", "zb-h1", "interleaved", "zb-v", "pipeoptim", "pipedream-2bw", "bidirectional", "bitpipe",
        "1f1b-flush+checkpoint", "pipeoptim+checkpoint", "1f1b-flush+compiled", "pipeoptim+compiled",
        "1f1b-flush+bf16", "pipeoptim+bf16", "zb-h1+bf16+compiled", "1f1b-flush+sharded", "1f1b-flush+tensor",
        "pipeoptim+tensor", "1f1b-flush+tensor+checkpoint"]
FEATURES = ("bf16", "compiled", "checkpoint", "sharded", "tensor")
#: ``tensor``: each stage split over 2 processes by this plan (the MLPs column-wise then row-wise,
#: the tied embedding and head over the vocabulary; the attention's fused qkv, split into 4 heads
#: by a fixed view, stays whole)
TENSOR_PLAN = {"layers.*.mlp.0": "colwise", "layers.*.mlp.2": "rowwise", "embed": "embedding_rowwise",
               "head": "colwise_gather_output"}
#: the model and data: ``full`` on a GPU, ``tiny`` for the tests on the CPU
SIZES = {"full": {"vocab": 64, "width": 64, "length": 32, "batch": 16, "layers": 4},
         "tiny": {"vocab": 24, "width": 16, "length": 8, "batch": 8, "layers": 1}}
STAGES, REPLICAS = 2, 2


def parse_row(row: str) -> Dict[str, Any]:
    """``METHOD+feature...`` as {method, bf16, compiled, checkpoint, sharded, tensor, processes};
    the error names the valid form."""
    method, *features = row.split("+")
    unknown = [f for f in features if f not in FEATURES]
    if unknown or method not in pipeoptim.method_names() or method == "sequential":
        raise SystemExit(f"gpu_check: row {row!r}: give METHOD{''.join(f'[+{f}]' for f in FEATURES)} with METHOD "
                         f"one of {', '.join(pipeoptim.method_names()[1:])} (sequential, the reference, runs "
                         f"with every row)")
    spec = {"row": row, "method": method, **{f: f in features for f in FEATURES}}
    spec["processes"] = STAGES * (REPLICAS if spec["sharded"] else 1) * (2 if spec["tensor"] else 1)
    return spec


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, 4, width // 4).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(width, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class TiedGPT(nn.Module):
    """Embedding, blocks in a ModuleList, a norm, and a head whose weight is the embedding's."""

    def __init__(self, vocab: int, width: int, length: int, layers: int, **_: Any) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        # large logits at first (GPT-2's 0.02 starts them near zero): K = 8 updates halve the loss,
        # so that the methods' losses after K differ where their weights do
        nn.init.normal_(self.embed.weight, std=0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def batches(count: int, vocab: int, length: int, batch: int, **_: Any) -> List[Any]:
    """``count`` mini-batches of token sequences and their next tokens, seeded: each sequence a
    random first token, then every token a fixed permutation's image of the one before (something
    the GPT learns in a few updates, so that the losses after K updates differ by method)."""
    g = torch.Generator().manual_seed(1)
    after = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(count):
        tokens = [torch.randint(0, vocab, (batch,), generator=g)]
        for _ in range(length):
            tokens.append(after[tokens[-1]])
        t = torch.stack(tokens, 1)
        out.append((t[:, :-1], t[:, 1:]))
    return out


@torch.no_grad()
def held_out_loss(model: nn.Module, batch: Any, device: str) -> float:
    """The loss of a trained model on a mini-batch it did not train on: plain torch, fp32, eval mode."""
    model = model.to(device).eval()
    x, y = batch
    return float(lm_loss(model(x.to(device)), y.to(device)))


class Stopped(Exception):
    """Raised by a checkpoint row's ``on_batch`` on every rank once K//2 + 1 mini-batches are in:
    the run ends there, as a crash would end it, its newest checkpoint the one after K//2."""


def pipeline(spec: Dict[str, Any], args: argparse.Namespace, alone: bool) -> pipeoptim.Pipeline:
    """The row's Pipeline (``alone``: every stage in this process; ``sequential``: one stage)."""
    size = SIZES[args.size]
    torch.manual_seed(0)
    sharded = spec["sharded"] and not alone
    return pipeoptim.Pipeline(
        TiedGPT(**size), method=spec["method"],
        stages=None if spec["method"] == "sequential" else STAGES, loss_fn=lm_loss, devices=args.device,
        precision="bf16" if spec["bf16"] else "fp32", compile=args.compile if spec["compiled"] else False,
        partitioner="params",  # a function of the model alone: the same cut in every run
        optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr), timeout=args.timeout,
        world=LocalWorld() if alone else None,
        **({"data_parallel": REPLICAS, "shard_replicas": True} if sharded else {}),
        **({"tensor_parallel": 2, "tensor_plan": TENSOR_PLAN} if spec["tensor"] and not alone else {}))


def train(spec: Dict[str, Any], args: argparse.Namespace, alone: bool = False) -> Dict[str, Any]:
    """One row: its JSON line. A checkpoint row runs twice: uninterrupted, with the same
    checkpoints (an asynchronous method drains at each), then stopped and resumed."""
    size = SIZES[args.size]
    data = batches(args.updates + 1, **size)
    start = time.perf_counter()
    line: Dict[str, Any] = {"row": spec["row"], "method": spec["method"],
                            "precision": "bf16" if spec["bf16"] else "fp32",
                            "compiled": args.compile if spec["compiled"] else False,
                            "sharded": spec["sharded"] and not alone, "tensor": 2 if spec["tensor"] and not alone else 1}
    if spec["method"] == "sequential":  # the loss before any update, the same for every row
        torch.manual_seed(0)
        line["initial"] = held_out_loss(TiedGPT(**size), data[-1], args.device)
    if spec["checkpoint"] and not alone:
        folder = Path(args.scratch) / spec["row"]  # the job's own: a resume finds no one else's
        whole = run(spec, args, alone, data, folder / "uninterrupted")
        line["uninterrupted"] = {"losses": whole["losses"], "loss": whole["loss"]}
        line.update(run(spec, args, alone, data, folder / "stopped", stop=True))
    else:
        line.update(run(spec, args, alone, data))
    line["seconds"] = round(time.perf_counter() - start, 2)
    return line


def run(spec: Dict[str, Any], args: argparse.Namespace, alone: bool, data: List[Any],
        checkpoints: Optional[Path] = None, stop: bool = False) -> Dict[str, Any]:
    """The row's Pipeline trained on ``data`` but its last mini-batch (the held-out one):
    ``checkpoints``: a checkpoint every K//2 mini-batches there; ``stop``: stopped after K//2 + 1,
    then a new Pipeline resumed from the newest checkpoint to the end. What the line reports."""
    every = max(1, args.updates // 2)
    options = {"checkpoint_dir": checkpoints, "checkpoint_every": every, "resume": True} if checkpoints else {}
    pipe = pipeline(spec, args, alone)
    try:
        d, replicas = pipe.data_parallel_rank, pipe.data_parallel_size
        own = [(x.chunk(replicas)[d], y.chunk(replicas)[d]) for x, y in data[:-1]]
        out: Dict[str, Any] = {}
        if stop:
            seen: List[float] = []

            def on_batch(index: int, loss: float) -> None:
                seen.append(loss)
                if len(seen) > every:
                    raise Stopped()
            try:
                pipe.fit(own, on_batch=on_batch, **options)
                raise RuntimeError("the checkpoint row's first run was not stopped")
            except Stopped:
                pass
            pipe.close()
            out["latest"] = json.loads((checkpoints / "latest.json").read_text())["checkpoint"]
            pipe = pipeline(spec, args, alone)  # a new one, resumed: its losses the whole run's
        result = pipe.fit(own, **options)
        trained = pipe.model()  # gathered on every rank
        backend = "-"
        if not alone and torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
        return {"processes": 1 if alone else pipe.world.processes, "backend": backend, "losses": result.losses,
                "loss": held_out_loss(trained, data[-1], args.device) if pipe.rank == 0 else None,
                "tied": trained.head.weight is trained.embed.weight,
                "compilations": result.metrics.get("compilations"), **out}
    finally:
        pipe.close()


def plain(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The row without a checkpoint or replicas: its method, precision and compile."""
    return dict(spec, checkpoint=False, sharded=False, tensor=False, processes=STAGES,
                row="+".join([spec["method"]] + [f for f in ("bf16", "compiled") if spec[f]]))


def plan(rows: List[str], updates: int) -> List[Dict[str, Any]]:
    """The rows' specs, refused where K updates cannot run them."""
    specs = [parse_row(row) for row in rows if row]
    if updates < 2 and any(s["checkpoint"] for s in specs):
        raise SystemExit(f"gpu_check: a checkpoint row is stopped after K//2 + 1 mini-batches of K, which needs "
                         f"--updates 2 or more, got {updates}")
    return specs


def one_process(specs: List[Dict[str, Any]], args: argparse.Namespace, every: bool) -> List[Dict[str, Any]]:
    """The rows again in this process alone (``every``: each row's method; else the asynchronous
    ones a torchrun row must equal: not a checkpoint row, held to its uninterrupted run, nor a
    sharded or tensor-parallel one; a synchronous row is held to sequential), and ``sequential``
    in each precision."""
    seen, runs = set(), []
    for spec in specs:
        key = (spec["method"], spec["bf16"], spec["compiled"])
        needed = not (pipeoptim.get_method(spec["method"]).synchronous or spec["checkpoint"] or spec["sharded"]
                      or spec["tensor"])
        if key not in seen and (every or needed):
            seen.add(key)
            runs.append(plain(spec))
    for bf16 in sorted({s["bf16"] for s in specs}):
        runs.append({"row": "sequential" + "+bf16" * bf16, "method": "sequential", "bf16": bf16, "compiled": False,
                     "checkpoint": False, "sharded": False, "tensor": False, "processes": 1})
    return [run_row(spec, args, alone=True) for spec in runs]


def run_row(spec: Dict[str, Any], args: argparse.Namespace, alone: bool = False) -> Dict[str, Any]:
    """:func:`train`, or the row with the error that stopped it (the job goes on to the next)."""
    try:
        return train(spec, args, alone)
    except Exception as error:  # noqa: BLE001 - reported in the row's line, the job goes on
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"row": spec["row"], "method": spec["method"], "processes": 1 if alone else spec["processes"],
                "precision": "bf16" if spec["bf16"] else "fp32",
                "compiled": args.compile if spec["compiled"] else False,
                "sharded": spec["sharded"] and not alone, "error": f"{type(error).__name__}: {first}"}


def emit(line: Dict[str, Any]) -> None:
    """One JSON line, written whole (the ranks may share a stdout)."""
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: NCCL, a GPU per process; cpu: gloo")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: every one)")
    parser.add_argument("--updates", type=int, default=8, help="mini-batches K each row trains, K updates")
    parser.add_argument("--size", default="full", choices=sorted(SIZES), help="the model's and data's size")
    parser.add_argument("--compile", default="inductor", help="the compiled rows' torch.compile backend")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer")
    parser.add_argument("--scratch", default=None, help="the checkpoint rows' folder, every rank's (default: "
                        "one of the job's own in the temporary folder, removed after)")
    args = parser.parse_args(argv)
    if args.device == "cuda":  # the bitwise comparisons: deterministic kernels where torch has them
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first handle
        torch.use_deterministic_algorithms(True, warn_only=True)
    specs = plan(args.rows.split(","), args.updates)
    # every Pipeline's close() runs a full garbage collection: what lives now (the imports, and in
    # the tests' shared job what the scripts before left) is left out of them (as tests/torchrun_sharded.py)
    gc.collect()
    gc.freeze()
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    temporary = None
    if args.scratch is None:  # the same on every rank: the job's id
        args.scratch = temporary = os.path.join(tempfile.gettempdir(), "gpu-check-" + os.environ.get(
            "TORCHELASTIC_RUN_ID", str(os.getpid())))
    try:
        if processes > 1:
            for spec in specs:
                if spec["processes"] == processes:
                    line = run_row(spec, args)
                    if rank == 0 or "error" in line:  # every rank's error: one may be the cause
                        emit({**line, "rank": rank})
        if rank == 0:
            for line in one_process([s for s in specs if processes == 1 or s["processes"] == processes], args,
                                    every=processes == 1):
                emit(line)
    finally:
        if temporary is not None and rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)


if __name__ == "__main__":
    main()
