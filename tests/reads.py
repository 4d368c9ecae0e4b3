"""Counting the host's reads of tensor values: on a GPU each waits for the device to finish
everything queued before it."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

# Calls that read a tensor's values into the host.
READS = frozenset({"tolist", "item", "__float__", "__bool__", "__int__", "__index__", "cpu",
                   "numpy"})


class HostReads(TorchFunctionMode):
    """Counts the calls named in `names` (default `READS`) made under it."""

    def __init__(self, names: frozenset[str] = READS) -> None:
        super().__init__()
        self.names = names
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))
