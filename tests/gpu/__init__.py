"""The GPU tier (marked `gpu`; skipped without CUDA).

cuBLAS sizes its workspace once per process, from `CUBLAS_WORKSPACE_CONFIG` as it is at the
first GEMM, and the workspace decides which kernels (and so which bits) a GEMM may use: exact
mode's workers set ':4096:8' before theirs, so the tier's process does the same before any test
runs, for the plain references that exact-mode tests compare bits with."""

import contextlib
import os
from collections.abc import Iterator

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Exact mode's kernels in this process (what `elastic.trainer.exact.make_deterministic`
    sets in each replica: deterministic algorithms, no cuDNN timing), for a plain reference to
    run under; switched off again after (also where a replica built inside turned them on)."""
    import torch

    benchmark, threads = torch.backends.cudnn.benchmark, torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = benchmark
        torch.set_num_threads(threads)
