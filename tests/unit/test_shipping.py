"""Which modules travel with a job by value: only the user's own code."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import textwrap

import pydantic
import torch
from torch.utils.data import default_collate

import elastic.demo
from elastic.shipping import is_user_module, user_modules
from tests import jobs


class Loss:
    def __init__(self, inner) -> None:
        self.inner = inner

    def method(self, model, batch):
        return self.inner(model, batch)

    def __call__(self, model, batch):
        return self.inner(model, batch)


def _names(*roots) -> list[str]:
    return sorted(m.__name__ for m in user_modules(roots))


def test_a_partial_of_a_library_class_ships_nothing():
    # The crash this guards against: `functools` itself registered by value.
    assert _names(functools.partial(torch.optim.SGD, lr=0.1)) == []


def test_a_library_wrapper_around_a_user_function_ships_the_functions_module():
    # torch's decorator closes over the user's function: the walk follows what library code
    # closes over, though not its globals.
    assert _names(torch.no_grad()(jobs.make_optimizer)) == ["tests.jobs"]


def test_standard_library_installed_and_own_package_modules_are_never_user_modules():
    for module in (functools, json, torch, torch.optim, elastic.demo, pydantic):
        assert not is_user_module(module), module.__name__


def test_a_partial_of_a_user_function_ships_the_functions_module():
    assert _names(functools.partial(jobs.make_optimizer)) == ["tests.jobs"]


def test_a_bound_method_ships_its_instances_class_and_what_the_instance_holds():
    assert _names(Loss(jobs.mse).method) == sorted([__name__, "tests.jobs"])


def test_a_callable_instance_ships_its_type():
    assert _names(Loss(default_collate)) == [__name__]


def test_a_class_ships_its_module():
    assert _names(Loss) == [__name__]


def test_a_closure_ships_the_modules_of_what_it_captures_and_the_globals_it_uses():
    captured = jobs.make_model

    def closure():
        return captured()

    assert _names(closure) == sorted([__name__, "tests.jobs"])
    assert _names(lambda params: jobs.make_optimizer(params)) == sorted([__name__, "tests.jobs"])


def test_a_file_outside_every_path_is_a_user_module_and_main_is_not(tmp_path):
    path = tmp_path / "loose_module.py"
    path.write_text(textwrap.dedent("""
        def f():
            return 1
    """))
    spec = importlib.util.spec_from_file_location("loose_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loose_module"] = module
    try:
        spec.loader.exec_module(module)
        assert _names(module.f) == ["loose_module"]
    finally:
        del sys.modules["loose_module"]
    assert not is_user_module(sys.modules["__main__"])


def test_a_module_of_a_namespace_package_in_the_users_folder_ships(tmp_path, monkeypatch):
    (tmp_path / "userns").mkdir()  # no __init__.py: a namespace package
    (tmp_path / "userns" / "helpers.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import userns.helpers

    try:
        assert _names(userns.helpers.f) == ["userns.helpers"]
    finally:
        for name in ("userns.helpers", "userns"):
            sys.modules.pop(name, None)


def test_module_like_objects_of_installed_packages_are_not_user_modules():
    assert not is_user_module(torch.ops.aten)


def test_a_class_a_library_builds_from_a_user_base_ships_the_bases_module():
    built = type("Built", (Loss,), {"__module__": "collections"})  # as a library factory would
    assert _names(built) == [__name__]
