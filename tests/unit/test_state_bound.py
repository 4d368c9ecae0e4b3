"""Peer restore refuses an announced state larger than any this replica could hold."""

import io

import torch
from torch import nn

from elastic.trainer.replica import max_state_bytes


def _serialised(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(), "cursor": {"epoch": 3, "offset": 10, "samples": 999}}, buffer)
    return len(buffer.getvalue())


def _trained(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()


def test_the_bound_covers_a_trained_peers_state_even_when_this_optimizer_is_fresh():
    for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: torch.optim.Adam(p, amsgrad=True)):
        torch.manual_seed(0)
        peer = nn.Sequential(nn.Linear(32, 512), nn.BatchNorm1d(512), nn.Linear(512, 8))
        peer_opt = make(peer.parameters())
        _trained(peer, peer_opt)
        fresh = nn.Sequential(nn.Linear(32, 512), nn.BatchNorm1d(512), nn.Linear(512, 8))
        assert _serialised(peer, peer_opt) <= max_state_bytes(fresh, make(fresh.parameters()))


def test_the_bound_follows_the_model_so_a_huge_announcement_is_refused_for_a_small_one():
    small, large = nn.Linear(8, 8), nn.Linear(2048, 2048)
    small_bound = max_state_bytes(small, torch.optim.SGD(small.parameters(), lr=0.1))
    large_bound = max_state_bytes(large, torch.optim.SGD(large.parameters(), lr=0.1))
    assert small_bound < 64 << 20  # far below what exhausting memory takes
    # Each parameter byte allows itself plus three optimizer tensors, no more.
    params = sum(p.numel() * p.element_size() for p in large.parameters())
    assert large_bound - small_bound >= 4 * (params - 8 * 9 * 4)
    assert large_bound - small_bound <= 4 * params
