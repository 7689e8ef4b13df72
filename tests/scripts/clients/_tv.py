"""The torchvision transforms the client scripts use, in torch and PIL (torchvision cannot be
installed here). Each does what torchvision 0.2x does to a PIL image, with the same random
draws from the same generator (torch's global one), in the same order:

- ``Resize(size)`` (an int): the shorter side becomes ``size``, the longer
  ``int(size * long / short)``, with PIL's resampling (PIL returns a copy when nothing changes);
- ``RandomCrop(size)``: no draw when the image is already ``size`` x ``size``; otherwise
  ``top = torch.randint(0, h - size + 1, (1,))`` then ``left = torch.randint(0, w - size + 1, (1,))``;
- ``CenterCrop(size)``: ``top = int(round((h - size) / 2))``, ``left`` likewise;
- ``RandomHorizontalFlip()``: ``torch.rand(1) < 0.5`` flips;
- ``ToTensor()``: uint8 HWC -> float CHW in [0, 1];
- ``Normalize([0.5], [0.5])``: ``(x - 0.5) / 0.5``;
- ``Compose``: applies them in order.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

BILINEAR = Image.BILINEAR


class Compose:
    def __init__(self, steps: list[Callable[[Any], Any]]) -> None:
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class Resize:
    def __init__(self, size: int, interpolation: int = BILINEAR) -> None:
        self.size, self.interpolation = size, interpolation

    def __call__(self, image: Image.Image) -> Image.Image:
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        return image.resize((new_w, new_h), self.interpolation)


class RandomCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        w, h = image.size
        if w == self.size and h == self.size:
            return image
        top = int(torch.randint(0, h - self.size + 1, size=(1,)).item())
        left = int(torch.randint(0, w - self.size + 1, size=(1,)).item())
        return image.crop((left, top, left + self.size, top + self.size))


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        w, h = image.size
        top, left = int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0))
        return image.crop((left, top, left + self.size, top + self.size))


class RandomHorizontalFlip:
    def __call__(self, image: Image.Image) -> Image.Image:
        if torch.rand(1) < 0.5:
            return image.transpose(Image.FLIP_LEFT_RIGHT)
        return image


def identity(x: Any) -> Any:
    return x


def to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.array(image, dtype=np.uint8, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


def normalize_half(x: torch.Tensor) -> torch.Tensor:
    return (x - 0.5) / 0.5
