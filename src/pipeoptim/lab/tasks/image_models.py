"""The image task's models (Fashion-MNIST, inputs ``(B, 1, 28, 28)``, 10 classes).

Models. Every model is an ``nn.Sequential`` of blocks; each block takes one tensor and returns one
tensor and holds no state that spans blocks, so any cut between blocks is a valid pipeline stage.

* ``vgg`` (default): 7 conv-ReLU blocks (16-24-32-48-64-64-64 channels, max-pooling to 14, 7, 3)
  and a pool+MLP head, 8 blocks. It has no BatchNorm, so where the model is cut into stages
  does not change the arithmetic, and splitting a batch into micro-batches changes results
  only by floating-point rounding (BatchNorm would compute statistics per micro-batch). The seven conv blocks take roughly even forward+backward time (4-7 ms each at batch
  64 on one CPU thread; the head about 1.5 ms).
* ``vgg-bn``: the same with BatchNorm after each convolution.
* ``resnet``: a BatchNorm stem, 5 residual blocks (each holding its own skip connection; widths
  16-32-64 at 14, 7 and 4 pixels) and an average-pool+linear head, 7 blocks.
* ``mlp``: flatten and 3 hidden layers of 256; 4 blocks, for fast tests.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from .common import seeded

NUM_CLASSES = 10  #: Fashion-MNIST's classes (named in tasks/image.py)


def _init_weights(model: nn.Module) -> None:
    """He (fan-in, ReLU) initialisation of convolutions and hidden linear layers, zero biases;
    the classifier (the last linear layer) gets N(0, 0.01^2) weights.

    Without BatchNorm He initialisation keeps activations at a steady scale through the 7
    convolutions of ``vgg``; the small classifier starts every model with logits near zero
    (loss ln 10), which trains faster in the first steps than large random logits.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            if linears and module is linears[-1]:
                nn.init.normal_(module.weight, std=0.01)
            else:
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def conv_block(c_in: int, c_out: int, *, pool_before: bool = False, pool_after: bool = False,
               batch_norm: bool = False) -> nn.Sequential:
    """[max-pool 2x2] -> 3x3 conv (same padding) -> [BatchNorm] -> ReLU -> [max-pool 2x2]."""
    layers: List[nn.Module] = [nn.MaxPool2d(2)] if pool_before else []
    layers.append(nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=not batch_norm))
    if batch_norm:
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU())
    if pool_after:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def build_vgg(batch_norm: bool = False, hidden: int = 128) -> nn.Sequential:
    """A VGG-style CNN of 8 blocks; the comments give each block's output size.

    Max-pooling sits at block ends (before a cut) where that shrinks the activation a stage
    sends; the widths are chosen so that the blocks' forward+backward times are roughly even.
    """
    bn = batch_norm
    blocks = [
        conv_block(1, 16, pool_after=True, batch_norm=bn),    # 16 x 14 x 14
        conv_block(16, 24, batch_norm=bn),                    # 24 x 14 x 14
        conv_block(24, 32, batch_norm=bn),                    # 32 x 14 x 14
        conv_block(32, 48, pool_before=True, batch_norm=bn),  # 48 x 7 x 7
        conv_block(48, 64, batch_norm=bn),                    # 64 x 7 x 7
        conv_block(64, 64, batch_norm=bn),                    # 64 x 7 x 7
        conv_block(64, 64, batch_norm=bn),                    # 64 x 7 x 7
        nn.Sequential(                                        # 10 logits
            nn.MaxPool2d(2), nn.Flatten(),                    # 64 x 3 x 3 = 576
            nn.Linear(64 * 3 * 3, hidden), nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        ),
    ]
    model = nn.Sequential(*blocks)
    # tensor parallelism (Pipeline(tensor_parallel=T)): the head's hidden features split, the
    # convolutions whole on every tensor rank
    model._tp_plan = {"7.2": "colwise", "7.4": "rowwise"}
    return model


class ResidualBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv-BN layers plus a skip connection, then ReLU.

    The skip is the identity, or a strided 1x1 conv-BN projection where the shape changes. The
    skip lives inside the block, so the block maps one tensor to one tensor.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def build_resnet() -> nn.Sequential:
    """A small ResNet of 7 blocks: stem, 5 residual blocks, average-pool + linear head."""
    return nn.Sequential(
        nn.Sequential(                                   # stem: 16 x 14 x 14
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
            nn.ReLU(), nn.MaxPool2d(2),
        ),
        ResidualBlock(16, 16),                           # 16 x 14 x 14
        ResidualBlock(16, 32, stride=2),                 # 32 x 7 x 7
        ResidualBlock(32, 32),                           # 32 x 7 x 7
        ResidualBlock(32, 64, stride=2),                 # 64 x 4 x 4
        ResidualBlock(64, 64),                           # 64 x 4 x 4
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, NUM_CLASSES)),
    )


def build_mlp(hidden: int = 256) -> nn.Sequential:
    """A 4-block MLP: flatten+linear+ReLU, two linear+ReLU blocks, a linear output block."""
    model = nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Linear(hidden, NUM_CLASSES),
    )
    # tensor parallelism: two column-wise / row-wise pairs (one all-reduce per pair and pass)
    model._tp_plan = {"0.1": "colwise", "1.0": "rowwise", "2.0": "colwise", "3": "rowwise"}
    return model


#: model name -> constructor (parameters are initialised by :func:`build_image_model`)
MODELS: Dict[str, Callable[[], nn.Sequential]] = {
    "vgg": lambda: build_vgg(batch_norm=False),
    "vgg-bn": lambda: build_vgg(batch_norm=True),
    "resnet": build_resnet,
    "mlp": build_mlp,
}


def build_image_model(name: str, seed: int) -> nn.Sequential:
    """A freshly initialised model ``name``; the same ``seed`` gives the same parameters.

    The global random state is left as it was (the model is built inside :func:`seeded`).
    """
    if name not in MODELS:
        raise ValueError(f"unknown image model {name!r}; choose one of: {', '.join(MODELS)}")
    with seeded(seed):
        model = MODELS[name]()
        _init_weights(model)
    return model


# ---------------------------------------------------------------------------------------------
# the task
