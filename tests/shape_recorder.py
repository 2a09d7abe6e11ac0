"""Test helper: record the shape of every tensor an operation produces (to prove no L×L×d tensor is made)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out
