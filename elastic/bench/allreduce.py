"""`elastic bench allreduce`: every algorithm at every size, ranks as separate processes.

Reports median time, algbw and busbw (nccl-tests definitions: algbw = S/t, busbw = algbw *
2(n-1)/n), the machine's ceilings (memcpy and loopback TCP bandwidth), an alpha-beta fit per
algorithm and the size from which ring beats tree. Every result is checked for correctness.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import torch

from elastic.collective import Communicator, Endpoint, RendezvousServer
from elastic.config import Algorithm, CollectiveConfig

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """Parses `4KB`, `16MB`, `1GB` or a plain byte count (binary units).

    Raises:
        ValueError: not a size.
    """
    t = text.strip().upper()
    for unit in ("GB", "MB", "KB", "B"):
        if t.endswith(unit) and t[: -len(unit)].strip().isdigit():
            return int(t[: -len(unit)]) * _UNITS[unit]
    if t.isdigit():
        return int(t)
    raise ValueError(f"size {text!r} is not of the form 4KB, 16MB or a byte count")


@dataclass(frozen=True)
class AllreduceRecord:
    """One (algorithm, size) measurement."""

    algorithm: str
    size_bytes: int
    world_size: int
    median_s: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool
    iterations: int
    transport: str  # "shm" (shared memory), "tcp" (gloo send/recv), "shm+tcp" (shared memory
    # inside each simulated host, gloo send/recv between them) or "gloo" (gloo's allreduce)


@dataclass(frozen=True)
class AlphaBetaFit:
    """`t = alpha + beta * bytes`, least squares over the measured sizes."""

    alpha_s: float
    beta_s_per_byte: float
    r_squared: float


@dataclass
class AllreduceBenchResult:
    """Everything `elastic bench allreduce` reports."""

    world_size: int
    records: list[AllreduceRecord]
    memcpy_gbps: float
    loopback_tcp_gbps: float
    fits: dict[str, AlphaBetaFit] = field(default_factory=dict)
    ring_beats_tree_from_bytes: int | None = None
    hosts: int = 1

    def memcpy_fraction(self, record: AllreduceRecord) -> float:
        """busbw as a fraction of the single-thread memcpy bandwidth of the same run."""
        return record.busbw_gbps / self.memcpy_gbps

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "hosts": self.hosts,
            "records": [asdict(r) | {"memcpy_fraction": self.memcpy_fraction(r)}
                        for r in self.records],
            "ceilings": {"memcpy_gbps": self.memcpy_gbps,
                         "loopback_tcp_gbps": self.loopback_tcp_gbps},
            "fits": {k: asdict(v) for k, v in self.fits.items()},
            "ring_beats_tree_from_bytes": self.ring_beats_tree_from_bytes,
        }


def _iterations(size_bytes: int) -> int:
    # About 256 MB moved per (algorithm, size), at least 5 and at most 50 timed iterations.
    return max(5, min(50, (256 << 20) // max(size_bytes, 1)))


def _transport_name(comm: Communicator, algorithm: str) -> str:
    if algorithm == "native":
        return "gloo"
    if comm.transport == "shared_memory+gloo":
        # Only the shared-memory algorithms use shared memory when the ranks span hosts.
        return "shm+tcp" if algorithm in ("auto", "direct", "hierarchical") else "tcp"
    return "shm" if comm.transport == "shared_memory" else "tcp"


# Algorithms that reduce a registered buffer where it lies (`Communicator.shared_buffers`).
_REGISTERING = ("auto", "direct", "hierarchical")
REGISTERED = " (registered)"  # appended to an algorithm's name for its registered-buffer rows


def _rank_main(rank: int, world_size: int, endpoint: str, secret: bytes, sizes: list[int],
               algorithms: list[str], config_json: str, registered: bool,
               conn: Connection) -> None:
    try:
        torch.set_num_threads(1)
        config = CollectiveConfig.model_validate_json(config_json)
        lend = max(sizes) + 64 if registered and any(a in _REGISTERING for a in algorithms) else 0
        comm = Communicator(rank, world_size, Endpoint.parse(endpoint), 0, config, secret=secret,
                            shared_bytes=lend)
        results = []
        for algorithm in algorithms:
            for size in sizes:
                numel = max(1, size // 4)
                results.append((algorithm, size, *_measure(comm, algorithm, size, torch.empty(numel)),
                                _transport_name(comm, algorithm)))
                lent = comm.shared_buffers({torch.float32: numel}) if lend else None
                if lent is not None and algorithm in _REGISTERING:
                    results.append((algorithm + REGISTERED, size,
                                    *_measure(comm, algorithm, size, lent[torch.float32]),
                                    _transport_name(comm, algorithm)))
        conn.send(("ok", results))
        comm.close()
    except BaseException as e:
        conn.send(("error", repr(e)))
    finally:
        conn.close()
        os._exit(0)


def _measure(comm: Communicator, algorithm: str, size: int,
             work: torch.Tensor) -> tuple[list[float], bool]:
    """Times allreduces of `work` (float32, overwritten); returns the times and whether the
    result was exact."""
    # Small integers: sums are exact in float32, so correctness is checked exactly.
    base = (torch.arange(work.numel(), dtype=torch.float32) % 97) + 1
    source = base * (comm.rank + 1)
    expected = base * (comm.world_size * (comm.world_size + 1) / 2)
    correct, times = True, []
    for i in range(1 + _iterations(size)):  # the first is a warm-up
        work.copy_(source)
        comm.barrier()
        start = time.perf_counter()
        comm.allreduce(work, "sum", algorithm)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
        if i:  # every timed result is checked (after its timer stopped)
            correct = correct and bool(torch.equal(work, expected))
    return times, correct


def measure_memcpy_gbps(size_bytes: int = 64 << 20) -> float:
    """Single-thread memory copy bandwidth (bytes copied per second), best of 5: the ranks
    copy on one thread each, so the ceiling does too (before, torch split the copy over every
    core: on 16 cores the ceiling was many threads')."""
    src = torch.ones(size_bytes // 4)
    dst = torch.empty_like(src)
    best = math.inf
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return size_bytes / best / 1e9


def measure_loopback_tcp_gbps(total_bytes: int = 256 << 20) -> float:
    """One TCP stream over loopback, sender and receiver in two threads."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    chunk = b"\0" * (1 << 20)

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(total_bytes // len(chunk)):
                s.sendall(chunk)

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    conn, _ = server.accept()
    buf = bytearray(1 << 20)
    received = 0
    with conn:
        while received < total_bytes:
            n = conn.recv_into(buf)
            if not n:
                break
            received += n
    elapsed = time.perf_counter() - start
    sender.join()
    server.close()
    return received / elapsed / 1e9


def fit_alpha_beta(points: list[tuple[int, float]]) -> AlphaBetaFit:
    """Least-squares line through (bytes, seconds)."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    if len(points) < 2:
        return AlphaBetaFit(alpha_s=ys[0] if ys else 0.0, beta_s_per_byte=0.0, r_squared=1.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    alpha = my - beta * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - alpha - beta * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return AlphaBetaFit(alpha_s=alpha, beta_s_per_byte=beta,
                        r_squared=1.0 - ss_res / ss_tot if ss_tot else 1.0)


def crossover(records: list[AllreduceRecord]) -> int | None:
    """Smallest measured size from which ring is faster than tree at every larger size."""
    ring = {r.size_bytes: r.median_s for r in records if r.algorithm == "ring"}
    tree = {r.size_bytes: r.median_s for r in records if r.algorithm == "tree"}
    sizes = sorted(set(ring) & set(tree))
    answer = None
    for size in reversed(sizes):
        if ring[size] < tree[size]:
            answer = size
        else:
            break
    return answer


def run_allreduce_bench(world_size: int, sizes: list[int], algorithms: list[Algorithm],
                        segment_bytes: int = CollectiveConfig().segment_bytes,
                        shared_memory: bool = True, hosts: int = 1,
                        chunk_bytes: int = CollectiveConfig().shm_chunk_bytes,
                        timeout_s: float = 1800.0, registered: bool = True) -> AllreduceBenchResult:
    """Runs the benchmark with `world_size` processes on this machine.

    With `shared_memory` (the default, as in training) the point-to-point algorithms move
    their bytes through shared memory; `native` is always gloo's own allreduce over TCP.
    With `hosts` > 1 the ranks act as that many hosts (`CollectiveConfig.simulated_hosts`):
    shared memory inside each, TCP between them. With `registered` (the default, as in
    training, where the flat gradient buffers are the communicator's registered buffers)
    'direct', 'hierarchical' and 'auto' are also measured on a registered buffer, in rows
    named "<algorithm> (registered)".

    Raises:
        ValueError: bad arguments.
        RuntimeError: a rank failed or did not report within `timeout_s`.
    """
    if world_size < 2:
        raise ValueError("--world-size must be at least 2")
    if not sizes:
        raise ValueError("--sizes needs at least one size")
    if segment_bytes < 1024:
        raise ValueError(f"--segment-bytes must be at least 1KB, got {segment_bytes}")
    if not 1 <= hosts <= world_size:
        raise ValueError(f"--hosts must be between 1 and --world-size ({world_size}), got {hosts}")
    config = CollectiveConfig(segment_bytes=segment_bytes, shared_memory=shared_memory,
                              shm_chunk_bytes=chunk_bytes,
                              simulated_hosts=hosts if hosts > 1 else None)
    memcpy = measure_memcpy_gbps()
    tcp = measure_loopback_tcp_gbps()
    server = RendezvousServer()
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, daemon=True,
                           args=(rank, world_size, str(server.endpoint), server.secret, sizes,
                                 list(algorithms), config.model_dump_json(),
                                 registered and shared_memory, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        per_rank = []
        for rank, pipe in enumerate(pipes):
            if not pipe.poll(timeout_s):
                raise RuntimeError(f"rank {rank} did not report within {timeout_s}s")
            status, payload = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {payload}")
            per_rank.append(payload)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.close()
    records = []
    for i, (algorithm, size, _, _, transport) in enumerate(per_rank[0]):
        # An iteration lasts until its slowest rank finishes.
        iteration_times = [max(rank_results[i][2][j] for rank_results in per_rank)
                           for j in range(len(per_rank[0][i][2]))]
        median = statistics.median(iteration_times)
        algbw = size / median / 1e9
        records.append(AllreduceRecord(
            algorithm=algorithm, size_bytes=size, world_size=world_size, median_s=median,
            algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world_size - 1) / world_size,
            correct=all(rank_results[i][3] for rank_results in per_rank),
            iterations=len(iteration_times), transport=transport,
        ))
    fits = {a: fit_alpha_beta([(r.size_bytes, r.median_s) for r in records if r.algorithm == a])
            for a in dict.fromkeys(r.algorithm for r in records)}
    return AllreduceBenchResult(world_size=world_size, records=records, memcpy_gbps=memcpy,
                                loopback_tcp_gbps=tcp, fits=fits, hosts=hosts,
                                ring_beats_tree_from_bytes=crossover(records))


def plot_allreduce(result: AllreduceBenchResult, path: str) -> None:
    """busbw against message size, one line per algorithm, with the ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm in dict.fromkeys(r.algorithm for r in result.records):
        rows = [r for r in result.records if r.algorithm == algorithm]
        ax.plot([r.size_bytes for r in rows], [r.busbw_gbps for r in rows], marker="o",
                label=algorithm)
    ax.axhline(result.loopback_tcp_gbps, linestyle="--", color="grey",
               label=f"loopback TCP {result.loopback_tcp_gbps:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"allreduce, {result.world_size} ranks on one machine")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
