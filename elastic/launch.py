"""What started a run, kept for `elastic resume`: the launch record in its run dir, and the
configuration a resume starts from.

`elastic run` and `elastic start` write `launch.json` into the run dir before the run starts:
the target (`path/to/file.py:job` or `package.module:job`), the SHA-256 of the target's file,
the working directory, and the `ELASTIC_HOME` whose signing key the checkpoints are signed
with. The configuration itself is in the run's `start` event (every run writes one), so a
run started from Python is resumed from it too, given its job again.

No Ray, no torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic.adapt.groups import default_group_size
from elastic.config import HOME_ENV, FitConfig, storage_root
from elastic.errors import ConfigError
from elastic.private import ensure_private_dir, write_private
from elastic.runlog import read_jsonl

LAUNCH_FILE = "launch.json"


@dataclass(frozen=True)
class Launch:
    """What started a run.

    Attributes:
        target: the CLI's target (None: started from Python with a `TrainJob`).
        target_sha256: the SHA-256 of the target's file (a module target: of its source file,
            when it has one).
        cwd: the working directory of the process that started it (a relative target is
            relative to it).
        elastic_home: that process's storage root (its signing key signs the checkpoints).
    """

    target: str | None
    target_sha256: str | None
    cwd: str
    elastic_home: str

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "target_sha256": self.target_sha256, "cwd": self.cwd,
                "elastic_home": self.elastic_home}


def target_file(target: str, cwd: str | None = None) -> str | None:
    """The file a target's code lives in: a file target's path, a module target's source
    file (None if it has none or cannot be found)."""
    module_part = target.rpartition(":")[0]
    if module_part.endswith(".py"):
        return os.path.abspath(os.path.join(cwd or os.getcwd(), module_part))
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_part)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def file_sha256(path: str | None) -> str | None:
    if path is None or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_launch(run_dir: str, target: str | None) -> Launch:
    """Records what starts the run in `run_dir` (created private if missing)."""
    launch = Launch(target=target,
                    target_sha256=file_sha256(target_file(target)) if target else None,
                    cwd=os.getcwd(), elastic_home=storage_root())
    ensure_private_dir(run_dir, "run_dir")
    write_private(os.path.join(run_dir, LAUNCH_FILE),
                  json.dumps(launch.to_json(), indent=1).encode())
    return launch


def update_launch(run_dir: str, launch: Launch, sha256: str | None) -> Launch:
    """Records that the run now trains its target's file as it is (a resume with --force)."""
    updated = Launch(target=launch.target, target_sha256=sha256, cwd=launch.cwd,
                     elastic_home=launch.elastic_home)
    write_private(os.path.join(run_dir, LAUNCH_FILE),
                  json.dumps(updated.to_json(), indent=1).encode())
    return updated


def read_launch(run_dir: str) -> Launch | None:
    """The launch record of the run in `run_dir` (None: started from Python, or by a version
    that wrote none)."""
    path = os.path.join(run_dir, LAUNCH_FILE)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    # It names code that `resume` imports and runs: only a file of this user's that no one
    # else could have written (in a run dir that is private too) is taken.
    ensure_private_dir(run_dir, "run_dir")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(f"refusing {path}: not a plain file of this user's that only it can "
                          "write (it names the code a resume runs)")
    try:
        with open(path) as f:
            return Launch(**json.load(f))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{os.path.join(run_dir, LAUNCH_FILE)} is not a launch record: {e}") from None


def started_config(run_dir: str, name: str, cwd: str | None = None) -> FitConfig:
    """The configuration of run `name`'s newest start in `run_dir`, from its `start` event;
    a relative checkpoint folder or key file (recorded by an older version, which kept them
    so) as seen from `cwd`, where the run started (else from here).

    Raises:
        ConfigError: the run dir has no `start` event of it (or none this version reads).
    """
    path = os.path.join(run_dir, "events.jsonl")
    starts = [e for e in read_jsonl(path) if e.get("event") == "start"
              and e.get("name") == name] if os.path.exists(path) else []
    if not starts:
        raise ConfigError(f"{path} has no start event of run {name!r}: its configuration is "
                          "unknown")
    recorded = starts[-1]["config"]
    checkpoint = recorded.get("checkpoint") if isinstance(recorded, dict) else None
    if cwd is not None and isinstance(checkpoint, dict):
        recorded = {**recorded, "checkpoint": {
            **checkpoint, **{k: _from(cwd, checkpoint[k]) for k in ("path", "key_file")
                             if isinstance(checkpoint.get(k), str)}}}
    try:
        return FitConfig.model_validate(recorded)
    except Exception as e:
        raise ConfigError(f"the configuration recorded in {path} does not load in this version "
                          f"of elastic: {str(e).splitlines()[0]}") from None


def resume_config(name: str, record: dict[str, Any], launch: Launch | None,
                  num_workers: int | None = None,
                  overrides: Mapping[str, Any] | None = None) -> FitConfig:
    """The configuration that resumes run `name` (its `record` in the run index): the one it
    started with, under the same name and run dir, without its chaos (a drill is not redone),
    with its checkpoint key found in the home that signed it, `num_workers` if given, and the
    dotted fields of `overrides` (`{"logging.progress": "lines"}`).

    Raises:
        ConfigError: the run is still live, or has no checkpoints.
    """
    state = record.get("state")
    if state == "finished":
        raise ConfigError(f"run {name!r} finished: there is nothing to resume")
    if state not in ("lost", "failed", "stopped"):
        raise ConfigError(f"run {name!r} is still {state}; only a lost, failed or stopped run "
                          f"is resumed (`elastic stop {name}` first)")
    config = started_config(record["run_dir"], name, launch.cwd if launch is not None else None)
    checkpoint = config.checkpoint
    if checkpoint is None:
        raise ConfigError(f"run {name!r} wrote no checkpoints (checkpoint.path was not set), so "
                          "there is nothing to resume from; start it again with --checkpoint DIR")
    tree = config.model_dump()
    tree.update(name=name, run_dir=record["run_dir"], chaos=())
    if launch is not None and checkpoint.key_file is None and checkpoint.sign \
            and launch.elastic_home != storage_root():  # the key of the home that signed
        tree["checkpoint"]["key_file"] = os.path.join(launch.elastic_home, "keys",
                                                      "checkpoint.key")
    if num_workers is not None and num_workers != config.scaling.num_workers:
        tree["scaling"].update(num_workers=num_workers,
                               max_workers=max(config.scaling.upper, num_workers),
                               min_workers=min(config.scaling.lower, num_workers))
        tree["batch"]["group_size"] = _same_math(name, config, num_workers)
    if overrides and "max_steps" in overrides and "epochs" not in overrides:
        tree["epochs"] = None  # to train longer: the run's epochs would end it first
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return FitConfig.model_validate(tree)
    except ValueError as e:  # pydantic's ValidationError: one line naming the setting
        errors = getattr(e, "errors", lambda: [])()
        first = errors[0] if errors else {"loc": (), "msg": str(e)}
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"run {name!r} cannot be resumed so: "
                          f"{where + ': ' if where else ''}"
                          f"{first['msg'].removeprefix('Value error, ')}") from None


def _same_math(name: str, config: FitConfig, num_workers: int) -> int | None:
    """`batch.group_size` for run `name` resumed at `num_workers`, so that its steps compute
    what they did: the G it ran with (by default G follows `scaling.num_workers`, and with
    BatchNorm or dropout G is part of the math).

    Raises:
        ConfigError: batch.policy 'scale_with_workers', whose global batch and learning rate
            are set relative to `scaling.num_workers`.
    """
    batch = config.batch
    if batch.policy == "scale_with_workers":
        raise ConfigError(
            f"run {name!r} uses batch.policy 'scale_with_workers', whose global batch and "
            f"learning rate are set relative to scaling.num_workers ({config.scaling.num_workers}):"
            f" resuming it at {num_workers} would change both. Resume it without a new number "
            "of workers (it starts with those the cluster can place, at least "
            "scaling.min_workers) and scale it once it runs")
    if batch.group_size is not None:
        return batch.group_size
    return default_group_size(batch.global_batch_size, config.scaling.num_workers, batch.policy,
                              batch.max_micro_batch)


def _from(cwd: str, path: str) -> str:
    """`path` as seen from `cwd` (a URL, or an absolute path, as it is)."""
    return path if "://" in path or os.path.isabs(path) else os.path.join(cwd, path)


__all__ = [
    "HOME_ENV",
    "LAUNCH_FILE",
    "Launch",
    "file_sha256",
    "read_launch",
    "resume_config",
    "started_config",
    "target_file",
    "write_launch",
]
