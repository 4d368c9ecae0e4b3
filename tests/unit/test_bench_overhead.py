"""`elastic bench overhead` without Ray: where the chunk boundaries fall, the per-step breakdown
of one run (hand-computed numbers), its median over rounds, and the language model: it builds,
its loss is the sum and count of the real tokens, and padding changes nothing."""

import pytest
import torch
from torch.nn import functional as F

from elastic import LossSum
from elastic.bench.overhead import (
    LENGTH,
    MIN_TOKENS,
    PAD,
    SAMPLES,
    VOCAB,
    Breakdown,
    _ddp_loss,
    breakdown,
    chunk_starts,
    elastic_rows,
    make_dataset,
    make_job,
    make_model,
    median_breakdown,
    token_loss_sum,
)


def test_chunks_start_every_steps_per_chunk_and_at_each_epoch_end():
    assert chunk_starts(40, 8, 32) == [0, 8, 16, 24, 32]
    assert chunk_starts(40, 12, 32) == [0, 12, 24, 32]  # 24..31 ends at the epoch's end
    assert chunk_starts(40, 40, 32) == [0, 32]  # the old `steps_per_chunk=steps`
    assert chunk_starts(11, 8, 32) == [0, 8]
    assert chunk_starts(5, 1, 32) == [0, 1, 2, 3, 4]


def _row(step: int, start: float, end: float, step_time: float, data: float, fb: float, comm: float,
         opt: float) -> dict[str, float]:
    return {"step": step, "start": start, "time": end, "step_time_s": step_time, "data_s": data,
            "forward_backward_s": fb, "comm_s": comm, "optimizer_s": opt}


# Steps 0 and 1 are warm-up. The last rank starts step 2 0.04 s after step 1 ended (its gap),
# step 3 0.10 s after step 2 ended and step 4 0.02 s after step 3 ended.
ROWS = [
    _row(0, 9.00, 10.00, 1.00, 0.50, 0.50, 0.00, 0.00),
    _row(1, 10.00, 11.00, 1.00, 0.50, 0.50, 0.00, 0.00),
    _row(2, 11.04, 11.15, 0.10, 0.01, 0.05, 0.02, 0.01),
    _row(3, 11.25, 11.45, 0.20, 0.02, 0.10, 0.04, 0.02),
    _row(4, 11.47, 11.60, 0.12, 0.03, 0.06, 0.01, 0.01),
]


def test_breakdown_of_a_run_with_a_chunk_starting_at_step_3():
    b = breakdown(ROWS, warmup=2, chunk_starts=[0, 3])
    assert b.step_s == pytest.approx(0.12)
    assert b.wall_s == pytest.approx(0.20)  # (11.60 - 11.00) / 3
    assert (b.data_s, b.forward_backward_s, b.comm_s, b.optimizer_s) == pytest.approx(
        (0.02, 0.06, 0.02, 0.01))
    assert b.other_s == pytest.approx(0.01)  # the step less its phases: 0.01, 0.02, 0.01
    assert b.idle_s == pytest.approx(0.16 / 3)  # mean of 0.04, 0.10, 0.02
    assert b.idle_in_chunk_s == pytest.approx(0.03)  # steps 2 and 4
    assert b.idle_at_boundary_s == pytest.approx(0.10)  # step 3


def test_breakdown_without_chunks_puts_every_gap_inside():
    b = breakdown(ROWS, warmup=2)
    assert b.idle_in_chunk_s == pytest.approx(0.04)
    assert b.idle_at_boundary_s is None
    only_starts = breakdown(ROWS, warmup=2, chunk_starts=range(5))
    assert only_starts.idle_in_chunk_s is None
    assert only_starts.idle_at_boundary_s == pytest.approx(0.04)


def test_elastic_rows_start_at_the_last_rank_to_start_in_step_order():
    lines = [{"step": 1, "timeline": [[5.0, 0, 0, 0, 0], [5.5, 0, 0, 0, 0]]},
             {"step": 0, "timeline": [[3.0, 0, 0, 0, 0], None, [2.5, 0, 0, 0, 0]]}]
    assert [(r["step"], r["start"]) for r in elastic_rows(lines)] == [(0, 3.0), (1, 5.5)]


def test_median_breakdown_takes_each_field_median_and_keeps_none():
    runs = [Breakdown(step_s=s, wall_s=2 * s, data_s=0.0, forward_backward_s=s, comm_s=0.0,
                      optimizer_s=0.0, other_s=0.0, idle_s=s / 10, idle_in_chunk_s=s,
                      idle_at_boundary_s=None) for s in (3.0, 1.0, 2.0)]
    m = median_breakdown(runs)
    assert m == runs[2]  # the middle run in every field
    assert median_breakdown(runs[:2]).step_s == 2.0 and median_breakdown(runs[:2]).wall_s == 4.0


def test_lm_data_set_is_padded_token_sequences_of_varying_length():
    x, y = make_dataset("lm").tensors
    assert x.shape == y.shape == (SAMPLES, LENGTH) and x.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # targets are the next tokens
    real = (y != PAD).sum(dim=1)
    # Padding only at the end: no real token after a PAD.
    assert torch.equal((y != PAD), torch.arange(LENGTH) < real[:, None])
    assert int(real.min()) == MIN_TOKENS - 1 and int(real.max()) == LENGTH
    assert int(x.max()) < VOCAB
    torch.testing.assert_close(make_dataset("lm").tensors[0], x)  # seeded


def test_lm_loss_is_the_sum_and_count_of_the_real_tokens():
    torch.manual_seed(0)
    model = make_model("lm")
    x = torch.tensor([[5, 6, 7, PAD, PAD, PAD]])
    y = torch.tensor([[6, 7, 8, PAD, PAD, PAD]])
    out = token_loss_sum(model, (x, y))
    assert isinstance(out, LossSum) and int(out.count) == 3
    logp = F.log_softmax(model(x)[0], dim=-1)
    torch.testing.assert_close(out.total, -(logp[0, 6] + logp[1, 7] + logp[2, 8]))
    torch.testing.assert_close(_ddp_loss("lm", model(x), y), out.total / 3)  # DDP: the mean
    assert make_job("lm").loss is token_loss_sum


def test_lm_loss_ignores_padding():
    torch.manual_seed(0)
    model = make_model("lm")
    x, y = (t[:8] for t in make_dataset("lm").tensors)
    padded = x == PAD
    assert 0 < int(padded.sum()) < x.numel()
    before = token_loss_sum(model, (x, y))
    changed = torch.where(padded, torch.randint(1, VOCAB, x.shape), x)
    after = token_loss_sum(model, (changed, y))
    torch.testing.assert_close(after.total, before.total)
    assert int(after.count) == int(before.count) == int((y != PAD).sum())
    # Not vacuous: a real input token does change it.
    real = x.clone()
    real[0, 0] = 1 + int(real[0, 0]) % (VOCAB - 1)
    assert not torch.allclose(token_loss_sum(model, (real, y)).total, before.total)


def test_lm_takes_a_training_step():
    torch.manual_seed(0)
    model = make_model("lm")
    x, y = (t[:4] for t in make_dataset("lm").tensors)
    assert model(x).shape == (4, LENGTH, VOCAB)
    token_loss_sum(model, (x, y)).total.backward()
    assert all(p.grad is not None for p in model.parameters())
