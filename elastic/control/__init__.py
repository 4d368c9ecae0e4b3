"""The control plane of a run, without Ray.

- `states`: the controller as a state machine (starting, running, recovering, resizing,
  finishing, finished, failed); `context`: what the states share.
- `decisions`: pure functions (chunk length, restore source, what a chunk's outcomes mean).
- `policy`: the failure policy, mapping error classes to actions with its counters.
- `group`: membership decisions (top up, admit, drop, capacity) and forming a generation.
- `batching`: the global batch, plans, micro-batch tuning, rebalancing and per-step metrics.
- `checkpoints`: when rank 0 writes, what a restore finds.
- `port`: the `Workers` interface the states act through, and the records it returns;
  `elastic.actors.workers` implements it with Ray, `simulation` with simulated members.
- `requests`: the control requests (status, events, scale, kill, stop), one record per kind;
  `status`: the run's status as its controller reports it.
- `channel`: the run's fast control channel (status, scale, kill, stop) on its host.
- `cursor`: where training stands in the sample order (the trainer's too; no torch).

`call`, `ControlServer`, `ControlUnavailable` and `ControlBusy` are the channel's, re-exported here.
"""

from elastic.control.channel import ControlBusy, ControlServer, ControlUnavailable, call

__all__ = ["ControlBusy", "ControlServer", "ControlUnavailable", "call"]
