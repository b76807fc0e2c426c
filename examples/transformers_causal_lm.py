"""Train a `transformers` GPT-2 causal language model with pipeoptim, then export it.

The model is `GPT2LMHeadModel` built from its config as it comes (tiny sizes from the flags below,
everything else the library's defaults), fed dict batches as causal-LM scripts write them
(`{"input_ids": ids, "attention_mask": mask, "labels": ids}`): no loss function, the model
computes its own loss. The data is a small synthetic corpus made here: nothing is downloaded.

    python examples/transformers_causal_lm.py                                   # 2 stages, one process
    torchrun --nproc-per-node 2 examples/transformers_causal_lm.py              # a process per stage
    torchrun --nproc-per-node 4 examples/transformers_causal_lm.py --shard-replicas
                                                            # 2 stages x 2 replicas, each stage sharded

Each launch writes its own folder (``--out``; by default runs/gpt2-example, and under torchrun
runs/gpt2-example-torchrunN for N processes), so that one launch never overwrites another's.

With --dropout 0 and a synchronous method (the default) the three print the same losses (with
dropout on, each launcher draws its own masks). At the end, the
checkpoint that `fit` wrote becomes a plain state dict with torch alone, which a fresh
`GPT2LMHeadModel` loads with `strict=True`, and `pipe.model()` (the trained model, of its own
class) goes through `save_pretrained` / `from_pretrained`.
"""
import argparse
import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import pipeoptim

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--layers", type=int, default=4, help="transformer blocks (GPT-2 small: 12)")
p.add_argument("--width", type=int, default=128, help="embedding width (GPT-2 small: 768)")
p.add_argument("--heads", type=int, default=4, help="attention heads (GPT-2 small: 12)")
p.add_argument("--vocab", type=int, default=512, help="vocabulary size (GPT-2: 50257)")
p.add_argument("--dropout", type=float, default=None,
               help="GPT-2's three dropout rates (default: the config's, 0.1); 0 makes runs comparable across launchers")
p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
p.add_argument("--sequences", type=int, default=512, help="sequences in the synthetic corpus")
p.add_argument("--batch-size", type=int, default=16, help="sequences per mini-batch (over all replicas)")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--method", default=None, help="a pipeoptim method (default: the library's)")
p.add_argument("--shard-replicas", action="store_true",
               help="under torchrun with more processes than stages: shard each stage over its replicas (FSDP2)")
p.add_argument("--out", type=Path, default=None,
               help="checkpoints and exported models (default: runs/gpt2-example; under torchrun with N "
                    "processes runs/gpt2-example-torchrunN)")
args = p.parse_args()
if args.out is None:  # each launcher its own folder: a torchrun launch does not overwrite the one-process run's
    under_torchrun = "WORLD_SIZE" in os.environ
    args.out = Path("runs/gpt2-example" + (f"-torchrun{os.environ['WORLD_SIZE']}" if under_torchrun else ""))

torch.manual_seed(0)
config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                    n_head=args.heads, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)  # GPT-2's 50256 lies outside a small vocabulary
if args.dropout is not None:
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = args.dropout
model = GPT2LMHeadModel(config)

# A synthetic corpus with structure to learn: each sequence walks a fixed random permutation of
# the vocabulary from a random first token, so every token predicts the next one.
step = torch.randperm(args.vocab)
corpus = torch.empty(args.sequences, args.seq, dtype=torch.long)
corpus[:, 0] = torch.randint(0, args.vocab, (args.sequences,))
for t in range(1, args.seq):
    corpus[:, t] = step[corpus[:, t - 1]]


def collate(rows):
    ids = torch.stack(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


method = {"method": args.method} if args.method else {}
pipe = pipeoptim.Pipeline(model, stages=args.stages, shard_replicas=args.shard_replicas,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
                          clip_grad_norm=1.0, **method)
# Each replica reads its own share of every mini-batch (one process: one replica, all of it).
sampler = DistributedSampler(corpus, num_replicas=pipe.data_parallel_size, rank=pipe.data_parallel_rank,
                             shuffle=True, seed=0, drop_last=True)
loader = DataLoader(corpus, batch_size=args.batch_size // pipe.data_parallel_size, sampler=sampler,
                    collate_fn=collate, drop_last=True)
say = print if pipe.rank == 0 else (lambda *a, **k: None)
checkpoints = args.out / "checkpoints"


def new_epoch(epoch, entry):
    sampler.set_epoch(epoch + 1)  # the next epoch's order
    say(f"epoch {epoch + 1}: loss {entry['loss']:.6f}")


result = pipe.fit(loader, epochs=args.epochs, checkpoint_dir=checkpoints, on_epoch=new_epoch)
say(f"{pipe.method.name} on {args.stages} stages x {pipe.data_parallel_size} replica(s): {len(result.losses)} updates, "
    f"final loss {result.losses[-1]:.6f}")

# The trained model, of its own class, with its own parameter names (on every rank).
trained = pipe.model()
if pipe.rank == 0:
    # 1. The checkpoint, with torch alone: a state dict GPT2LMHeadModel loads strictly.
    newest = checkpoints / json.loads((checkpoints / "latest.json").read_text())["checkpoint"]
    dcp_to_torch_save(newest, args.out / "model.pt")
    state = torch.load(args.out / "model.pt", weights_only=False)["model"]
    fresh = GPT2LMHeadModel(config)
    fresh.load_state_dict(state, strict=True)
    # 2. The transformers way: save_pretrained, then from_pretrained (from the local folder).
    trained.save_pretrained(args.out / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(args.out / "hf")
    probe = corpus[:2]
    with torch.no_grad():
        logits = [m.eval()(probe).logits for m in (trained, fresh, loaded)]
    same = all(torch.allclose(logits[0], other, atol=1e-5) for other in logits[1:])
    say(f"exported: {newest} -> {args.out / 'model.pt'}, loaded with strict=True; "
        f"save_pretrained -> {args.out / 'hf'}; the same logits from all three: {same}")
pipe.close()
