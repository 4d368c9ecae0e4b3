"""What the CPU tests' fake CUDA streams hand out as a thread's current stream."""

from __future__ import annotations


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
