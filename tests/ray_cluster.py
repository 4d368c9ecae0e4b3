"""One local Ray cluster per test session (integration and fault tiers)."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Workers import the test jobs (tests.jobs) by reference.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    ray.init(num_cpus=4, namespace="elastic", include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
