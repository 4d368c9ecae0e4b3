"""Resolving `path/to/file.py:attr` or `package.module:attr` to a `TrainJob`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from elastic.errors import ConfigError
from elastic.job import TrainJob


def _same_file(found: str | None, path: str) -> bool:
    try:
        return found is not None and os.path.samefile(found, path)
    except OSError:  # the module's file moved or lies in an archive: not the target
        return False


def load_target(spec: str) -> TrainJob:
    """Imports `spec` and returns the `TrainJob` it names (or that the function it names
    returns).

    A file target's directory is put on `sys.path` (and on `PYTHONPATH` for the workers) so
    that its functions can be imported where they run.

    Raises:
        ConfigError: the target cannot be found or is not a TrainJob.
    """
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ConfigError(f"target {spec!r} must look like path/to/file.py:job or package.module:job")
    if module_part.endswith(".py"):
        path = os.path.abspath(module_part)
        if not os.path.exists(path):
            raise ConfigError(f"target file {module_part!r} does not exist")
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        existing = os.environ.get("PYTHONPATH", "")
        if directory not in existing.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (directory, existing) if p)
        module_name = os.path.splitext(os.path.basename(path))[0]
    else:
        path, module_name = None, module_part
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import target module {module_name!r}: {e}") from e
    found = getattr(module, "__file__", None)
    if path is not None and not _same_file(found, path):
        # A module of that name was imported already (the standard library's `statistics`,
        # a package's `cli`): the workers would import that one too.
        raise ConfigError(f"target file {module_part!r} is named like the module "
                          f"{module_name!r}, which is imported from {found or 'a built-in'}: "
                          "rename the file")
    try:
        obj = getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"target module {module_name!r} has no attribute {attr!r}") from e
    if callable(obj) and not isinstance(obj, TrainJob):
        try:
            obj = obj()
        except Exception as e:
            raise ConfigError(f"target {spec!r} raised while building the job: {e}") from e
    if not isinstance(obj, TrainJob):
        raise ConfigError(f"target {spec!r} is a {type(obj).__name__}, not an elastic.TrainJob")
    return obj
