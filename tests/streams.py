"""What the CPU tests' fake CUDA streams hand out as a thread's current stream."""

from __future__ import annotations

import threading


class Stream(str):
    """A stream named `name`: a new object on every call, equal to (and hashed as) every other
    of the same name, as `torch.cuda.current_stream()` builds a new `Stream` each time that
    compares equal to the others of the same CUDA stream. A fake that returned one interned
    string would hide code that tells streams apart by `id`."""

    __slots__ = ()


def current(name: str) -> Stream:
    stream = Stream(name)
    assert stream is not Stream(name)  # not interned: each call a new object
    return stream


class Threads:
    """Each thread's current stream, as CUDA has it: the default stream ('user', where the
    backward pass runs) until the thread takes one of its own (`own_stream`: the buckets'
    communication thread's is 'comm'). A fake that named streams after threads would hide a
    communication thread left on the default stream."""

    def __init__(self) -> None:
        self._local = threading.local()

    def own_stream(self) -> None:
        assert threading.current_thread().name.startswith("elastic-grad-comm"), \
            "only the buckets' communication thread takes a stream of its own"
        self._local.name = "comm"

    def name(self) -> str:
        return getattr(self._local, "name", "user")

    def current(self) -> Stream:
        return current(self.name())
