"""The bytes torch allocates while a block runs, on any device: what a load holds at its peak, counted by storage
(tests/test_quant.py checks the loader's peaks with it on the CPU, where no allocator reports one)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that torch ops allocate while it is on, still alive, and their peak. A storage
    counts from the op that made it (a factory, or an op's fresh output) until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.counted.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage()._cdata not in self.counted:
                storage = t.untyped_storage()  # torch keeps one Python object per storage: freed with it
                self.counted.add(storage._cdata)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out
