"""A single-rank communicator with two planes that checks where each tensor lives: the data
plane (NCCL) takes CUDA tensors only, the control plane host tensors only (a CPU replica's
data plane, as under the NCCL simulator, host tensors). Sums over one rank change nothing, so a
replica trains on it as one process would."""

from __future__ import annotations

import torch


class _Control:
    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert not tensor.is_cuda, f"a CUDA tensor ({tensor.dtype}) on the control plane"
        self.calls.append(("allreduce", tensor.dtype, tensor.numel()))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        assert not tensor.is_cuda, f"a CUDA tensor ({tensor.dtype}) on the control plane"
        self.calls.append(("broadcast", tensor.dtype, tensor.numel()))
        return tensor

    def barrier(self) -> None:
        pass


class PlaneCheck:
    """One rank's data plane; `control` is its control plane. Records what each carried."""

    rank, world_size = 0, 1
    transport = "nccl"

    def __init__(self, cuda: bool = True) -> None:
        self.control = _Control()
        self.cuda = cuda
        self.calls: list[tuple[str, torch.dtype, int]] = []
        self.aborted = False

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert tensor.is_cuda == self.cuda, f"a {tensor.device} tensor on the data plane"
        self.calls.append(("allreduce", tensor.dtype, tensor.numel()))
        return tensor

    def start_allreduce(self, tensor: torch.Tensor) -> list:
        """As NCCL's (`Communicator.start_allreduce`): started, finished by `wait`."""
        self.allreduce(tensor)
        return []

    def wait(self, pending: list) -> None:
        assert pending == []

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise AssertionError("nothing is broadcast over the data plane")

    def shared_buffers(self, sizes: dict[torch.dtype, int]) -> None:
        """As `Communicator.shared_buffers` with no shared region (NCCL lends none)."""
        return None

    def abort(self) -> None:
        self.aborted = True
