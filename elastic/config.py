"""Configuration: one frozen pydantic model per concern.

Every field has a description; bad input fails at construction with one message that names
the setting to change. Durations are `timedelta`; unlimited is `None`. Environment overrides
are read here only, from the named constants below.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Backend = Literal["auto", "gloo", "nccl"]
Algorithm = Literal["auto", "direct", "hierarchical", "ring", "tree", "halving_doubling", "native"]
ReduceOp = Literal["sum", "avg", "max"]

ALGORITHMS: tuple[Algorithm, ...] = (
    "auto", "direct", "hierarchical", "ring", "tree", "halving_doubling", "native",
)

HOME_ENV = "ELASTIC_HOME"
"""Storage root of the run index (`<root>/runs/NAME.json`); default `~/.elastic`."""


def storage_root() -> str:
    """Where the run index lives: `$ELASTIC_HOME`, else `~/.elastic`."""
    return os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".elastic")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def choose_backend(use_gpu: bool, gpus_per_worker: float, nccl: bool,
                   exact: bool = False) -> Literal["gloo", "nccl"]:
    """What `CollectiveConfig.backend='auto'` runs on: NCCL for GPU workers that own a GPU
    each when it is installed (`nccl`); else the host plane: CPU workers, GPU workers that
    share a GPU (NCCL refuses two ranks on one), no cupy, or exact mode (`exact`: its integer
    sums are made on the host)."""
    return "nccl" if use_gpu and gpus_per_worker >= 1 and nccl and not exact else "gloo"


def nccl_installed() -> bool:
    """Whether cupy (which brings NCCL: the `gpu` or `gpu-cu13` extra) can be imported here,
    without importing it."""
    return importlib.util.find_spec("cupy") is not None


class CollectiveConfig(_Frozen):
    """How the workers talk to each other."""

    backend: Backend = Field(
        default="auto",
        description="Communication backend: 'auto' (the default: 'nccl' for GPU workers with a "
        "GPU each when cupy is installed where the FitConfig is made, else 'gloo'; decided "
        "once, as the FitConfig is validated, so that every worker uses the same), 'gloo' "
        "(host memory: shared memory between the ranks of a host, gloo between hosts; GPU "
        "workers copy their gradients into page-locked host memory and back, which lets several "
        "workers share one GPU) or 'nccl' (CUDA tensors, one GPU per rank, needs the `gpu` "
        "extra for CUDA 12 or `gpu-cu13` for CUDA 13). A CollectiveConfig used on its own (a "
        "communicator without a FitConfig) reads 'auto' as 'gloo'.",
    )
    algorithm: Algorithm = Field(
        default="auto",
        description="Allreduce algorithm: 'auto' ('native' with nccl; with gloo 'direct' "
        "wherever ranks share a host through shared memory, else 'ring'), 'direct' (every "
        "rank of a host reduces its slice straight "
        "from its peers' shared-memory buffers), 'hierarchical' (direct inside each host, the "
        "network between hosts; on one host the same as 'direct', and 'direct' runs this way "
        "when the ranks span hosts; both fall back to 'ring' without shared memory), 'ring' "
        "(bandwidth-optimal, any world size), 'tree' (binomial reduce + broadcast), "
        "'halving_doubling' (Rabenseifner), or 'native' (the backend's own).",
    )
    timeout: timedelta = Field(
        default=timedelta(minutes=5),
        gt=timedelta(0),
        description="Longest a single collective may take before it fails with "
        "CollectiveTimeoutError. Failures are normally detected long before this.",
    )
    rendezvous_timeout: timedelta = Field(
        default=timedelta(seconds=60),
        gt=timedelta(0),
        description="Longest the ranks of a new generation wait for each other to connect.",
    )
    overlap: bool | None = Field(
        default=None,
        description="Reduce gradients in buckets while the backward pass is still running (as "
        "DDP does) instead of in one allreduce after it. Default: on for GPU workers (over "
        "nccl, and on the host plane, where the copies from the GPU and the sums in host "
        "memory run beside the backward pass on the GPU), off for CPU workers (measured: the "
        "communication threads compete with the backward pass for the same cores; see "
        "docs/benchmarks.md).",
    )

    @property
    def overlap_enabled(self) -> bool:
        """Whether gradient buckets overlap the backward pass."""
        return self.overlap if self.overlap is not None else self.backend == "nccl"
    bucket_bytes: int = Field(
        default=25 << 20, ge=1024,
        description="Size of a gradient bucket when overlap is on (DDP's default is 25 MB).",
    )
    first_bucket_bytes: int = Field(
        default=1 << 20, ge=1024,
        description="Size of the first bucket (the last layers' gradients), small so that "
        "communication starts early in the backward pass.",
    )
    segment_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="Pipelining granularity of the ring algorithm in bytes: each ring step is "
        "sent in segments of this size so that reduction overlaps transfer. Smaller segments "
        "overlap more but cost a thread hand-off each over gloo's TCP transfers (16 MiB "
        "measured best on a 2-core host); over shared memory 1-16 MiB measured alike.",
    )
    shared_memory: bool = Field(
        default=True,
        description="When every rank of a generation is on one host (gloo backend), move "
        "point-to-point transfers through shared memory (/dev/shm) instead of loopback TCP. "
        "Falls back to gloo's transfers by itself when the ranks span hosts, /dev/shm lacks "
        "room, or the platform is not Linux x86_64.",
    )
    shm_channel_bytes: int = Field(
        default=4 << 20, ge=4096,
        description="Bytes of each shared-memory ring (one per ordered pair of ranks on a "
        "host; each rank's segment holds world_size - 1 of them). Larger rings let a sender "
        "run further ahead of its receiver.",
    )
    shm_chunk_bytes: int = Field(
        default=4 << 20, ge=4096,
        description="Bytes of each of the two shared-memory buffers every rank of a host holds "
        "for the 'direct' and 'hierarchical' allreduce; larger messages go through them in "
        "chunks of this size.",
    )
    shm_registered_buffers: bool = Field(
        default=True,
        description="Keep each step's flat gradient buffers in shared memory that the ranks of "
        "a host lend each other, so that the 'direct', 'hierarchical' and 'auto' allreduce "
        "reduce them where they lie (no copy in or out of its buffers, two synchronisations "
        "per allreduce instead of two per chunk). Needs /dev/shm room for one copy of the "
        "gradients per rank: where a rank has none, or a host has a single rank, no rank of the "
        "generation lends and the buffers are copied as with this off. Off: always copy.",
    )
    simulated_hosts: int | None = Field(
        default=None, ge=1,
        description="For tests and benchmarks only: treat the ranks of a generation as spread "
        "over this many hosts (contiguous blocks of ranks of near-equal size), so that shared "
        "memory is used only inside a block and the network between blocks, as on a real "
        "cluster. None: ranks are grouped by the host they really run on.",
    )
    nccl_simulator: bool = Field(
        default=False,
        description="For tests only: run backend 'nccl' against elastic's CPU simulator of "
        "NCCL's execution model (groups run in order per stream, blocking init, abort, result "
        "codes) instead of cupy, on CPU tensors, so that the GPU code path can be exercised on "
        "a machine without a GPU. Needs backend 'nccl'; scaling.use_gpu may then be False.",
    )

    @model_validator(mode="after")
    def _check_simulator(self) -> CollectiveConfig:
        if self.nccl_simulator and self.backend != "nccl":
            raise ValueError("collective.nccl_simulator simulates NCCL; it needs "
                             "collective.backend='nccl'")
        return self


class ScalingConfig(_Frozen):
    """How many workers, and what each one needs."""

    num_workers: int = Field(ge=1, description="Workers to start with (the target world size).")
    min_workers: int | None = Field(
        default=None, ge=1,
        description="Fewest workers the run may continue with; below it the run waits for "
        "capacity up to FailureConfig.capacity_timeout. Default: 1.",
    )
    max_workers: int | None = Field(
        default=None, ge=1,
        description="Most workers the run may grow to (scale requests, new capacity). "
        "Default: num_workers.",
    )
    use_gpu: bool = Field(
        default=False,
        description="Give each worker a GPU (scaling.gpus_per_worker of one): the GPU Ray "
        "assigns it holds the model, the optimizer state, the batches (moved by "
        "TrainJob.move_batch if given) and the gradients.")
    gpus_per_worker: float = Field(
        default=1.0, gt=0,
        description="With use_gpu: the GPUs Ray reserves per worker. A fraction (0.25: four "
        "workers per GPU) lets workers share a GPU; they then reduce over host memory "
        "(collective.backend 'gloo'), since NCCL refuses two ranks on one GPU. Above 1: the "
        "worker reserves several GPUs and computes on the first.")
    cpus_per_worker: float = Field(default=1.0, gt=0, description="CPUs reserved per worker actor.")
    spares: int = Field(
        default=0, ge=0,
        description="Hot spares: worker processes started with the run, their model built and "
        "data set ready, that train nothing until a member is lost or leaves; one then takes "
        "its place in the same recovery or departure, so the run keeps its size instead of "
        "waiting for a cold start. Spares are on top of the world size: max_workers bounds "
        "the workers that train, and the cluster must have room for num_workers + spares "
        "workers (spares are started before any growth into free capacity). A spare that is "
        "promoted or dies is replaced in the background.",
    )
    threads_per_worker: int | None = Field(
        default=None, ge=1,
        description="torch intra-op threads in each worker (torch.set_num_threads). Default: "
        "what torch picks under Ray's CPU reservation; with batch.exact, int(cpus_per_worker) "
        "(the thread count is part of what exact mode reproduces).",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> ScalingConfig:
        g = self.gpus_per_worker
        if g > 1 and g != int(g):
            raise ValueError(f"scaling.gpus_per_worker {g}: above 1 it must be a whole number of "
                             "GPUs (Ray places a fraction within one GPU); use 1, 2, ... or a "
                             "fraction below 1")
        low = self.min_workers or 1
        high = self.max_workers or self.num_workers
        if low > high:
            raise ValueError(
                f"min_workers ({low}) is above max_workers ({high}); lower scaling.min_workers"
            )
        if not low <= self.num_workers <= high:
            raise ValueError(
                f"num_workers ({self.num_workers}) must lie in [min_workers, max_workers] = "
                f"[{low}, {high}]; change scaling.num_workers"
            )
        return self

    @property
    def lower(self) -> int:
        """The effective minimum world size."""
        return self.min_workers or 1

    @property
    def upper(self) -> int:
        """The effective maximum world size."""
        return self.max_workers or self.num_workers


BatchPolicy = Literal["fixed", "scale_with_workers"]
Groups = Literal["auto", "on", "off"]
LrScaling = Literal["linear", "sqrt", "none"]


class BatchConfig(_Frozen):
    """The global batch (part of the math), how it is split (not part of it), and the policy
    for users who want the global batch to follow the world size."""

    global_batch_size: int = Field(
        ge=1, description="Samples per optimizer step, summed over all workers. Fixed for the run "
        "with policy 'fixed'; with 'scale_with_workers' it is the batch at scaling.num_workers."
    )
    max_micro_batch: int | None = Field(
        default=None, ge=1,
        description="Largest micro-batch a worker runs forward/backward on at once; larger shares "
        "are accumulated. Default: no cap.",
    )
    policy: BatchPolicy = Field(
        default="fixed",
        description="'fixed': the global batch never changes, so an elastic run reproduces an "
        "uninterrupted one. 'scale_with_workers': global batch = (global_batch_size / "
        "scaling.num_workers) x world size, with the learning rate scaled by batch.lr_scaling.",
    )
    lr_scaling: LrScaling = Field(
        default="linear",
        description="With policy 'scale_with_workers': the learning-rate factor for a batch k "
        "times the initial one, 'linear' (k, Goyal et al. 2017), 'sqrt' (sqrt k) or 'none'.",
    )
    warmup_steps: int = Field(
        default=0, ge=0,
        description="With policy 'scale_with_workers': steps over which the learning-rate factor "
        "ramps linearly to its new value after every change of the world size (0: at once).",
    )
    autotune: bool = Field(
        default=True,
        description="After the start and every membership change, try candidate micro-batch "
        "sizes on real steps (the math does not change) and keep the fastest.",
    )
    autotune_candidates: int = Field(
        default=3, ge=1,
        description="Micro-batch sizes tried: the largest allowed, then halvings of it.",
    )
    autotune_steps: int = Field(
        default=2, ge=1, description="Steps each micro-batch candidate is timed for."
    )
    rebalance: bool = Field(
        default=True,
        description="Measure each worker's throughput and give faster workers larger shares, "
        "so that the slowest worker stops setting the pace (the math does not change).",
    )
    rebalance_threshold: float = Field(
        default=0.15, gt=0, lt=1,
        description="Re-split only when the predicted saving is at least this fraction of the "
        "step time (hysteresis against noise; steps dominated by communication are left alone).",
    )
    groups: Groups = Field(
        default="auto",
        description="Cut the global batch into fixed groups of batch.group_size samples, run "
        "every forward on exactly one group and seed its random numbers by (seed, step, group), "
        "so that BatchNorm and dropout give the same math for any shares, micro-batches and "
        "world size. 'auto': on for models with BatchNorm or dropout-like layers (dropout, RReLU, "
        "attention or recurrent layers with dropout, stochastic depth, a float '*drop*' above 0). "
        "'off': the math of such a model follows the split (shares and micro-batches are then "
        "not rebalanced or autotuned).",
    )
    group_size: int | None = Field(
        default=None, ge=1,
        description="Samples per group (G) with batch.groups on; BatchNorm normalises over G "
        "samples, so it is part of the math. Default: global_batch_size / "
        "scaling.num_workers, what DDP at the starting world size normalises over.",
    )
    exact: bool = Field(
        default=False,
        description="Exact mode: the final weights are bit-identical (torch.equal) for any "
        "failure schedule, resize, rebalance and world size, and to one process running the "
        "same groups, given the same torch build, thread count and hardware type. Turns groups "
        "on; each group's gradient, loss, count and BatchNorm terms are rounded to integers at "
        "a power-of-two scale and summed exactly, so the sum does not depend on the order; "
        "kernels are deterministic and the threads fixed (scaling.threads_per_worker). Costs "
        "8-byte integers on the wire (twice float32) and no overlap of communication with the "
        "backward pass. GPU workers too, on the host plane (collective.backend 'gloo', what "
        "'auto' picks with exact), where the bits hold for one GPU model and its kernels.",
    )


class FailureConfig(_Frozen):
    """What counts as a failure and how long to wait."""

    max_user_retries: int = Field(
        default=2, ge=0,
        description="How many times a step is retried after user code (model, loss, dataset) "
        "raised, before the run fails with UserCodeError.",
    )
    max_start_failures: int = Field(
        default=3, ge=1,
        description="Workers in a row that fail to start during the run in a way that would "
        "repeat (their factories raise there, a node builds another data set or cannot import "
        "this elastic; not a node lost as it started) before the run stops starting "
        "replacements and spares: it goes on with the workers it has (below "
        "scaling.min_workers it fails). A worker that joins, or a scale request, starts the "
        "count over.",
    )
    max_collective_retries: int = Field(
        default=3, ge=0,
        description="Recoveries in a row from a collective error at one step with no worker "
        "lost (a connection reset, an abort) before the run fails with CollectiveError: an "
        "error that recurs each time the step is redone (malformed data a rank sends) would "
        "otherwise recover for ever. A committed step starts the count over.",
    )
    max_failures: int | None = Field(
        default=None, ge=0,
        description="Worker losses the run tolerates in total; None means unlimited. "
        "Preemptions are counted apart (max_preemptions).",
    )
    max_preemptions: int | None = Field(
        default=None, ge=0,
        description="Workers the run lets go on notice (a SIGTERM, a Ray node drained, elastic "
        "drain) in total, whether they left at a step boundary or died before reaching one; "
        "None means unlimited. They never count against max_failures.",
    )
    startup_timeout: timedelta = Field(
        default=timedelta(minutes=3), gt=timedelta(0),
        description="Longest to wait for the initial workers to start.",
    )
    capacity_timeout: timedelta = Field(
        default=timedelta(minutes=5), gt=timedelta(0),
        description="Longest the run waits for capacity when fewer than min_workers are alive.",
    )
    controller_restarts: int = Field(
        default=3, ge=0,
        description="Times a detached run's controller is restarted after its process died; a "
        "restarted controller resumes from the newest checkpoint (a run without checkpoints "
        "fails instead of silently starting over).",
    )
    nonfinite: Literal["stop", "skip"] = Field(
        default="stop",
        description="A step whose loss or gradients are NaN or infinite on some rank: 'stop' "
        "fails the run with NonFiniteLossError(rank, step); 'skip' drops that step's update "
        "on every rank (its samples are consumed) and goes on.",
    )
    replace_lost_workers: bool = Field(
        default=True,
        description="Start a replacement for every lost worker (it joins at a step boundary); "
        "after a recovery, once the survivors' first step is done, so that its start does not "
        "take CPU from the recovery (at once when the survivors are below the minimum). "
        "False: the run goes on with the survivors and grows again only when scaled "
        "(elastic scale) - for capacity that is gone for good.",
    )
    straggler_factor: float | None = Field(
        default=None, gt=1,
        description="Opt-in straggler swap: a member whose measured compute throughput "
        "(samples per second) stays at most 1/straggler_factor of the median of the others' "
        "for straggler_window chunks in a row leaves at a step boundary, and a ready hot "
        "spare (scaling.spares) takes its place. Without a ready spare nothing happens (the "
        "rebalancer already gives it a smaller share). Not counted as a preemption.",
    )
    straggler_window: int = Field(
        default=4, ge=1,
        description="Chunks in a row a member must be slow to be swapped (straggler_factor).",
    )
    hang_timeout: timedelta = Field(
        default=timedelta(minutes=5), gt=timedelta(0),
        description="A worker that stays this long in one phase of a step (or on one evaluation "
        "batch) while no worker answers is treated as hung and killed, unless it is waiting in a "
        "collective. A long chunk or evaluation that keeps moving is never killed.",
    )


ChaosAction = Literal["kill", "hang", "raise", "slow", "oom", "preempt"]
ChaosPhase = Literal["data", "forward", "backward", "allreduce", "optimizer", "gather",
                     "checkpoint", "evaluate", "restore"]


class ChaosEvent(_Frozen):
    """A fault injected on purpose, for tests and demos."""

    step: int = Field(ge=0, description="Global step at which the fault fires.")
    rank: int = Field(ge=0, description="Rank (in the generation current at that step) that fails.")
    action: ChaosAction = Field(
        description="'kill' (SIGKILL the worker), 'hang' (sleep forever), 'raise' (InjectedFault "
        "from user code), 'oom' (torch.OutOfMemoryError from user code), 'slow' (the worker's "
        "data, forward and backward take `factor` times as long, for `steps` steps), "
        "'preempt' (SIGTERM to the worker's own process, as a scheduler's notice)."
    )
    phase: ChaosPhase = Field(default="forward", description="Where in the step the fault fires "
                              "(ignored by 'slow', which stretches the whole compute part). "
                              "'checkpoint': a 'kill' during the first checkpoint write at or "
                              "after `step`, once a part is on disk and before the manifest "
                              "(rank 0 writes checkpoints); a 'hang' there blocks that write "
                              "for good, as storage that stops answering. 'gather': with "
                              "sharding.stage 1 or 2, after the optimizer stepped this rank's "
                              "parts, before the parameters are gathered. 'evaluate': in the evaluation at "
                              "committed step `step` (if one runs there), before the rank reads "
                              "its slice; 'raise' there is an error of eval_step. 'restore': "
                              "'oom' only, as the rank takes the newest state in the first "
                              "generation that forms at committed step `step` or later.")
    factor: float = Field(default=2.0, gt=1, description="Slow-down factor for action 'slow'.")
    steps: int | None = Field(
        default=1, ge=1,
        description="Steps a 'slow' fault lasts, on the worker it hit (None: the rest of its life).",
    )

    @model_validator(mode="after")
    def _raise_only_in_user_code(self) -> ChaosEvent:
        # 'raise' and 'oom' stand for errors in user code; in the allreduce or optimizer phase
        # they would escape the step's error vote and look like a bug of ours.
        user_code = ("data", "forward", "backward") + (("evaluate",) if self.action == "raise" else ())
        if self.phase == "restore" and self.action != "oom":
            raise ValueError(f"chaos phase 'restore' takes action 'oom' only, not {self.action!r}")
        forming = ("restore",) if self.action == "oom" else ()  # also as a generation forms
        if self.action in ("raise", "oom") and self.phase not in user_code + forming:
            raise ValueError(
                f"chaos action {self.action!r} fires in user code only; use phase "
                f"{', '.join(user_code)}"
                + (" (or 'restore', as a generation forms)" if forming else "")
                + f", not {self.phase!r}"
            )
        if self.phase == "evaluate" and self.action == "slow":
            raise ValueError("chaos phase 'evaluate' takes action 'kill', 'hang' or 'raise'; "
                             "'slow' stretches training steps (leave its phase at the default)")
        if self.phase == "checkpoint" and (self.action not in ("kill", "hang") or self.rank != 0):
            raise ValueError(
                "chaos phase 'checkpoint' takes action 'kill' or 'hang' on rank 0 (the rank that "
                f"writes checkpoints), not {self.action!r} on rank {self.rank}"
            )
        return self


class ShardingConfig(_Frozen):
    """How the optimizer state is spread over the workers (docs/training.md#sharded-optimizer-state)."""

    stage: Literal[0, 1, 2] = Field(
        default=0,
        description="0: every worker holds the whole optimizer state. 1: each worker holds the "
        "optimizer state of the parameters it owns (whole tensors, each owned by `replicas` "
        "workers) and steps only those; the updated parameters are gathered after each step. "
        "2: as 1, and each worker keeps the summed gradients of the parameters it owns only "
        "(gradients reduced in buckets during the backward pass).",
    )
    replicas: int = Field(
        default=2, ge=1,
        description="Workers that own each parameter's optimizer state (stages 1 and 2): any "
        "replicas - 1 of them may be lost and a survivor still holds it (else the run restores "
        "its newest checkpoint). When the run shrinks below it, every worker owns every part.",
    )
    max_state_bytes_per_element: int = Field(
        default=24, ge=8,
        description="The most optimizer state per parameter element a worker accepts from a "
        "peer before it allocates it, when it holds none to compare with (a fresh worker; "
        "otherwise twice what it holds per element): 24 covers Adam with amsgrad in float64. "
        "Raise it for optimizers with larger per-tensor state (Shampoo, SOAP preconditioners), "
        "which are otherwise refused when state moves to a fresh worker.",
    )


DEFAULT_CHECKPOINT_EVERY_S = 1800.0  # checkpoint.every_seconds when no interval is set


class CheckpointConfig(_Frozen):
    """Where and how often checkpoints are written; a run with the same path resumes."""

    path: str = Field(description="Checkpoint root: a local directory (a relative one is made "
                      "absolute here) or an fsspec URL (s3://..., memory://...). A run pointed at "
                      "a path with checkpoints resumes from the newest valid one.")
    every_steps: int | None = Field(
        default=None, ge=1, description="Write a checkpoint every this many steps."
    )
    every_seconds: float | None = Field(
        default=None, gt=0, description="Write a checkpoint at the first chunk boundary after "
        "this many seconds have passed since the last one (with chunks_ahead, up to one chunk "
        "later: a boundary whose next chunk was handed out before the time came is passed over). "
        f"With neither interval given: {DEFAULT_CHECKPOINT_EVERY_S:.0f} (a run that loses every "
        "worker, or its driver, has a checkpoint to go back to, not only the final one); both "
        "given as None: only the final checkpoint."
    )
    keep_last: int = Field(default=3, ge=1, description="Valid checkpoints retention keeps.")
    timeout: timedelta | None = Field(
        default=timedelta(minutes=30), gt=timedelta(0),
        description="Longest the run waits for one checkpoint write (storing its files and the "
        "manifest, then pruning old ones; with async_write, serialising too) or load. A write "
        "past it is reported failed (checkpoint_failed) and the run and its end go on without "
        "it; it cannot be stopped, so no other write starts until it ends (those due meanwhile "
        "are skipped: checkpoint_busy). A load past it, or the check as the run starts that "
        "path can be written, fails the run (CheckpointTimeoutError). None: wait for ever "
        "(storage that stops answering then stops the run).",
    )
    async_write: bool = Field(
        default=True, description="Write in the background; the step pays only for a snapshot "
        "(with sharded optimizer state, and for waiting when the previous write is still "
        "going: such a checkpoint is not skipped unless that write is past checkpoint.timeout)."
    )
    sign: bool = Field(
        default=True,
        description="Sign every manifest (HMAC-SHA256) and load only checkpoints signed with "
        "the same key, so that write access to the checkpoint folder alone cannot plant a "
        "state. Off: checksums only (whoever can write the folder can replace a checkpoint).",
    )
    key_file: str | None = Field(
        default=None,
        description="The signing key's file (64 hex digits; created 0600 if missing; a relative "
        "path is made absolute here). Default: "
        "$ELASTIC_HOME/keys/checkpoint.key on the machine that starts the run; copy it "
        "privately to resume from these checkpoints elsewhere.",
    )
    monitor: str | None = Field(
        default=None,
        description="An evaluation metric (a name TrainJob.eval_step or evaluate returns) by which "
        "checkpoints written right after an evaluation are ranked; the best keep_best of them "
        "are kept besides the last keep_last.",
    )
    mode: Literal["min", "max"] = Field(
        default="min", description="With monitor: whether a lower or a higher value is better."
    )
    keep_best: int = Field(
        default=1, ge=0, description="With monitor: how many of the best checkpoints to keep."
    )
    allow_environment_change: bool = Field(
        default=False,
        description="With batch.exact: resume a checkpoint written under another torch build, "
        "thread count or hardware type, or without exact mode (the run is exact from there on "
        "but no longer reproduces the run that wrote it). Off: such a resume is refused.",
    )

    @model_validator(mode="before")
    @classmethod
    def _some_interval(cls, data: Any) -> Any:
        # Neither interval given: the default; both given as None: the final checkpoint only.
        if isinstance(data, dict) and "every_steps" not in data and "every_seconds" not in data:
            return {**data, "every_seconds": DEFAULT_CHECKPOINT_EVERY_S}
        return data

    @field_validator("path", "key_file")
    @classmethod
    def _absolute_local(cls, path: str | None) -> str | None:
        # A folder made absolute where the run starts (the controller and the workers run in
        # other processes, on a cluster in `ray start`'s directory); a URL as it is.
        return path if path is None or "://" in path else _absolute(path)

    @property
    def timeout_s(self) -> float | None:
        """`timeout` in seconds (None: no limit)."""
        return None if self.timeout is None else self.timeout.total_seconds()

    @model_validator(mode="after")
    def _check_monitor(self) -> CheckpointConfig:
        if self.monitor is not None and not self.monitor.strip():
            raise ValueError("checkpoint.monitor is empty; set it to a metric name that "
                             "TrainJob.eval_step (or evaluate) returns, or leave it unset")
        return self


class DataConfig(_Frozen):
    """How a worker reads its samples."""

    loader_workers: int = Field(
        default=0, ge=0,
        description="Loader processes per worker that read and collate the next steps' "
        "micro-batches in the background (like DataLoader's num_workers). 0: the worker reads "
        "each micro-batch itself when its step needs it.",
    )
    prefetch_steps: int = Field(
        default=2, ge=1,
        description="With loader processes: how many steps beyond the current one are read "
        "ahead (each step's micro-batches of this worker). Batches read ahead for a plan that "
        "changed (failure, resize, rebalancing) are dropped, never trained on.",
    )
    pin_memory: bool = Field(
        default=False,
        description="With loader processes (data.loader_workers): copy the batches they read "
        "into pinned (page-locked) host memory, on a background thread as each arrives, from "
        "where they are copied to the GPU asynchronously (non_blocking); the batches read "
        "ahead are held there until taken. Without loader processes the worker pins each batch "
        "as it reads it (as DataLoader with num_workers=0). Needs scaling.use_gpu.",
    )
    start_method: Literal["spawn", "forkserver"] = Field(
        default="spawn",
        description="How loader processes start: 'spawn' (a fresh interpreter each) or "
        "'forkserver'. Never 'fork': a worker has communication threads running.",
    )


class TrainingConfig(_Frozen):
    """What happens around the forward pass and between the summed gradients and the update:
    precision, clipping and how the learning-rate scheduler steps."""

    precision: Literal["32", "bf16-mixed", "fp16-mixed"] = Field(
        default="32",
        description="'32': float32 throughout. 'bf16-mixed' / 'fp16-mixed': forward and loss "
        "under autocast to bfloat16 / float16, parameters and gradients stay float32; "
        "'fp16-mixed' scales the loss (a gradient scaler whose scale is committed state), skips "
        "on every rank a step whose gradients overflow and shrinks the scale, as "
        "torch.amp.GradScaler does.",
    )
    init_scale: float = Field(
        default=2.0**16, gt=0, description="'fp16-mixed': the gradient scaler's first scale."
    )
    growth_interval: int = Field(
        default=2000, ge=1,
        description="'fp16-mixed': the scale doubles after this many steps without overflow "
        "(and halves at each overflow).",
    )
    clip_grad_norm: float | None = Field(
        default=None, gt=0,
        description="Clip the summed gradients to this global 2-norm (after the allreduce, the "
        "same on every rank); the norm before clipping goes to metrics.jsonl as grad_norm.",
    )
    clip_grad_value: float | None = Field(
        default=None, gt=0,
        description="Clip every summed gradient element to [-v, v] (after the allreduce).",
    )
    scheduler_interval: Literal["step", "epoch", "evaluation"] = Field(
        default="step",
        description="When TrainJob.lr_scheduler steps: after every committed optimizer step, "
        "once when an epoch's last step is committed, or once after each evaluation of "
        "TrainJob.eval_dataset (FitConfig.evaluation says when).",
    )
    scheduler_monitor: str | None = Field(
        default=None,
        description="For a metric-driven scheduler (ReduceLROnPlateau): the value passed to "
        "scheduler.step(value): 'loss' or a metric TrainJob.loss returns; with "
        "scheduler_interval 'epoch', its mean over the epoch's steps; with 'evaluation', "
        "'eval/<name>', a metric TrainJob.eval_step returns. None: scheduler.step().",
    )

    @model_validator(mode="after")
    def _check_monitor(self) -> TrainingConfig:
        monitor = self.scheduler_monitor
        on_eval = monitor is not None and monitor.startswith("eval/")
        if on_eval and self.scheduler_interval != "evaluation":
            raise ValueError(f"training.scheduler_monitor {monitor!r} is an evaluation metric: "
                             "set training.scheduler_interval='evaluation' (the scheduler then "
                             "steps after each evaluation)")
        if self.scheduler_interval == "evaluation" and monitor is not None and not on_eval:
            raise ValueError(f"training.scheduler_interval 'evaluation' steps the scheduler on "
                             f"an evaluation metric: name it 'eval/<name>' in "
                             f"training.scheduler_monitor (not {monitor!r})")
        if on_eval and not monitor[len("eval/"):]:
            raise ValueError("training.scheduler_monitor 'eval/' names no metric: use "
                             "'eval/<name>', a metric TrainJob.eval_step returns")
        return self


class EvaluationConfig(_Frozen):
    """When the job's evaluation data set is evaluated (TrainJob.eval_dataset and eval_step)."""

    every_steps: int | None = Field(
        default=None, ge=1, description="Evaluate every this many committed steps."
    )
    every_epochs: int | None = Field(
        default=None, ge=1,
        description="Evaluate after every this many epochs (after epochs E, 2E, ... of the "
        "run). Default: 1 when every_steps is not set either.",
    )
    at_end: bool = Field(default=True, description="Evaluate once more when the run ends.")
    batch_size: int | None = Field(
        default=None, ge=1,
        description="Samples per evaluation forward pass on a worker. Default: "
        "batch.max_micro_batch, else batch.global_batch_size.",
    )

    @property
    def epoch_interval(self) -> int | None:
        """Epochs between evaluations (`every_epochs`, 1 when neither interval is set)."""
        if self.every_epochs is not None:
            return self.every_epochs
        return 1 if self.every_steps is None else None


def _absolute(path: str) -> str:
    """`path` made absolute where the configuration is built: the controller that opens it
    runs in another process, whose working directory may differ."""
    return os.path.abspath(os.path.expanduser(path))


class MLflowConfig(_Frozen):
    """Where an MLflow logger writes."""

    tracking_uri: str = Field(description="MLflow tracking URI: a directory (MLflow's file "
                              "store; a relative one is made absolute here), file:///..., or "
                              "a server's http(s) address.")
    experiment: str = Field(default="elastic", description="Experiment name (created if missing).")
    run_name: str | None = Field(
        default=None, pattern=r"^[^'\"\\]{1,250}$",
        description="MLflow run name (no quotes or backslashes). Default: the elastic run's "
        "name. The MLflow run is found again by this name (its tag `elastic.run`), so a run "
        "resumed under the same name continues the same MLflow run; a new run that starts at "
        "step 0 gets an MLflow run of its own."
    )

    @field_validator("tracking_uri")
    @classmethod
    def _absolute_folder(cls, uri: str) -> str:
        return uri if ":" in uri or uri == "databricks" else _absolute(uri)


class LoggingConfig(_Frozen):
    """Where committed steps and evaluations are logged besides metrics.jsonl, and how
    progress is shown (`elastic.loggers` says what each logger writes)."""

    tensorboard: str | None = Field(
        default=None, description="TensorBoard log directory, with the runs `train` and `eval` "
        "(needs the tensorboard package: pip install 'elastic[loggers]'). Relative: made "
        "absolute here."
    )
    csv: str | None = Field(
        default=None, description="CSV file of the committed steps' metrics and the "
        "evaluations, one row each. Relative: made absolute here."
    )
    mlflow: MLflowConfig | None = Field(
        default=None, description="MLflow tracking (needs mlflow-skinny: pip install "
        "'elastic[loggers]')."
    )
    queue_points: int = Field(
        default=10_000, ge=1,
        description="Points (a committed step's values, or an evaluation's) each logger may "
        "have waiting: loggers write on their own threads, so a tracking server that does not "
        "answer never holds up training; past this many waiting, new points are dropped "
        "(`logger_behind`, and `logger_dropped` with the count at the run's end).",
    )
    flush_timeout: timedelta = Field(
        default=timedelta(minutes=1), gt=timedelta(0),
        description="How long the run's end waits for each logger to write the points it "
        "still has waiting; past it, the logger is reported failed and those points are lost "
        "(metrics.jsonl has them all).",
    )
    result_metrics: int | None = Field(
        default=100_000, ge=1,
        description="Committed steps whose metrics records `FitResult.metrics` holds, the "
        "newest (None: every one). The controller keeps them in memory for the run's life, "
        "about 2 KB a step at 64 workers; metrics.jsonl holds every step whatever this is.",
    )
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        default="auto",
        description="Progress of `elastic run` and `elastic.fit`: 'bar' (a rich progress bar: "
        "steps, epoch, loss, samples/s, world size, last event), 'lines' (plain lines), 'off'. "
        "'auto': a bar when stdout is a terminal; otherwise `elastic run` prints lines and "
        "`elastic.fit` nothing.",
    )

    @field_validator("tensorboard", "csv")
    @classmethod
    def _absolute_path(cls, path: str | None) -> str | None:
        return None if path is None else _absolute(path)


class FitConfig(_Frozen):
    """Everything `elastic.fit` needs besides the job itself."""

    scaling: ScalingConfig = Field(description="Workers and their resources.")
    batch: BatchConfig = Field(description="Global batch and micro-batch cap.")
    epochs: int | None = Field(
        default=None, ge=1, description="Train this many epochs (passes over the data set)."
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many optimizer steps (whichever of "
        "epochs and max_steps comes first)."
    )
    seed: int = Field(default=0, description="Seeds the model initialisation and the sample order.")
    collective: CollectiveConfig = Field(
        default_factory=CollectiveConfig, description="Backend, algorithm and timeouts."
    )
    failure: FailureConfig = Field(default_factory=FailureConfig, description="Failure handling.")
    name: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Run name (letters, digits, _ . -); other processes find the run by it. "
        "Default: generated.",
    )
    run_dir: str | None = Field(
        default=None,
        description="Directory for events.jsonl, metrics.jsonl and the ledger. Default: runs/NAME "
        "(in the driver of a `ray job submit` job with a working directory, Ray's temporary copy: "
        "there $ELASTIC_HOME/run-dirs/NAME).",
    )
    steps_per_chunk: int = Field(
        default=8, ge=1,
        description="Steps a worker runs per call from the controller (the unit of its reports); "
        "stop and a scale down end the chunk out after the step in flight on every rank, a "
        "scale up applies at the next chunk boundary (see chunks_ahead).",
    )
    chunks_ahead: bool = Field(
        default=True,
        description="Hand the next chunk out while one runs when the boundary between them has "
        "nothing to do (no checkpoint, evaluation, epoch's end, micro-batch trial, recovery, "
        "worker joining, stop or shrink), so that workers do not wait for the controller to "
        "plan it. False: every chunk is planned and handed out after the one before ended.",
    )
    ledger: bool = Field(
        default=False,
        description="Record the data set indices every committed step consumed (ledger.jsonl).",
    )
    chaos: tuple[ChaosEvent, ...] = Field(default=(), description="Faults to inject.")
    checkpoint: CheckpointConfig | None = Field(
        default=None, description="Checkpoints (none by default: peer restore only)."
    )
    sharding: ShardingConfig = Field(
        default_factory=ShardingConfig, description="Optimizer state sharded over the workers "
        "(stage 1; stage 2 the summed gradients too) or held whole by each (stage 0, the default)."
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Background loading (loader processes, "
        "prefetch, pinned memory)."
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description="Precision, gradient clipping and how the "
        "learning-rate scheduler steps."
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig, description="When TrainJob.eval_dataset is evaluated."
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Loggers (TensorBoard, CSV, MLflow) and progress."
    )

    @classmethod
    def for_job(cls, job: Any, **fields: Any) -> FitConfig:
        """A FitConfig of `fields` with what `job.settings` implies filled in where `fields`
        leave it: a Lightning module's `max_epochs`, a `TrainingArguments`' global batch and
        epochs (`elastic.integrations`). `FitConfig.for_job(job, scaling=ScalingConfig(
        num_workers=4))` is then a whole configuration.

        Raises:
            ConfigError: `fields` set one of the job's settings to another value.
        """
        tree = {name: value.model_dump(exclude_unset=True) if isinstance(value, BaseModel)
                else value for name, value in fields.items()}
        for dotted, value in job.settings.items():
            _fill(tree, dotted, value)
        return with_job_settings(cls.model_validate(tree), job.settings, job.source)

    @model_validator(mode="after")
    def _check(self) -> FitConfig:
        if self.collective.backend == "auto":  # decided here once, before the checks below
            chosen = choose_backend(self.scaling.use_gpu, self.scaling.gpus_per_worker,
                                    self.scaling.use_gpu and nccl_installed(), self.batch.exact)
            object.__setattr__(self, "collective",
                               self.collective.model_copy(update={"backend": chosen}))
        if self.collective.overlap is None and self.scaling.use_gpu:  # on for GPU workers
            object.__setattr__(self, "collective",
                               self.collective.model_copy(update={"overlap": True}))
        if self.name in (".", ".."):
            raise ValueError(f"name {self.name!r} is not a run name: use letters, digits, _ . -")
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs or max_steps (or both) so that the run has an end")
        batch = self.batch
        if batch.policy == "scale_with_workers" and batch.global_batch_size % self.scaling.num_workers:
            raise ValueError(
                f"batch.policy 'scale_with_workers' needs batch.global_batch_size "
                f"({batch.global_batch_size}) divisible by scaling.num_workers "
                f"({self.scaling.num_workers}): it is the per-worker batch times the workers"
            )
        if batch.policy == "fixed" and (batch.warmup_steps or batch.lr_scaling != "linear"):
            raise ValueError(
                "batch.lr_scaling and batch.warmup_steps apply only with batch.policy "
                "'scale_with_workers'; the 'fixed' policy never changes the learning rate"
            )
        if batch.group_size is not None:
            per = (batch.global_batch_size // self.scaling.num_workers
                   if batch.policy == "scale_with_workers" else batch.global_batch_size)
            if per % batch.group_size:
                what = ("the per-worker batch" if batch.policy == "scale_with_workers"
                        else "batch.global_batch_size")
                raise ValueError(
                    f"batch.group_size ({batch.group_size}) must divide {what} ({per}): the "
                    "global batch is a whole number of groups")
            if batch.groups != "off" and batch.max_micro_batch is not None \
                    and batch.max_micro_batch < batch.group_size:
                raise ValueError(
                    f"batch.max_micro_batch ({batch.max_micro_batch}) is below batch.group_size "
                    f"({batch.group_size}): a forward runs one whole group; lower "
                    "batch.group_size (it changes the math) or raise batch.max_micro_batch")
        if batch.exact and batch.groups == "off":
            raise ValueError("batch.exact sums whole groups; it cannot run with batch.groups "
                             "'off': set batch.groups to 'auto' or 'on'")
        if batch.exact and batch.policy != "fixed":
            raise ValueError("batch.exact reproduces one global batch; it needs batch.policy "
                             "'fixed' (with 'scale_with_workers' the batch follows the world size)")
        scaling = self.scaling
        sharding = self.sharding
        if not sharding.stage and any(e.phase == "gather" for e in self.chaos):
            raise ValueError("chaos phase 'gather' fires when the parameters are gathered after "
                             "a sharded optimizer step; set sharding.stage=1 (or 2) or pick another phase")
        if sharding.stage == 2 and batch.exact:
            raise ValueError("sharding.stage 2 keeps each worker's share of the summed "
                             "gradients, but batch.exact sums every gradient in one integer "
                             "buffer; set sharding.stage=1 (exact mode shards the optimizer "
                             "state) or batch.exact=False")
        if sharding.stage == 2 and self.collective.overlap is False:
            raise ValueError("sharding.stage 2 sums the gradients in buckets while the "
                             "backward pass runs, keeping each worker's share; "
                             "collective.overlap=False asks for one buffer after it: set "
                             "collective.overlap=None (or True), or sharding.stage=1")
        if sharding.stage == 2 and scaling.use_gpu and self.collective.backend != "nccl":
            raise ValueError("sharding.stage 2 keeps each worker's share of the GPU gradients "
                             "over NCCL; GPU workers on backend 'gloo' stage every gradient "
                             "in host memory to sum it there, which saves nothing: set "
                             "collective.backend='nccl' or sharding.stage=1")
        if sharding.stage and sharding.replicas > scaling.num_workers:
            raise ValueError(
                f"sharding.replicas ({sharding.replicas}) exceeds scaling.num_workers "
                f"({scaling.num_workers}): each parameter's optimizer state is owned by that "
                "many workers; lower sharding.replicas or start more workers")
        if scaling.use_gpu and self.collective.backend == "nccl" and scaling.gpus_per_worker < 1:
            raise ValueError(
                f"scaling.gpus_per_worker {scaling.gpus_per_worker} puts several workers on one "
                "GPU, where NCCL refuses two ranks; set collective.backend='gloo' (gradients "
                "reduced over host memory) or scaling.gpus_per_worker=1")
        if scaling.gpus_per_worker != 1 and not scaling.use_gpu:
            raise ValueError("scaling.gpus_per_worker applies to GPU workers; set "
                             "scaling.use_gpu=True or leave gpus_per_worker at 1")
        if batch.exact and self.collective.backend == "nccl":
            raise ValueError("batch.exact sums its integers on the host plane; it cannot run "
                             "with collective.backend='nccl': set it to 'gloo' (or 'auto', "
                             "which picks 'gloo' with exact; GPU workers then stage in host "
                             "memory), or batch.exact=False")
        if self.data.pin_memory and not self.scaling.use_gpu:
            raise ValueError("data.pin_memory pins host memory for copies to a GPU; it needs "
                             "scaling.use_gpu=True (set data.pin_memory=False on CPU workers)")
        training = self.training
        if training.clip_grad_norm is not None and training.clip_grad_value is not None:
            raise ValueError("set one of training.clip_grad_norm and training.clip_grad_value")
        if batch.exact and training.precision != "32":
            raise ValueError("batch.exact sums float32 gradients; it cannot run with "
                             f"training.precision {training.precision!r} (set it to '32')")
        ckpt = self.checkpoint
        if ckpt is not None and ckpt.monitor is not None and ckpt.keep_best < 1:
            raise ValueError("checkpoint.monitor ranks checkpoints to keep the best; set "
                             "checkpoint.keep_best to 1 or more")
        if (self.collective.backend == "nccl" and not self.scaling.use_gpu
                and not self.collective.nccl_simulator):
            raise ValueError("collective.backend='nccl' needs scaling.use_gpu=True (NCCL moves "
                             "GPU memory only); use backend 'gloo' for CPU workers")
        return self

    @model_validator(mode="after")
    def _check_chaos_ranks(self) -> FitConfig:
        # A rank at or above the most workers the run may have never exists: the fault would
        # never fire. (A step past the run's end is not checked: the end depends on the data.)
        upper = self.scaling.upper
        never = [e for e in self.chaos if e.rank >= upper]
        if never:
            faults = ", ".join(f"rank {e.rank} at step {e.step}" for e in never)
            raise ValueError(
                f"chaos fault(s) on a rank that never exists ({faults}): the run has at most "
                f"{upper} workers (scaling.max_workers, default scaling.num_workers), ranks 0 to "
                f"{upper - 1}; use a chaos rank below {upper} or raise scaling.max_workers")
        return self


def _fill(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Puts `value` at `dotted` in a FitConfig's nested dict where it holds none (a section
    absent or set to None becomes one)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree.setdefault(leaf, value)


def with_job_settings(config: FitConfig, settings: Mapping[str, Any], source: str) -> FitConfig:
    """`config` with a job's `settings` (dotted FitConfig fields -> values, as a framework
    adapter derives them from the user's module: precision, clipping, how the scheduler
    steps) applied where `config` leaves them unset.

    Args:
        config: the run's configuration, as the user gave it.
        settings: `TrainJob.settings`.
        source: what the settings come from, for messages ("the Lightning module").

    Raises:
        ConfigError: `config` sets one of them to another value, or one names no field.
    """
    from elastic.errors import ConfigError

    if not settings:
        return config
    from pydantic import TypeAdapter, ValidationError

    data = config.model_dump(exclude_unset=True)
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        model: Any = config
        explicit = True
        for part in [*parents, leaf]:
            if model is None:  # a section left out (checkpoint=None): nothing set below it
                explicit = False
                break
            if not isinstance(model, BaseModel) or part not in type(model).model_fields:
                raise ConfigError(f"{source} sets {dotted!r}, which is not a FitConfig field")
            field = type(model).model_fields[part]
            explicit = explicit and part in model.model_fields_set
            model = getattr(model, part)
        if explicit:
            try:  # compared as the configuration holds it (30 and timedelta(seconds=30) agree)
                wanted = TypeAdapter(field.annotation).validate_python(value)
            except ValidationError:
                wanted = value
            if model != wanted:
                raise ConfigError(f"{source} implies {dotted}={value!r}, but the configuration "
                                  f"sets {dotted}={model!r}: leave {dotted} out of the "
                                  f"configuration, or change it where {source} is built")
            continue
        _fill(data, dotted, value)
    try:
        return FitConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'FitConfig'}: {err['msg']}"
                             for err in e.errors())
        raise ConfigError(f"the configuration with what {source} implies ({dict(settings)}) "
                          f"is invalid: {problems}") from None
