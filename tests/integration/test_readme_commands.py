"""Every command of the README's command-line block runs, as a user would type it (a process
each, against a head of our own), at a tiny size, and gives what it promises.

The commands are read from the README itself, so the two cannot drift apart: a new line
there fails here until it has an entry below. Only values shrink; the flags are the README's
(plus, where the README leaves a size at its default, a smaller one from `EXTRA`).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import threading
from xml.etree import ElementTree

import pytest

import elastic
from tests.head import BIN, own_head, wait_until

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = "readme-run"  # the README's `--name demo` and NAME
# `elastic demo --workers 2 --epochs 2`: the float32 MLP's final weights with a kill against
# those of its uninterrupted run. Measured 1.8e-7 (56 steps, 2 workers then 1, on commit
# 51ecadf): the bound leaves a margin of about 50x for summation order.
DEMO_WEIGHT_BOUND = 1e-5

# (command, flag) -> the tiny value used instead of the README's.
TINY = {
    ("run", "--epochs"): "1",
    # Long enough to be listed, scaled, killed and stopped by the commands after it.
    ("start", "--epochs"): "100000",
    ("start", "--name"): NAME,
    ("bench allreduce", "--world-size"): "2",
    ("bench allreduce", "--sizes"): "4KB,64KB",
    ("bench recovery", "--workers"): "2",
    ("bench recovery", "--trials"): "1",
    ("bench checkpoint", "--size-mb"): "4",
    ("bench control", "--calls"): "1",
    ("bench adapt", "--workers"): "2",
    # A tiny model's step is mostly fixed costs: a slower rank stands out of a loaded
    # machine's noise (CI failed once with 2: no re-split at steps 16 or 32).
    ("bench adapt", "--slow-factor"): "4",
    ("bench overhead", "--steps"): "11",
    ("bench overhead", "--model"): "mlp",  # one model: the three differ in size only
    ("bench scaling", "--workers"): "1,2",
    ("bench scaling", "--batch-sizes"): "20",
    ("bench decisions", "--members"): "4,16",
    ("bench exact", "--models"): "mlp",
    ("bench exact", "--workers"): "1,2",
    ("bench data", "--loader-workers"): "1",
    ("bench drift", "--steps"): "3",
    ("bench step", "--depths"): "2,6",
    ("run images", "--max-steps"): "4",
    ("run images", "--loader-workers"): "1",
    ("run parquet_shards", "--epochs"): "1",
    ("run classifier", "--max-steps"): "6",
}
# Sizes the README leaves at their defaults, made small.
EXTRA = {
    # Re-splits come at chunk boundaries (every 16 steps): three chances, steps after each.
    "bench adapt": ["--steps", "56", "--batch", "64"],
    "bench overhead": ["--rounds", "1"],
    "bench scaling": ["--steps", "9"],
    "bench decisions": ["--steps", "16"],
    "bench exact": ["--steps", "8", "--batch", "64"],
    "demo": ["--workers", "2", "--epochs", "2"],
    "bench data": ["--steps", "9", "--batch", "16", "--image-size", "24", "--rounds", "1"],
    "bench step": ["--steps", "3"],
    "run lightning_mnist_like": ["--max-steps", "12"],  # its max_epochs=3 is 69 steps
    "run hf_text_classification": ["--max-steps", "8"],  # its 3 epochs are 96 steps
}


def readme_commands() -> list[str]:
    """The lines of the README's `## Command line` block, optional parts expanded and
    alternatives (`mlp|cnn`) split into one line each."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Command line\n+```\n(.*?)```", text, re.S).group(1)
    lines = []
    for line in block.strip().splitlines():
        line = re.sub(r"\[([^\]]*)\]", r"\1", line).strip()
        alternatives = re.search(r"(\S+\|\S+)", line)
        if alternatives:
            lines += [line.replace(alternatives.group(1), a) for a in alternatives.group(1).split("|")]
        else:
            lines.append(line)
    return lines


def _kind(argv: list[str]) -> str:
    if argv[1] == "run" and not argv[2].startswith("examples/spirals.py"):
        return f"run {pathlib.Path(argv[2].partition(':')[0]).stem}"  # the data examples
    return " ".join(argv[1:3]) if argv[1] == "bench" else argv[1]


def _tiny(line: str, out: pathlib.Path, gcs: str) -> list[str]:
    places = {"NAME": NAME, "N": "3", "R": "1", "HOST:PORT": gcs,
              "RUN_DIR": str(out / "demo" / "elastic"), "DIR": str(out / "report"),
              "trace.json": str(out / "trace.json")}
    argv = shlex.split(line)
    kind = _kind(argv)
    result = []
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i > 0 and argv[i - 1].startswith("--") else None
        if (kind, flag) in TINY:
            token = TINY[(kind, flag)]
        elif token in ("out.json", "out.png"):
            token = str(out / f"{kind.replace(' ', '-')}{pathlib.Path(token).suffix}")
        else:
            token = places.get(token, token)
        result.append(token)
    result += EXTRA.get(kind, [])
    if kind == "demo":
        result += ["--run-dir", str(out / "demo")]
    if kind == "run parquet_shards":
        result += ["--run-dir", str(out / "shards")]
    return result


def _flags(argv: list[str]) -> set[str]:
    return {t for t in argv if t.startswith("--")}


def test_every_readme_command_has_a_smoke_entry_that_keeps_its_flags(tmp_path):
    kinds = {"run", "start", "list", "logs", "status", "scale", "kill", "drain", "stop", "demo",
             "report",
             "bench allreduce", "bench recovery", "bench checkpoint", "bench control", "bench adapt",
             "bench overhead", "bench scaling", "bench decisions", "bench exact", "bench data",
             "bench drift", "bench step",
             "run images", "run parquet_shards", "run classifier", "run lightning_mnist_like",
             "run hf_text_classification"}
    for line in readme_commands():
        argv = shlex.split(line)
        assert argv[0] == "elastic" and _kind(argv) in kinds, f"README command without a smoke entry: {line}"
        tiny = _tiny(line, tmp_path, "127.0.0.1:1")
        assert _flags(argv) <= _flags(tiny), line
        assert _flags(tiny) - _flags(argv) <= set(EXTRA.get(_kind(argv), [])) | {"--run-dir"}, line
    assert {_kind(shlex.split(line)) for line in readme_commands()} == kinds


@pytest.fixture(scope="module")
def head():
    # Room for both streams of the test below: the lifecycle's run and a benchmark's at once.
    with own_head(dashboard=False, num_cpus=16) as info:
        yield info


def _png(path: pathlib.Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _status() -> dict | None:
    try:
        return elastic.status(NAME)
    except elastic.errors.RunNotFoundError:
        return None


def _check(kind: str, output: str, out: pathlib.Path) -> None:
    """What each command promises, beyond exit status 0."""
    written = out / f"{kind.replace(' ', '-')}.json"
    data = json.loads(written.read_text()) if kind.startswith("bench") else None
    match kind:
        case "run":
            assert "killed rank 1 on purpose at step 20" in output
            assert "A worker died or was killed" not in output  # Ray's note goes to ray.log
            assert re.search(r"recoveries\s*│\s*1", output)
        case "run images":
            assert re.search(r"steps\s*│\s*4\b", output), output[-2000:]
        case "run classifier":  # the paths of examples/classifier.toml, under the repository
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            assert re.search(r"steps\s*│\s*6\b", output), output[-2000:]
            boards = ROOT / "runs" / "classifier-tensorboard"
            train, held_out = EventAccumulator(str(boards / "train")), EventAccumulator(str(boards / "eval"))
            train.Reload()
            held_out.Reload()
            assert [e.step for e in train.Scalars("train/accuracy")] == list(range(6))
            assert [e.step for e in train.Scalars("grad_norm")] == list(range(6))  # clipping on
            assert [e.step for e in held_out.Scalars("eval/accuracy")] == [6]
        case "run lightning_mnist_like":  # the module's self.log and validation_step
            assert "killed rank 1 on purpose at step 10" in output
            assert re.search(r"steps\s*│\s*12\b", output), output[-2000:]
            assert re.search(r"val_accuracy\s*│\s*0\.\d+", output), output[-2000:]
        case "run hf_text_classification":  # the arguments' global batch, compute_metrics
            assert "killed rank 1 on purpose at step 6" in output
            assert re.search(r"steps\s*│\s*8\b", output) and re.search(r"samples\s*│\s*256\b", output)
            assert re.search(r"accuracy\s*│\s*[01]\.\d+", output), output[-2000:]
        case "run parquet_shards":  # 5132 rows in 8 shards, batch 64: 80 steps, each row once
            ledger = [json.loads(line) for line in open(out / "shards" / "ledger.jsonl")]
            assert [e["step"] for e in ledger] == list(range(80))
            seen = sorted(i for e in ledger for i in e["indices"])
            assert len(seen) == len(set(seen)) == 80 * 64 and seen[-1] < 5132
        case "start":
            assert f"started run {NAME}" in output
            wait_until(lambda: (s := _status()) and s["state"] == "running" and s["step"] > 0, limit=120)
        case "list":
            assert NAME in output and "running" in output
        case "logs":
            assert "generation" in output
        case "status":
            assert json.loads(output)["name"] == NAME
        case "scale":
            wait_until(lambda: (s := _status()) and s["world_size"] == 3 and s["state"] == "running",
                       limit=120)
        case "kill":
            wait_until(lambda: (s := _status()) and s["failures"] == 1 and s["state"] == "running",
                       limit=120)
        case "drain":
            assert "leave at the next step boundary" in output
            wait_until(lambda: (s := _status()) and s["preemptions"] == 1 and s["state"] == "running",
                       limit=120)
        case "stop":
            wait_until(lambda: (s := _status()) and s["state"] == "stopped", limit=120)
        case "bench allreduce":
            assert data["records"] and all(r["correct"] for r in data["records"])
            assert _png(out / "bench-allreduce.png")
        case "bench recovery":
            assert {s["stage"] for s in data["stages"]} >= {"detect_s", "total_s"}
        case "bench checkpoint":
            assert 0 < data["stall_fraction"]
        case "bench control":
            assert [c["command"] for c in data["commands"]] == ["status", "list", "scale", "kill", "stop"]
            assert all(c["calls"] == 1 for c in data["commands"])
        case "bench adapt":
            assert data["ratio"] > 0
        case "bench overhead":  # --steps 11: steps 8 to 10 measured, a chunk starts at 8
            assert data and len({r["model"] for r in data}) == len(data)
            for r in data:
                assert r["steps_per_chunk"] == 8 and r["chunk_boundaries"] == [8]
                assert r["step_ratio"] > 0 and r["wall_ratio"] > 0
                assert r["elastic"]["idle_at_boundary_s"] is not None
                assert r["ddp"]["idle_at_boundary_s"] is None and r["ddp"]["comm_s"] == 0
                assert all(run[k] > 0 for run in (r["elastic"], r["ddp"])
                           for k in ("step_s", "wall_s", "forward_backward_s", "optimizer_s"))
        case "bench decisions":
            assert [p["members"] for p in data] == [4, 16]
            assert all(p["steps"] == 16 and p["decision_ms_per_step"] > 0 for p in data)
        case "bench data":
            assert data["loader_workers"] == 1 and data["warmup"] == 3
            assert min(data["loaders_step_s"], data["no_loaders_step_s"], data["ddp_step_s"],
                       data["ddp_no_loaders_step_s"]) > 0
            assert data["bound_s"] == max(data["compute_s"], data["data_s"])
        case "bench drift":
            assert [p["steps"] for p in data["points"]] == [3] and data["workers"] == 2
            # Float32 summation order after a few steps: last bits, not lost samples.
            assert all(0 <= p["max_weight_difference"] < 1e-4 for p in data["points"])
        case "bench step":
            rows = data["rows"]
            assert [(r["depth"], r["runner"]) for r in rows] == [
                (d, runner) for d in (2, 6) for runner in ("plain PyTorch", "elastic, 1 worker")]
            # The step's own operations do not grow with the model's depth.
            assert rows[1]["beyond_plain"] == rows[3]["beyond_plain"] > 0
            assert all(r["ms_per_step"] > 0 for r in rows)
        case "bench exact":
            assert [(r["model"], r["workers"]) for r in data["rows"]] == [("mlp", 1), ("mlp", 2)]
            assert data["bit_identical"] == {"mlp": True}
            assert all(r["exact_bytes_per_step"] > r["default_bytes_per_step"] > 0
                       for r in data["rows"])
        case "bench scaling":
            assert len(data["points"]) == 2  # --workers 1,2 at one batch size
            assert _png(out / "bench-scaling.png")
        case "demo":
            assert "killed rank 1 on purpose at step 30" in output
            assert "uninterrupted" in output
            [difference] = re.findall(r"largest weight difference against the uninterrupted "
                                      r"run: (\S+)", output)
            assert float(difference) < DEMO_WEIGHT_BOUND
            assert "A worker died or was killed" not in output
        case "report":
            pngs = list((out / "report").glob("*.png"))
            assert pngs and all(_png(p) for p in pngs)
            assert json.loads((out / "trace.json").read_text())["traceEvents"]
        case _:
            raise AssertionError(f"no check for {kind}")


def _stream(kind: str) -> int:
    """Which of the two streams runs a command: the benchmarks, or the rest (the lifecycle of
    the run NAME, the demo then its report, the examples), each in the README's order."""
    return 1 if kind.startswith("bench") else 0


def _run_line(line: str, env: dict, out: pathlib.Path, gcs: str) -> None:
    argv = _tiny(line, out, gcs)
    kind = _kind(argv)
    if kind == "run classifier":  # its config file's paths: a fresh run, not a resume
        for name in ("classifier-checkpoints", "classifier-tensorboard"):
            shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
    done = subprocess.run([str(BIN / "elastic"), *argv[1:]], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{output[-3000:]}"
    _check(kind, output, out)


def test_the_two_streams_split_the_readme_commands_as_planned():
    kinds = [_kind(shlex.split(line)) for line in readme_commands()]
    benches = [k for k in kinds if _stream(k) == 1]
    assert benches and all(k.startswith("bench ") for k in benches)
    rest = [k for k in kinds if _stream(k) == 0]
    lifecycle = ["start", "list", "logs", "status", "scale", "kill", "drain", "stop"]
    assert [k for k in rest if k in lifecycle] == lifecycle  # in order, in one stream
    assert rest.index("demo") < rest.index("report")  # the report reads the demo's run


@pytest.mark.timeout(1200)
def test_every_readme_command_runs_and_gives_what_it_promises(head, tmp_path):
    # Two streams at once (the benchmarks, and the rest), each in the README's order: a
    # command's process spends much of its time starting and waiting, and the head has room
    # for both streams' workers.
    env = {**head["env"], "RAY_ADDRESS": head["gcs"], "COLUMNS": "200"}
    streams: list[list[str]] = [[], []]
    for line in readme_commands():
        streams[_stream(_kind(shlex.split(line)))].append(line)

    failed = threading.Event()  # a stream that failed stops the other at its next command

    def run(lines: list[str]) -> None:
        for line in lines:
            if failed.is_set():
                return
            try:
                _run_line(line, env, tmp_path, head["gcs"])
            except BaseException:
                failed.set()
                raise

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(run, lines) for lines in streams]
        try:
            for future in futures:
                future.result()
        except BaseException:  # a stream's failure, or this test's timeout: both stop
            failed.set()
            raise


@pytest.mark.timeout(1100)
def test_the_gpu_check_rehearses_every_part_on_the_cpu(head, tmp_path):
    """`GPU_CHECK_DEVICE=cpu GPU_CHECK_PROFILE=1 bash scripts/gpu_check.sh`: the parts' own
    command lines and the profile's, at a tiny size on CPU workers, so that a mistake in the
    check costs no GPU time: the tier is collected (each GPU test skipped here), the step,
    throughput and allreduce benches run and write what the summary reads, and the summary
    passes as a rehearsal. The data part is left out here (40 s): its command is the README's
    `elastic bench data` at the same size, which this module runs."""
    out = tmp_path / "check"
    env = {**head["env"], "RAY_ADDRESS": head["gcs"], "GPU_CHECK_DEVICE": "cpu",
           "GPU_CHECK_OUT": str(out), "PY": str(BIN / "python"), "GPU_CHECK_PROFILE": "1",
           "GPU_CHECK_PARTS": "tier,step,throughput,allreduce",
           # Each part's own limit, well inside this test's: a part that hangs fails by name.
           **{f"GPU_CHECK_{part}_S": "150" for part in
              ("TIER", "STEP", "BENCH", "DATA", "ALLREDUCE", "PROFILE")}}
    check = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = check.communicate(timeout=1000)
    finally:
        if check.poll() is None:  # the whole group: the parts' Python processes too
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
    assert check.returncode == 0, stdout[-4000:] + stderr[-2000:]
    assert "profile rc=0" in stdout, (out / "profile.log").read_text()[-3000:]
    profile = (out / "profile.txt").read_text()  # the replica's step beside a plain one
    assert re.search(r"^plain: [\d.]+ ms/step", profile, re.M)
    assert re.search(r"^replica alone \(one rank\): [\d.]+ ms/step", profile, re.M)
    assert re.search(r"^replica buckets at one rank: [\d.]+ ms/step", profile, re.M)
    parts = [line.split() for line in (out / "parts.txt").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in parts] == [
        (name, "0") for name in ("tier", "step", "throughput", "allreduce")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rehearsal"] and summary["passed"]
    [suite] = ElementTree.parse(out / "tier.xml").getroot()
    assert int(suite.get("tests")) == int(suite.get("skipped")) > 0  # each GPU test, skipped
    assert [(r["depth"], r["runner"]) for r in json.loads((out / "step.json").read_text())["rows"]] \
        == [(d, r) for d in (2, 4) for r in ("plain PyTorch", "elastic, 1 worker")]
    throughput = json.loads((out / "gpu_throughput.json").read_text())
    assert throughput["device"] == "cpu" and throughput["size"] == "tiny"
    # ResNet-50 where torchvision is installed (not with CPU torch 2.13 here), and GPT-2.
    models = ["resnet50", "gpt2"] if importlib.util.find_spec("torchvision") else ["gpt2"]
    assert [(r["model"], r["runner"]) for r in throughput["results"]] == [
        (m, runner) for m in models for runner in ("plain", "elastic-1", "elastic-2")]
    for r in throughput["results"]:
        assert r["per_s"] > 0 and r["steps"] == 3 and (r["phases"] is None) == (r["runner"] == "plain")
    allreduce = json.loads((out / "allreduce.json").read_text())
    assert allreduce["hosts"] == 2 and all(r["correct"] for r in allreduce["records"])
