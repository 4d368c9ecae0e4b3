"""`make gpu-check`'s summary: one line per part of the check (its exit status, seconds and
what it measured, read from the files the part wrote into the check's folder), printed as a
table and written to summary.json there. Exits 1 when a part failed or a target was missed.

The check's folder (argv[1]) holds parts.txt ("NAME RC SECONDS" per part, in the order they
ran) and each part's results: tier.xml (JUnit, the GPU tier), gpu_throughput.json
(`elastic bench gpu`), step.json (`elastic bench step --device cuda`), data.json (`elastic
bench data`, on the machine's CPUs) and allreduce.json (`elastic bench allreduce --hosts 2`).
With `--rehearsal` (the check's rehearsal on a CPU, `GPU_CHECK_DEVICE=cpu`) the exit status says
only whether every part ran and wrote readable results: figures of tiny models on a CPU judge
no target. Standard library only: it runs on the GPU machine as it comes."""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from typing import Any

# The targets: elastic at one worker within 0.95x of the plain loop's throughput, a
# step with loader processes within 1.1x of max(compute, data / k).
THROUGHPUT_TARGET = 0.95
DATA_TARGET = 1.1


def _load(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    if name.endswith(".xml"):
        return ET.parse(path).getroot()
    with open(path) as f:
        return json.load(f)


def tier(root: ET.Element) -> tuple[str, bool]:
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "skipped", "failures", "errors")}
    ran = count["tests"] - count["skipped"]
    passed = ran - count["failures"] - count["errors"]
    return (f"{passed} passed, {count['failures'] + count['errors']} failed, "
            f"{count['skipped']} skipped", ran > 0 and passed == ran)


def throughput(data: dict) -> tuple[str, bool]:
    """Every elastic row against its model's plain loop; the target holds when each model
    measured has both a plain row and a 1-worker row at the target or above."""
    results = data["results"]
    plain = {r["model"]: r["per_s"] for r in results if r["runner"] == "plain"}
    models = {r["model"] for r in results}
    parts, ok = [], bool(models) and set(plain) == models
    for r in results:
        if r["runner"] == "plain" or r["model"] not in plain:
            continue
        ratio = r["per_s"] / plain[r["model"]]
        parts.append(f"{r['model']} {r['runner']} {ratio:.2f}x")
    for model, base in plain.items():
        one = [r["per_s"] / base for r in results
               if r["model"] == model and r["runner"] == "elastic-1"]
        ok = ok and bool(one) and one[0] >= THROUGHPUT_TARGET
    if data.get("device") == "cpu" or data.get("size", "full") != "full":
        # A rehearsal's figures (left in the folder, say, by an earlier run): no target holds.
        return "; ".join(parts) + " of plain: a rehearsal's figures (tiny models, a CPU)", False
    return "; ".join(parts) + f" of plain (target {THROUGHPUT_TARGET}x at 1 worker)", ok


def step(data: dict) -> tuple[str, bool]:
    rows = [r for r in data["rows"] if r["runner"] != "plain PyTorch"]
    beyond = sorted({r["beyond_plain"] for r in rows})
    text = ", ".join(f"{r['depth']} blocks {r['vs_plain']:.2f}x" for r in rows)
    return (f"elastic at 1 worker {text} of plain; operations beyond plain "
            f"{'/'.join(str(b) for b in beyond)}" + (" (on a CPU)" if data.get("device") == "cpu"
                                                     else ""),
            len(beyond) == 1 and data.get("device") != "cpu")


def loaders(data: dict) -> tuple[str, bool]:
    ratio = data["bound_ratio"]
    return (f"step with loaders {ratio:.2f}x of max(compute, data/k) (target {DATA_TARGET}x), "
            f"{data['ddp_ratio']:.2f}x of DDP's", ratio <= DATA_TARGET)


def allreduce(data: dict) -> tuple[str, bool]:
    records = data["records"]
    largest = max(r["size_bytes"] for r in records)
    best = max((r for r in records if r["size_bytes"] == largest), key=lambda r: r["busbw_gbps"])
    return (f"{data['world_size']} ranks as {data['hosts']} hosts: best at {largest >> 20} MB "
            f"{best['algorithm']} {best['busbw_gbps']:.2f} GB/s busbw; "
            f"{'all correct' if all(r['correct'] for r in records) else 'WRONG SUMS'}",
            all(r["correct"] for r in records))


READERS = {"tier": ("tier.xml", tier), "throughput": ("gpu_throughput.json", throughput),
           "step": ("step.json", step), "data": ("data.json", loaders),
           "allreduce": ("allreduce.json", allreduce)}


def summarise(folder: str) -> dict:
    """Each part's line: status, seconds, what it measured and whether its targets held."""
    rows = []
    with open(os.path.join(folder, "parts.txt")) as f:
        for line in f:
            if not line.strip():
                continue
            name, rc, seconds = line.split()
            file, read = READERS.get(name, (None, None))
            try:
                data = _load(folder, file) if file else None
                if data is None:
                    result, target = "no results written", False
                else:
                    result, target = read(data)
            except (KeyError, TypeError, ValueError, ZeroDivisionError, ET.ParseError) as e:
                result, target = f"unreadable results ({type(e).__name__}: {e})", False
            rows.append({"part": name, "rc": int(rc), "seconds": int(seconds), "result": result,
                         "passed": int(rc) == 0, "target_met": target})
    env = os.path.join(folder, "env.txt")
    device = open(env).readline().strip() if os.path.exists(env) else "unknown"
    return {"device": device, "parts": rows,
            "passed": bool(rows) and all(r["passed"] for r in rows),
            "targets_met": bool(rows) and all(r["target_met"] for r in rows)}


def main(folder: str, rehearsal: bool = False) -> int:
    summary = summarise(folder)
    if rehearsal:  # ran and readable: no figure of the rehearsal is a measurement
        summary["rehearsal"] = True
        for r in summary["parts"]:
            r["passed"] = r["passed"] and not r["result"].startswith(("no results", "unreadable"))
        summary["passed"] = bool(summary["parts"]) and all(r["passed"] for r in summary["parts"])
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"gpu-check on {summary['device']}" + (" (a rehearsal: targets not judged)"
                                                 if rehearsal else ""))
    print(f"{'part':<11} {'rc':>3} {'s':>5}  {'target':<6}  result")
    for r in summary["parts"]:
        mark = ("-" if r["passed"] else "FAILED") if rehearsal else (
            "met" if r["target_met"] else "MISSED")
        print(f"{r['part']:<11} {r['rc']:>3} {r['seconds']:>5}  {mark:<6}  {r['result']}")
    if rehearsal:
        return 0 if summary["passed"] else 1
    return 0 if summary["passed"] and summary["targets_met"] else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (1, 2) or args[1:] not in ([], ["--rehearsal"]):
        sys.exit("usage: gpu_summary.py FOLDER [--rehearsal]")
    sys.exit(main(args[0], rehearsal=args[1:] == ["--rehearsal"]))
