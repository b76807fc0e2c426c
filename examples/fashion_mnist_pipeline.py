"""Your own CNN, DataLoader, AdamW, warm-up + cosine, clipping and bf16, on a PipeOptim pipeline.

    python examples/fashion_mnist_pipeline.py [--limit 600] [--epochs 2] [--stages 4]
    torchrun --nproc-per-node 2 examples/fashion_mnist_pipeline.py --stages 2   # a process per stage
"""
import argparse, math, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import pipeoptim
from pipeoptim.lab.tasks.image import load_arrays  # Fashion-MNIST from Debian's dataset-fashion-mnist

p = argparse.ArgumentParser(); p.add_argument("--limit", type=int); p.add_argument("--epochs", type=int, default=2)
p.add_argument("--stages", type=int, default=4)
args = p.parse_args()
torch.manual_seed(0)
data = load_arrays()
def tensors(images, labels, n):
    x = torch.tensor(images[:n], dtype=torch.float32).unsqueeze(1) / 255
    return TensorDataset((x - data.mean) / data.std, torch.tensor(labels[:n], dtype=torch.long))
train = DataLoader(tensors(data.train_images, data.train_labels, args.limit), batch_size=64, shuffle=True, drop_last=True)
test = DataLoader(tensors(data.test_images, data.test_labels, args.limit and args.limit // 2), batch_size=500)

model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
steps, warmup = args.epochs * len(train), max(1, args.epochs * len(train) // 20)
cosine = lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
pipe = pipeoptim.Pipeline(model, method="pipeoptim", stages=args.stages, loss_fn=nn.functional.cross_entropy,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01),
                          lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, cosine),
                          clip_grad_norm=1.0, precision="bf16")
accuracy = lambda out, y: (out.argmax(-1) == y).float().mean()
result = pipe.fit(train, epochs=args.epochs, eval_loader=test, metric=accuracy,
                  on_epoch=lambda e, m: pipe.rank == 0 and print(f"epoch {e + 1}: loss {m['loss']:.4f}  test accuracy {m['metric']:.4f}"))
pipe.rank == 0 and print(f"test accuracy {result.metrics['epochs'][-1]['metric']:.4f} after {len(result.losses)} updates, "
      f"{result.metrics['samples_per_second']:.0f} samples/s, weight copies per stage {result.metrics['weight_versions']}")
