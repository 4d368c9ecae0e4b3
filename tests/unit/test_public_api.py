"""The Python API a user reaches as `elastic.X`: every public function of `elastic.api` (the
docs name them as `elastic.fit`, `elastic.connect`, ...) is exported and listed in `__all__`."""

from __future__ import annotations

import inspect

import elastic
import elastic.api

INTERNAL = {"run_dir_of", "recorded_launch"}  # the CLI's helpers, not part of the API


def test_every_public_api_function_is_exported_from_the_package():
    public = {name for name, value in vars(elastic.api).items()
              if inspect.isfunction(value) and value.__module__ == "elastic.api"
              and not name.startswith("_")} - INTERNAL
    assert {"fit", "start", "connect", "status", "stop"} <= public
    missing = {name for name in public if getattr(elastic, name, None) is not getattr(elastic.api, name)}
    assert not missing, f"not exported from elastic: {sorted(missing)}"
    assert public <= set(elastic.__all__)
