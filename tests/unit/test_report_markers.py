"""What `elastic report` marks on `training.png`: the steps where workers were lost, and those
where the world changed size without a loss."""

from __future__ import annotations

from elastic.events import Generation, WorkerFailure
from elastic.report import markers


def _generation(step: int, reason: str, world: int) -> Generation:
    return Generation(generation=step, world_size=world, reason=reason, source_rank=0, step=step,
                      transport="shm", workers=list(range(world)))


def test_departures_are_marked_with_resizes_and_losses_apart():
    # Before, members that left on notice (a drained node, a straggler swapped) were unmarked.
    events = [_generation(0, "start", 4), _generation(10, "resize", 5),
              _generation(20, "departure", 4), _generation(30, "recovery", 3),
              _generation(31, "hand_over", 3)]
    failure = WorkerFailure(lost_ranks=[3], step=30, lost_workers=[4], survivors=3,
                            planned=False, reasons=["killed"])
    assert markers([*events, failure]) == ([30], [10, 20])


def test_a_run_that_committed_no_step_is_said_to_have_nothing_to_plot(tmp_path):
    import pytest

    from elastic.errors import ConfigError
    from elastic.report import write_report
    from elastic.runlog import RunLog

    with pytest.raises(ConfigError, match=r"has no metrics\.jsonl; is it a run directory"):
        write_report(str(tmp_path / "nothing"))
    RunLog(str(tmp_path / "failed")).event("stop_requested")  # a run that failed at its start
    with pytest.raises(ConfigError, match="committed no step, so there is nothing to plot"):
        write_report(str(tmp_path / "failed"))
