"""`make gpu-check` and `make test-gpu` on a machine without a GPU: the check says it has
nothing to check, and a GPU tier whose tests were all skipped counts as a failure."""

from __future__ import annotations

import json
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


def _parts(folder, lines: str) -> None:
    (folder / "parts.txt").write_text(lines)
    (folder / "env.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.00\n16\n")


def _throughput(folder, elastic_rate: float, device: str = "H100", size: str = "full") -> None:
    (folder / "gpu_throughput.json").write_text(json.dumps({"device": device, "size": size,
                                                            "torch": "2.11",
        "results": [{"model": "resnet50", "runner": "plain", "per_s": 1000.0},
                    {"model": "resnet50", "runner": "elastic-1", "per_s": elastic_rate},
                    {"model": "resnet50", "runner": "elastic-4", "per_s": 300.0}]}))


def test_the_summary_reads_each_parts_results_and_fails_on_a_missed_target(tmp_path):
    _parts(tmp_path, "tier 0 118\nthroughput 0 240\nstep 0 12\ndata 124 150\n")
    (tmp_path / "tier.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="43" skipped="13" '
        'failures="0" errors="0"></testsuite></testsuites>')
    _throughput(tmp_path, 960.0)
    (tmp_path / "step.json").write_text(json.dumps({"rows": [
        {"runner": "plain PyTorch", "depth": 16, "vs_plain": 1.0, "beyond_plain": 0},
        {"runner": "elastic, 1 worker", "depth": 16, "vs_plain": 0.97, "beyond_plain": 47},
        {"runner": "plain PyTorch", "depth": 52, "vs_plain": 1.0, "beyond_plain": 0},
        {"runner": "elastic, 1 worker", "depth": 52, "vs_plain": 0.96, "beyond_plain": 47}]}))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["part"]: r for r in summary["parts"]}
    assert list(rows) == ["tier", "throughput", "step", "data"]  # in the order they ran
    assert rows["tier"]["result"] == "30 passed, 0 failed, 13 skipped"
    assert rows["tier"]["target_met"] and rows["throughput"]["target_met"]
    assert "resnet50 elastic-1 0.96x" in rows["throughput"]["result"]
    assert rows["step"]["target_met"] and rows["step"]["result"].endswith("beyond plain 47")
    # The data part timed out (124) before writing its results: the check fails.
    assert rows["data"] == {"part": "data", "rc": 124, "seconds": 150, "passed": False,
                            "result": "no results written", "target_met": False}
    assert summary["device"].startswith("NVIDIA H100") and not summary["passed"]
    assert done.returncode == 1 and "MISSED  no results written" in done.stdout


def test_a_throughput_below_its_target_fails_the_check_even_when_every_part_ran(tmp_path):
    _parts(tmp_path, "throughput 0 240\n")
    _throughput(tmp_path, 940.0)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] and not summary["targets_met"]
    assert done.returncode == 1 and "resnet50 elastic-1 0.94x" in done.stdout
    _throughput(tmp_path, 950.0)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_a_throughput_part_cut_short_or_a_torn_file_misses_its_target(tmp_path):
    _parts(tmp_path, "throughput 124 270\ntier 1 240\n")
    (tmp_path / "gpu_throughput.json").write_text(json.dumps({"device": "H100", "torch": "2.11",
        "results": [{"model": "resnet50", "runner": "plain", "per_s": 1000.0}]}))
    (tmp_path / "tier.xml").write_text('<?xml version="1.0"?><testsuites><testsu')
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    rows = {r["part"]: r for r in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert not rows["throughput"]["target_met"]  # no 1-worker row: not met
    assert rows["tier"]["result"].startswith("unreadable results (ParseError")
    assert done.returncode == 1


def test_a_rehearsal_passes_on_parts_that_ran_and_wrote_results_whatever_their_figures(tmp_path):
    """`--rehearsal` (the check on a CPU): a throughput far below its target is no failure; a
    part that failed or wrote nothing readable is."""
    summary_py = os.path.join(ROOT, "scripts", "gpu_summary.py")
    _parts(tmp_path, "throughput 0 40\n")
    _throughput(tmp_path, 100.0, device="cpu", size="tiny")  # 0.10x of plain: tiny, a CPU
    done = subprocess.run([sys.executable, summary_py, str(tmp_path), "--rehearsal"],
                          capture_output=True, text=True, timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, done.stdout
    assert summary["rehearsal"] and summary["passed"] and not summary["targets_met"]
    assert "a rehearsal: targets not judged" in done.stdout
    # Judged as a GPU run, the same folder fails on the target.
    done = subprocess.run([sys.executable, summary_py, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "MISSED" in done.stdout
    _parts(tmp_path, "throughput 0 40\nstep 0 3\n")  # step.json never written
    done = subprocess.run([sys.executable, summary_py, str(tmp_path), "--rehearsal"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "FAILED  no results written" in done.stdout
    _parts(tmp_path, "throughput 2 40\n")  # the part's command failed
    done = subprocess.run([sys.executable, summary_py, str(tmp_path), "--rehearsal"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    done = subprocess.run([sys.executable, summary_py, str(tmp_path), "--judge"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "usage" in done.stderr


def test_a_rehearsals_figures_left_in_the_folder_meet_no_target_of_a_gpu_run(tmp_path):
    """A GPU run that reruns some parts into a folder a rehearsal wrote: the rehearsal's
    throughput (however high) and step results are not taken for the GPU's."""
    _parts(tmp_path, "throughput 0 40\nstep 0 3\n")
    _throughput(tmp_path, 2000.0, device="cpu", size="tiny")  # 2x of plain
    (tmp_path / "step.json").write_text(json.dumps({"device": "cpu", "rows": [
        {"runner": "plain PyTorch", "depth": 2, "vs_plain": 1.0, "beyond_plain": 0},
        {"runner": "elastic, 1 worker", "depth": 2, "vs_plain": 0.9, "beyond_plain": 47}]}))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    rows = {r["part"]: r for r in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert not rows["throughput"]["target_met"] and "a rehearsal's figures" in done.stdout
    assert not rows["step"]["target_met"] and rows["step"]["result"].endswith("(on a CPU)")
    assert done.returncode == 1
