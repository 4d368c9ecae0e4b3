"""Exits 1 (with a line saying so) when a pytest JUnit XML report shows no test that ran:
every test skipped, or none collected. `make test-gpu` and `make gpu-check` use it so that a
GPU tier that skipped everything (no CUDA device, a CPU build of torch) fails."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def ran(path: str) -> int:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    return sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)


if __name__ == "__main__":
    count = ran(sys.argv[1])
    print(f"{count} GPU test(s) ran")
    if count == 0:
        print("no GPU test ran: every one was skipped (see the skip reasons above)")
        sys.exit(1)
