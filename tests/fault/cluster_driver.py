"""Drives node-level faults on a multi-node Ray cluster on this machine (ray.cluster_utils).

Run as a script by tests/fault/test_nodes.py (one Ray connection per process, so it cannot
share the test session's cluster): `python -m tests.fault.cluster_driver OUT.json nodes|chaos`
writes a JSON summary to OUT.json.

Scenario `nodes`:

The head has no CPUs (it hosts only controllers, which are pinned to the head); workers live
on the other nodes, so adding and removing nodes adds and removes workers:

1. node A (2 CPUs): a run starts with 2 workers, max_workers 4;
2. node B (2 CPUs) joins: the run grows to 4 at a step boundary, survivors keep their pids;
3. node A is removed: its 2 workers die at once; the run goes on with the 2 on B;
4. node C (2 CPUs) joins: the waiting replacements start there and join;
5. node C is drained (Ray's drain call, reason preemption, a deadline): its workers leave at a
   step boundary as a planned departure, nobody counts as failed;
6. the head (the controller's node) is drained: the committed state is written to a
   checkpoint at the next step boundary, though none is due; the run is stopped.

Scenario `chaos` (see `chaos`) starts its workers from test zygotes; `nodes` the ordinary way.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

import elastic
from elastic import BatchConfig, CheckpointConfig, FitConfig, ScalingConfig
from elastic.events import read_events, to_record
from tests import zygote
from tests.jobs import regression_job

HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
          "health_check_timeout_ms": 200, "health_check_failure_threshold": 3}
LIMIT_S = 120.0


def wait_for(name: str, predicate, what: str) -> dict:
    deadline = time.monotonic() + LIMIT_S
    last = None
    while time.monotonic() < deadline:
        try:
            last = elastic.status(name)
        except elastic.errors.RunNotFoundError:
            last = None
        if last is not None and predicate(last):
            return last
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not reached in {LIMIT_S}s; last status {last}")


def _cluster() -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": HEALTH})
    # Cluster writes its address to /tmp/ray/ray_current_cluster, where any later `ray.init()` on
    # this machine would look; a driver killed by its timeout would leave it behind, stale.
    ray._common.utils.reset_ray_address()
    return cluster


def nodes(out_path: str) -> None:
    run_dir = tempfile.mkdtemp(prefix="elastic-nodes-")
    cluster = _cluster()
    summary: dict = {"run_dir": run_dir}
    try:
        node_a = cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, namespace="elastic", log_to_driver=False)
        name = "nodes"
        config = FitConfig(
            name=name, run_dir=run_dir, max_steps=100_000, steps_per_chunk=4,
            scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=4),
            batch=BatchConfig(global_batch_size=16),
            checkpoint=CheckpointConfig(path=f"{run_dir}/ckpt", every_steps=100_000),
        )
        elastic.start(regression_job(), config)
        first = wait_for(name, lambda s: s["state"] == "running" and s["step"] >= 4, "start")
        summary["first_pids"] = sorted(w["pid"] for w in first["workers"])

        cluster.add_node(num_cpus=2)  # node B
        grown = wait_for(name, lambda s: s["world_size"] == 4 and s["state"] == "running"
                         and s["step"] > first["step"], "grow to 4")
        summary["grown_pids"] = sorted(w["pid"] for w in grown["workers"])
        on_a = [w for w in grown["workers"] if w["node_id"] == node_a.node_id]
        summary["workers_on_a"] = len(on_a)

        removed_at = time.time()
        cluster.remove_node(node_a, allow_graceful=False)
        shrunk = wait_for(name, lambda s: s["world_size"] == 4 - len(on_a) and s["state"] == "running"
                          and s["failures"] >= len(on_a), "continue without node A")
        summary["after_loss_pids"] = sorted(w["pid"] for w in shrunk["workers"])
        summary["removed_at"] = removed_at

        cluster.add_node(num_cpus=2)  # node C
        rejoined = wait_for(name, lambda s: s["world_size"] == 4 and s["state"] == "running"
                            and s["step"] > shrunk["step"], "replacements join on node C")
        summary["rejoined_pids"] = sorted(w["pid"] for w in rejoined["workers"])

        # Node C is drained through Ray's own call, as the autoscaler, KubeRay or
        # `ray drain-node` would: its workers leave at a step boundary, nobody fails.
        node_c = next(w["node_id"] for w in rejoined["workers"]  # where the replacements run
                      if w["pid"] not in summary["after_loss_pids"])
        on_c = [w for w in rejoined["workers"] if w["node_id"] == node_c]
        summary["drained_workers"] = sorted(w["worker_id"] for w in on_c)
        summary["failures_before_drain"] = rejoined["failures"]
        _drain(node_c, deadline_s=60)
        drained = wait_for(name, lambda s: s["preemptions"] == len(on_c) and s["state"] == "running"
                           and s["step"] > rejoined["step"], "node C's workers leave")
        summary["after_drain"] = drained
        _drain(cluster.head_node.node_id, deadline_s=60)
        deadline = time.monotonic() + LIMIT_S
        while "checkpoint_written" not in [e.kind for e in read_events(run_dir)] \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        elastic.stop(name)
        deadline = time.monotonic() + LIMIT_S
        while not _ended(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        summary["events"] = [to_record(e) for e in read_events(run_dir)]
        summary["ok"] = True
    finally:
        with open(out_path, "w") as f:
            json.dump(summary, f)
        ray.shutdown()
        cluster.shutdown()


def _drain(node_id: str, deadline_s: float) -> None:
    """Ray's drain of a node for preemption, with a deadline (what KubeRay's pod deletion and
    the autoscaler do)."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot preemption (test)", int((time.time() + deadline_s) * 1000))
    assert accepted, why


def chaos(out_path: str) -> None:
    """Ten worker kills at random moments (so in random phases) and one node removal, in one
    run with the ledger on; then the run is stopped."""
    rng = random.Random(7)
    run_dir = tempfile.mkdtemp(prefix="elastic-chaos-")
    cluster = _cluster()
    summary: dict = {"run_dir": run_dir, "faults": []}
    try:
        nodes_ = [cluster.add_node(num_cpus=2) for _ in range(3)]
        ray.init(address=cluster.address, namespace="elastic", log_to_driver=False)
        name = "chaos"
        config = FitConfig(
            name=name, run_dir=run_dir, max_steps=100_000, steps_per_chunk=4, ledger=True,
            scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
            batch=BatchConfig(global_batch_size=16),
        )
        elastic.start(regression_job(), config)
        status = wait_for(name, lambda s: s["state"] == "running" and s["step"] >= 4, "start")
        node_kill_at = rng.randrange(3, 8)
        for i in range(10):
            if i == node_kill_at:
                # A node that hosts some of the workers, never all of them (that would lose the
                # state, which without checkpoints is a failure by design).
                status = wait_for(name, lambda s: s["world_size"] == 4 and s["state"] == "running",
                                  "full size before the node loss")
                count = {n.node_id: 0 for n in nodes_}
                for w in status["workers"]:
                    count[w["node_id"]] = count.get(w["node_id"], 0) + 1
                victim = min((n for n in nodes_ if 0 < count[n.node_id] < 4),
                             key=lambda n: count[n.node_id])
                cluster.remove_node(victim, allow_graceful=False)
                nodes_.remove(victim)
                summary["faults"].append({"kind": "node", "step": status["step"]})
                cluster.add_node(num_cpus=2)  # capacity comes back elsewhere
                status = wait_for(name, lambda s, f=status["failures"]: s["failures"] > f
                                  and s["state"] == "running", "recover from the node loss")
            status = wait_for(name, _settled(status["step"]), "progress before a kill")
            time.sleep(rng.uniform(0.0, 0.05))  # a random moment of a step
            rank = rng.randrange(status["world_size"])
            elastic.kill(name, rank)
            summary["faults"].append({"kind": "worker", "rank": rank, "step": status["step"]})
            status = wait_for(name, lambda s, f=status["failures"]: s["failures"] > f
                              and s["state"] == "running", "recover from the kill")
        final = wait_for(name, lambda s: s["world_size"] >= 2 and s["step"] >= status["step"] + 6,
                         "progress after the last fault")
        summary["failures"] = final["failures"]
        elastic.stop(name)
        deadline = time.monotonic() + LIMIT_S
        while not _ended(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        summary["events"] = [to_record(e) for e in read_events(run_dir)]
        summary["ok"] = True
    finally:
        with open(out_path, "w") as f:
            json.dump(summary, f)
        ray.shutdown()
        cluster.shutdown()


def _settled(after: int):
    """A status predicate: two or more workers have run three steps in one generation, past
    step `after + 3`. A worker that just joined shows in `world_size` a moment before the
    resize that admits it starts; killing the one state holder then would lose the state."""
    seen: dict[str, int] = {}

    def check(s: dict) -> bool:
        if s["state"] != "running" or s["world_size"] < 2:
            seen.clear()
            return False
        if seen.get("generation") != s["generation"]:
            seen.update(generation=s["generation"], step=s["step"])
            return False
        return s["step"] >= max(seen["step"], after) + 3

    return check


def _ended(name: str) -> bool:
    return elastic.status(name)["state"] in ("finished", "stopped", "failed")


@contextlib.contextmanager
def _warm_workers():
    """The raylets started inside start their workers from zygotes (tests/zygote.py): the
    chaos scenario's fourteen or so worker starts then cost a fork each instead of torch's
    imports. The `nodes` scenario keeps Ray's ordinary start covered."""
    servers, paths = zygote.start(tempfile.mkdtemp(prefix="elastic-zygote-"))
    try:
        with zygote.workers_from(paths):
            yield
    finally:
        for server in servers:
            server.kill()
            server.wait()


if __name__ == "__main__":
    scenario = sys.argv[2]
    warm = scenario == "chaos" and zygote.enabled()  # ELASTIC_TEST_ZYGOTE=0: none
    with _warm_workers() if warm else contextlib.nullcontext():
        {"nodes": nodes, "chaos": chaos}[scenario](sys.argv[1])
