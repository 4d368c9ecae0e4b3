"""One local Ray cluster per test session (integration and fault tiers)."""

from __future__ import annotations

import contextlib
import tempfile

import pytest

from tests import zygote


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Workers forked from a process that has imported torch (tests/zygote.py): on two cores a
    # worker's imports cost 2-2.5 s of CPU, most of a short run's.
    servers = []
    warm = contextlib.nullcontext()
    if zygote.enabled():
        servers, paths = zygote.start(tempfile.mkdtemp(prefix="elastic-zygote-"))
        warm = zygote.workers_from(paths)
    # No PYTHONPATH for the workers: the test jobs travel by value (client.ship_job_code).
    # address="local": always a cluster of this session's own, even where the machine has another
    # Ray running or a stale /tmp/ray/ray_current_cluster (a killed Cluster leaves one; CI hit it).
    with warm:
        ray.init(address="local", num_cpus=4, namespace="elastic", include_dashboard=False,
                 log_to_driver=False)
    yield ray
    ray.shutdown()
    for server in servers:
        server.kill()
        server.wait()
