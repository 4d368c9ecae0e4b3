"""The core never imports the framework adapters (or their frameworks): `elastic/integrations/`
is reached only by a user's `import elastic.integrations.lightning`."""

from __future__ import annotations

import pathlib
import re

ELASTIC = pathlib.Path(__file__).resolve().parents[2] / "elastic"
FRAMEWORKS = ("elastic.integrations", "lightning", "pytorch_lightning", "transformers", "accelerate")


def test_no_core_module_imports_an_adapter_or_its_framework():
    pattern = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(map(re.escape, FRAMEWORKS)) + r")\b",
                         re.M)
    offenders = {}
    for path in ELASTIC.rglob("*.py"):
        if "integrations" in path.relative_to(ELASTIC).parts:
            continue
        found = pattern.findall(path.read_text())
        if path.relative_to(ELASTIC).parts[0] == "bench":  # the GPT-2 bench builds its model
            found = [name for name in found if name != "transformers"]
        if found:
            offenders[str(path.relative_to(ELASTIC))] = found
    assert not offenders, f"core modules import adapters or their frameworks: {offenders}"
