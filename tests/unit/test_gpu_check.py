"""`make gpu-check` and `make test-gpu` on a machine without a GPU: the check says it has
nothing to check, and a GPU tier whose tests were all skipped counts as a failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from scripts.junit_ran import ran

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report(tmp_path, tests: int, skipped: int) -> str:
    path = tmp_path / "tier.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
                    f'skipped="{skipped}" failures="0" errors="0"></testsuite></testsuites>')
    return str(path)


def test_a_tier_that_skipped_every_test_fails(tmp_path):
    assert ran(_report(tmp_path, 43, 13)) == 30
    script = os.path.join(ROOT, "scripts", "junit_ran.py")
    done = subprocess.run([sys.executable, script, _report(tmp_path, 43, 43)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no GPU test ran" in done.stdout
    done = subprocess.run([sys.executable, script, _report(tmp_path, 43, 13)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("30 GPU test(s) ran")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_the_gpu_check_says_it_needs_cuda_here(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
                          env={**os.environ, "PY": sys.executable,
                               "GPU_CHECK_OUT": str(tmp_path / "out")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "sees no CUDA device here" in done.stdout
