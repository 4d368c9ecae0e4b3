"""The dependency rules of STYLE.md section 2, checked by walking every module's imports."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# package prefix -> import prefixes it must not use
FORBIDDEN = {
    "elastic.errors": ("elastic.", "ray", "torch"),
    "elastic.config": ("elastic.", "ray", "torch"),
    "elastic.collective": ("ray", "elastic.actors", "elastic.adapt", "elastic.checkpoint"),
    "elastic.checkpoint": ("ray", "elastic.actors", "elastic.adapt", "elastic.collective"),
    "elastic.adapt": ("ray", "torch.distributed", "elastic.actors", "elastic.collective",
                      "elastic.checkpoint"),
    "elastic.trainer": ("ray", "elastic.actors", "cli"),
    "elastic.runlog": ("ray", "torch", "elastic.actors"),
    "elastic.events": ("ray", "torch", "elastic.actors"),
    "elastic.control": ("ray", "elastic.actors", "cli"),
    "elastic.job": ("ray", "elastic.actors"),
    "elastic.result": ("ray", "elastic.actors"),
    "elastic.bench": ("ray", "elastic.actors"),
    "elastic.api": ("cli", "ray"),
    "elastic.report": ("ray", "torch", "elastic.actors"),
    "elastic.recovery": ("ray", "torch", "elastic.actors"),
    "elastic.demo": ("ray", "elastic.actors", "cli"),
    "elastic.callbacks": ("ray", "torch", "elastic.actors", "cli"),
    "elastic.loggers": ("ray", "elastic.actors", "cli"),
    "elastic.sinks": ("ray", "elastic.actors", "cli"),
    "elastic.progress": ("ray", "torch", "elastic.actors", "cli"),
    "elastic.actors": ("cli",),
    "cli": ("elastic.actors", "ray"),
}
ALLOWED_OWN = {"elastic.errors": (), "elastic.config": ()}


def _modules():
    for path in sorted([*ROOT.glob("elastic/**/*.py"), *ROOT.glob("cli/**/*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


MODULES = list(_modules())


def test_the_walk_finds_the_packages():
    names = {name for name, _ in MODULES}
    assert {"elastic.collective.communicator", "elastic.errors", "elastic.config"} <= names


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_module_respects_the_layering(name, path):
    for prefix, forbidden in FORBIDDEN.items():
        if name == prefix or name.startswith(prefix + "."):
            for imported in _imports(path):
                for bad in forbidden:
                    if imported == bad.rstrip(".") or imported.startswith(bad.rstrip(".") + "."):
                        if bad == "elastic." and imported in ("elastic.errors", "elastic.config"):
                            continue
                        pytest.fail(f"{name} imports {imported}, which {prefix} must not use")


def test_only_actors_import_ray():
    for name, path in MODULES:
        if name.startswith("elastic.actors"):
            continue
        for imported in _imports(path):
            assert not (imported == "ray" or imported.startswith("ray.")), f"{name} imports ray"
