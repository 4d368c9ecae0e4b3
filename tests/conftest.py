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


from tests.ray_cluster import ray_cluster  # noqa: E402,F401 - a session fixture for all tiers
