"""The session cluster's workers come from tests/zygote.py; what a worker sees must be what a
worker that Ray started the ordinary way sees (the other tests rely on it)."""

from __future__ import annotations

import os
import select

import pytest

from tests import zygote

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not zygote.enabled(), reason="ELASTIC_TEST_ZYGOTE=0")
def test_a_session_worker_is_forked_from_the_zygote_and_looks_like_a_plain_one(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=1)
    class Probe:
        def view(self):  # the class travels by value: no names of this module inside
            import os
            import sys

            import torch

            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = f.read().decode()
            return {"argv0": sys.argv[0], "path": sys.path, "threads": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(), "parent": parent,
                    "zygote_env": os.environ.get("ELASTIC_TEST_ZYGOTE")}

        def die(self):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    probe = Probe.remote()
    view = ray.get(probe.view.remote())
    assert "zygote.py" in view["parent"] and view["zygote_env"]
    # As `python default_worker.py ...` would: argv, the script's folder on the path (Ray puts
    # the driver's folders before it) and not the zygote's, torch's threads from the
    # OMP_NUM_THREADS Ray gives a one-CPU worker.
    assert view["argv0"].endswith(os.path.join("workers", "default_worker.py"))
    assert os.path.dirname(view["argv0"]) in view["path"]
    assert os.path.dirname(zygote.__file__) not in view["path"]
    assert view["omp"] == "1" and view["threads"] == 1
    # A worker killed by a signal is a dead actor to Ray, as a plain one is.
    probe.die.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(probe.view.remote())
    try:  # the worker's process has ended (or already been reaped)
        fd = os.pidfd_open(view["pid"])
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 30)[0]
    finally:
        os.close(fd)
