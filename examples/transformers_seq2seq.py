"""Train a `transformers` BART encoder-decoder with pipeoptim on padded batches, then export it.

The model is `BartForConditionalGeneration` built from its config as it comes (tiny sizes from the
flags below, everything else the library's defaults: its encoder, decoder and head share one
embedding), fed dict batches as a seq2seq collator writes them: `{"input_ids", "attention_mask",
"labels"}`, every row padded to the longest in its batch, the padding's labels -100. There is no
`decoder_input_ids` and no loss function: BART shifts the labels into its decoder's input itself and
computes its own loss, so the labels reach the first stage (the shift) as well as the last (the
loss). T5 (`T5ForConditionalGeneration`) is fed the same way. The task is made here, nothing is downloaded:
each source is a random run of "words", its target the same words translated word for word
through a fixed permutation of the vocabulary.

    python examples/transformers_seq2seq.py                           # 2 stages, one process
    torchrun --nproc-per-node 2 examples/transformers_seq2seq.py      # a process per stage

What differs from a decoder-only model (examples/transformers_causal_lm.py): the rows' lengths
differ, so the micro-batches of a mini-batch hold different numbers of real target tokens; every
token weighs the same in the mini-batch's loss (pipeoptim's default `loss_normalization="items"`),
which makes the synchronous default equal the step on the whole mini-batch. The validation loss is
the mean over every real token of the held-out batches, every `--eval-every` mini-batches, through
the pipeline (`fit(eval_loader=..., eval_every=...)`). At the end the checkpoint becomes a plain
state dict that a fresh `BartForConditionalGeneration` loads with `strict=True`, the trained model
goes through `save_pretrained` / `from_pretrained`, and `generate` translates a held-out source.
"""
import argparse
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader
from transformers import BartConfig, BartForConditionalGeneration

import pipeoptim

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--layers", type=int, default=2, help="layers in the encoder and in the decoder (BART-base: 6)")
p.add_argument("--width", type=int, default=64, help="model width d_model (BART-base: 768)")
p.add_argument("--heads", type=int, default=4, help="attention heads (BART-base: 12)")
p.add_argument("--vocab", type=int, default=32, help="vocabulary size, 3 ids of it special (BART: 50265)")
p.add_argument("--dropout", type=float, default=None,
               help="BART's dropout rates (default: the config's, 0.1); 0 makes runs comparable across launchers")
p.add_argument("--max-len", type=int, default=8, help="the longest source (and target); the shortest is 2")
p.add_argument("--pairs", type=int, default=512, help="training pairs; another 64 are held out")
p.add_argument("--batch-size", type=int, default=16, help="pairs per mini-batch")
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--eval-every", type=int, default=16, help="mini-batches between two validation losses")
p.add_argument("--method", default=None, help="a pipeoptim method (default: the library's)")
p.add_argument("--out", type=Path, default=Path("runs/bart-example"), help="checkpoints and exported models")
args = p.parse_args()

PAD, EOS, FIRST = 1, 2, 3  # BART's pad and end ids (0 begins a sequence); ids from FIRST up are words
torch.manual_seed(0)
config = BartConfig(vocab_size=args.vocab, d_model=args.width, encoder_layers=args.layers, decoder_layers=args.layers,
                    encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
                    encoder_ffn_dim=4 * args.width, decoder_ffn_dim=4 * args.width,
                    max_position_embeddings=4 * args.max_len, pad_token_id=PAD, bos_token_id=0,
                    eos_token_id=EOS, decoder_start_token_id=EOS, forced_eos_token_id=EOS)
if args.dropout is not None:
    config.dropout = config.attention_dropout = config.activation_dropout = args.dropout
model = BartForConditionalGeneration(config)

# The data: a source of 2..max-len words; its target, each word renamed, then EOS.
rename = FIRST + torch.randperm(args.vocab - FIRST)
g = torch.Generator().manual_seed(1)


def pair():
    words = torch.randint(FIRST, args.vocab, (int(torch.randint(2, args.max_len + 1, (), generator=g)),),
                          generator=g)
    return words, torch.cat([rename[words - FIRST], torch.tensor([EOS])])


pairs = [pair() for _ in range(args.pairs + 64)]
train, held_out = pairs[:args.pairs], pairs[args.pairs:]


def collate(rows):
    """Pad each batch to its longest row: the mask 0 on the source's padding, labels -100 on the target's."""
    width = max(len(src) for src, _ in rows)
    tgt_width = max(len(tgt) for _, tgt in rows)
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), tgt_width), -100)
    for i, (src, tgt) in enumerate(rows):
        ids[i, :len(src)], labels[i, :len(tgt)] = src, tgt
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


method = {"method": args.method} if args.method else {}
pipe = pipeoptim.Pipeline(model, stages=args.stages, clip_grad_norm=1.0,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
                          **method)
loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate, drop_last=True,
                    generator=torch.Generator().manual_seed(2))
validation = DataLoader(held_out, batch_size=32, collate_fn=collate)
say = print if pipe.rank == 0 else (lambda *a, **k: None)
checkpoints = args.out / "checkpoints"

say(f"before training: validation loss {pipe.evaluate(validation):.6f}")  # splits the model on its first batch
result = pipe.fit(loader, epochs=args.epochs, checkpoint_dir=checkpoints, eval_loader=validation,
                  eval_every=args.eval_every,
                  on_eval=lambda entry: say(f"mini-batch {entry['batch']}: validation loss {entry['metric']:.6f}"))
say(f"{pipe.method.name} on {args.stages} stages, cut at {pipe.split_points}: {len(result.losses)} updates, "
    f"final loss {result.losses[-1]:.6f}")

trained = pipe.model()  # of its own class, with its own parameter names (on every rank)
if pipe.rank == 0:
    # 1. The checkpoint, with torch alone: a state dict BartForConditionalGeneration loads strictly.
    newest = checkpoints / json.loads((checkpoints / "latest.json").read_text())["checkpoint"]
    dcp_to_torch_save(newest, args.out / "model.pt")
    fresh = BartForConditionalGeneration(config)
    fresh.load_state_dict(torch.load(args.out / "model.pt", weights_only=False)["model"], strict=True)
    # 2. The transformers way, and a translation by the loaded model.
    trained.save_pretrained(args.out / "hf")
    loaded = BartForConditionalGeneration.from_pretrained(args.out / "hf").eval()
    source, target = held_out[0]
    with torch.no_grad():
        out = loaded.generate(source[None], max_new_tokens=args.max_len + 2, do_sample=False)[0, 1:]
        same = torch.equal(fresh.eval()(**collate([held_out[0]])).logits,
                           loaded(**collate([held_out[0]])).logits)
    say(f"generate: {source.tolist()} -> {out.tolist()} (target {target.tolist()}); "
        f"exported to {args.out / 'model.pt'} and {args.out / 'hf'}, loaded with strict=True, "
        f"the same logits from both: {same}")
pipe.close()
