"""One local Ray cluster per test session (integration and fault tiers)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # No PYTHONPATH for the workers: the test jobs travel by value (client.ship_job_code).
    # address="local": always a cluster of this session's own, even where the machine has another
    # Ray running or a stale /tmp/ray/ray_current_cluster (a killed Cluster leaves one; CI hit it).
    ray.init(address="local", num_cpus=4, namespace="elastic", include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
