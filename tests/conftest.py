import os
import tempfile

import pytest
import torch

# The run index of every run the tests start goes to a folder of this session, never to the
# user's ~/.elastic (subprocesses and the Ray cluster inherit it).
os.environ["ELASTIC_HOME"] = tempfile.mkdtemp(prefix="elastic-home-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test(request):
    """A run a test left going (it failed half-way through a run of 10 million steps, say) is
    stopped when the test ends: it would train on in the session's cluster and take the two
    cores from every test after it (on a slow day, test_interrupt.py's tests then failed in
    the full suite and passed alone)."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import time
    import warnings

    import elastic
    from elastic.errors import ElasticError

    left = [r["name"] for r in elastic.runs(live_only=True)]
    for name in left:
        warnings.warn(f"{request.node.nodeid} left run {name!r} going; stopping it", stacklevel=1)
        try:
            elastic.stop(name)
        except ElasticError:
            continue  # it ended meanwhile
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        left = [r["name"] for r in elastic.runs(live_only=True) if r["name"] in left]
        if left:
            time.sleep(0.1)  # polls the runs' records until they have ended


from tests.ray_cluster import ray_cluster  # noqa: E402,F401 - a session fixture for all tiers
