"""A writer SIGKILLed at random points, many times: the newest checkpoint that loads always
verifies and holds exactly the state of its step."""

import os
import random
import signal

import pytest
import torch

from elastic.checkpoint import load_checkpoint, write_checkpoint
from elastic.checkpoint.store import serialize
from tests.procs import warm_context

pytestmark = pytest.mark.fault


def _write_forever(root: str, first_step: int, ready) -> None:
    ready.set()
    step = first_step
    while True:
        parts = {"model": serialize({"w": torch.full((300_000,), float(step))}),
                 "optimizer": serialize({"m": torch.full((300_000,), -float(step))})}
        write_checkpoint(root, step, parts, {"world_size": 1})
        step += 1


def test_sigkill_during_writes_never_leaves_a_bad_newest_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    ctx = warm_context()
    rng = random.Random(0)
    next_step = 0
    loaded_steps = []
    for _ in range(12):
        ready = ctx.Event()
        proc = ctx.Process(target=_write_forever, args=(root, next_step, ready), daemon=True)
        proc.start()
        assert ready.wait(60)
        # Kill at a random moment: the event set by the child does not tell where it is.
        proc.join(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        loaded = load_checkpoint(root)
        if loaded is None:
            continue
        step = loaded.step
        assert torch.equal(loaded.parts["model"]["w"], torch.full((300_000,), float(step)))
        assert torch.equal(loaded.parts["optimizer"]["m"], torch.full((300_000,), -float(step)))
        assert loaded_steps == [] or step >= loaded_steps[-1]
        loaded_steps.append(step)
        next_step = step + 1
    assert len(loaded_steps) >= 6
