"""An image-folder job: PNG files in one folder per class, decoded with Pillow and augmented
(random crop and flip from torch's generator, seeded per group by the step) while the worker
trains, by loader processes:

    elastic run examples/images.py:job --workers 2 --loader-workers 2 --max-steps 40

`job()` writes a small synthetic folder first (`ELASTIC_EXAMPLE_IMAGES`, default a folder in
the temporary directory); point `ImageFolder` at your own `root/CLASS/*.png|jpg` instead. The
folder must be readable at the same path on every node.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from torch import nn

from elastic import TrainJob

SIZE = 40
CROP = 32
CLASSES = ("circles", "stripes", "noise")


class ImageFolder(torch.utils.data.Dataset):
    """`root/CLASS/NAME.png` files; a sample is (normalised crop, class index)."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.files = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                      for f in sorted(os.listdir(os.path.join(root, c)))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as image:
            x = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        x = x.float().div_(255)
        top, left = (int(v) for v in torch.randint(0, x.shape[1] - CROP + 1, (2,)))
        x = x[:, top : top + CROP, left : left + CROP]
        if float(torch.rand(())) < 0.5:
            x = x.flip(2)
        return (x - 0.5) / 0.25, label


def write_folder(root: str, per_class: int = 64, seed: int = 0) -> None:
    """A synthetic image folder (written once; each file under a temporary name, then
    renamed, so a reader never sees half a file); another `seed` draws other images."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    for c, name in enumerate(CLASSES):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for k in range(per_class):
            path = os.path.join(root, name, f"{k:04d}.png")
            if os.path.exists(path):
                continue
            phase = rng.uniform(0, 6.28)
            pattern = [np.sin(20 * np.hypot(xx - 0.5, yy - 0.5) + phase),
                       np.sin(25 * xx + phase), rng.normal(0, 1, (SIZE, SIZE))][c]
            pixels = np.clip(128 + 80 * pattern[..., None] + rng.normal(0, 20, (SIZE, SIZE, 3)),
                             0, 255).astype(np.uint8)
            partial = f"{path}.{os.getpid()}.tmp"
            Image.fromarray(pixels).save(partial, format="PNG")
            os.replace(partial, path)


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, len(CLASSES)),
    )


def loss(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(m(x), y)


def job() -> TrainJob:
    root = os.environ.get("ELASTIC_EXAMPLE_IMAGES",
                          os.path.join(tempfile.gettempdir(), f"elastic-example-images-{os.getuid()}"))
    write_folder(root)
    return TrainJob(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                    loss=loss, dataset=lambda: ImageFolder(root))
