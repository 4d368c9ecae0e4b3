"""Which modules must travel with a job: the user's own code that the workers cannot import.

A job's factories may be written any way Python allows (a function, a lambda or closure, a
`functools.partial`, a bound method, a callable instance, a class). Walking what they
reference finds the modules they come from; only those whose file is the user's (neither the
standard library nor an installed distribution nor this package) are pickled by value, so
that workers on any node run them without the file on their path. Everything else is
pickled by reference as usual: registering `functools` or `torch` by value would try to
pickle their C-level internals and fail.

No Ray here: the caller registers the modules this returns with cloudpickle.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable
from typing import Any

# A walk that visits more objects than this stops: a factory that holds a data set in a
# closure must not make every submission crawl through millions of samples.
_MAX_VISITS = 20_000


def user_modules(roots: Iterable[Any]) -> list[types.ModuleType]:
    """The user modules (see the module docstring) that `roots` reference, in first-seen order.

    `__main__` is never returned: cloudpickle already pickles its functions and classes by
    value, and it cannot be registered.
    """
    found: dict[str, types.ModuleType] = {}
    seen: set[int] = set()
    users: dict[int, bool] = {}  # id(module) -> is_user_module (it reads the file system)
    stack = list(roots)
    visits = 0
    while stack and visits < _MAX_VISITS:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        visits += 1
        module = _module_of(obj)
        user = False
        if module is not None:
            if id(module) not in users:
                users[id(module)] = is_user_module(module)
            user = users[id(module)]
            if user and module.__name__ not in found:
                found[module.__name__] = module
        stack.extend(_references(obj, module, user))
    return list(found.values())


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, types.BuiltinFunctionType)


def _module_of(obj: Any) -> types.ModuleType | None:
    if isinstance(obj, types.ModuleType):  # `import helpers` then `helpers.f` in a function
        return obj
    if isinstance(obj, types.FunctionType):
        name = obj.__globals__.get("__name__") or obj.__module__
    elif isinstance(obj, type):
        name = obj.__module__
    else:
        name = type(obj).__module__
    return sys.modules.get(name) if isinstance(name, str) else None


def _references(obj: Any, module: types.ModuleType | None, user: bool) -> list[Any]:
    """What `obj` refers to that may come from other modules (`user`: whether `module`, the
    one `obj` comes from, is a user module)."""
    # Library code (not the user's, not `__main__`): what its functions' globals reference
    # is the library's (a walk through torch's would use up the visits, slowly); what a
    # library function closes over or defaults to may be the user's (a decorator's wrapper
    # around a user function), as may a library class's bases and methods.
    library = module is not None and not user and module.__name__ != "__main__"
    if isinstance(obj, types.ModuleType):
        # A user module travels by value with its functions and classes, which may use
        # further user modules; a library module is imported on the workers as it is.
        if not user:
            return []
        return [v for v in vars(obj).values()
                if isinstance(v, (types.FunctionType, type, types.ModuleType, functools.partial))]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, types.FunctionType):
        refs: list[Any] = [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        for cell in obj.__closure__ or ():
            try:
                refs.append(cell.cell_contents)
            except ValueError:  # an empty cell (a variable not yet assigned)
                continue
        if not library:
            refs.extend(obj.__globals__[n] for n in _global_names(obj.__code__)
                        if n in obj.__globals__)
        return refs
    if isinstance(obj, type):
        # A class's methods reference the globals of its module; its bases may live elsewhere
        # (a library's class may be built at run time from the user's bases or functions).
        refs = [b for b in obj.__bases__ if b is not object]
        for value in vars(obj).values():
            if isinstance(value, (staticmethod, classmethod)):
                refs.append(value.__func__)
            elif isinstance(value, types.FunctionType):
                refs.append(value)
        return refs
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    # An instance (a callable object, a model, a config): its class, and its attributes when
    # that class is the user's (a library object's internals are the library's business) or
    # one of our framework adapters (which hold the user's module classes and functions).
    refs = [type(obj)]
    if module is not None and (user or module.__name__.startswith("elastic.integrations.")):
        # Code last, so that it is walked first (the stack pops from the end): a large data
        # set must not use up the visits before the functions and classes are seen.
        values = list(getattr(obj, "__dict__", {}).values())
        code = (type, types.FunctionType, types.MethodType, functools.partial)
        refs += [v for v in values if not isinstance(v, code)] + [v for v in values if isinstance(v, code)]
    return refs


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= _global_names(const)
    return names


def is_user_module(module: types.ModuleType) -> bool:
    """Whether `module` is the user's own code: a file that is not in the standard library,
    not part of an installed distribution and not part of this package."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    top = module.__name__.split(".")[0]
    if top in _editable_top_levels() or not (os.path.isabs(path) and os.path.isfile(path)):
        return False  # an installed package, or a module-like object (`torch.ops.aten`)
    if top != module.__name__:
        # A submodule is the user's only if its package is (torch's generated modules are not).
        package = sys.modules.get(top)
        if package is None:
            return False
        if getattr(package, "__file__", None) is None:  # a namespace package: its folders
            if all(_in_library(p) for p in getattr(package, "__path__", [])):
                return False
        elif not is_user_module(package):
            return False
    return not _in_library(path)


def _in_library(path: str) -> bool:
    path = os.path.realpath(path)
    return any(path == root or path.startswith(root + os.sep) for root in _library_roots())


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Folders that hold the standard library and installed packages of this interpreter."""
    roots = set()
    for scheme_path in ("stdlib", "platstdlib", "purelib", "platlib"):
        roots.add(sysconfig.get_paths()[scheme_path])
    roots.update(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        roots.add(site.getusersitepackages())
    return tuple(os.path.realpath(r) for r in roots if r)


@functools.lru_cache(maxsize=1)
def _editable_top_levels() -> frozenset[str]:
    """Top-level import names of distributions installed in editable mode (`pip install -e`,
    this package among them): installed, though their files live outside site-packages.

    Only the names each such distribution declares count, not its whole folder: a project's
    `tests/` beside its editable package is still the user's code."""
    editable = {"elastic"}
    for dist in importlib.metadata.distributions():
        text = dist.read_text("direct_url.json")
        if text and json.loads(text).get("dir_info", {}).get("editable"):
            editable.add(dist.metadata["Name"])
    tops = {top for top, names in importlib.metadata.packages_distributions().items()
            if editable.intersection(names)}
    return frozenset(tops | {"elastic", "cli"})


def unpicklable(fields: dict[str, Any], dumps: Callable[[Any], bytes]) -> str | None:
    """Names what keeps a job from reaching the workers: the first of `fields` (TrainJob field
    -> value) that `dumps` (cloudpickle's) refuses, down the path of references to the object
    that cannot be pickled (a lock, a file, a socket, a CUDA context). None if all pickle."""
    for name, value in fields.items():
        error = _refused(value, dumps)
        if error is not None:
            start = getattr(value, "__qualname__", None) or type(value).__qualname__
            path, culprit, why = _culprit(value, dumps, error, start, set())
            kind = f"{type(culprit).__module__}.{type(culprit).__qualname__}".removeprefix(
                "builtins.")
            return (f"TrainJob.{name} cannot be sent to the workers: {path} is a {kind} that "
                    f"cannot be pickled ({why}); create it inside the factory instead of "
                    "capturing it")
    return None


def _refused(obj: Any, dumps: Callable[[Any], bytes]) -> str | None:
    try:
        dumps(obj)
    except Exception as e:  # what cloudpickle raises varies: TypeError, PicklingError, ...
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _culprit(obj: Any, dumps: Callable[[Any], bytes], error: str, path: str,
             seen: set[int]) -> tuple[str, Any, str]:
    """Descends from `obj` (which `dumps` refuses) along a reference that is refused too, as
    deep as one goes; returns that path, the object and its error."""
    seen.add(id(obj))
    if len(seen) < 200:
        for label, ref in _labelled(obj):
            if id(ref) in seen or ref is None or isinstance(ref, _LEAVES):
                continue
            why = _refused(ref, dumps)
            if why is not None:
                return _culprit(ref, dumps, why, f"{path} -> {label}", seen)
    return path, obj, error


def _labelled(obj: Any) -> list[tuple[str, Any]]:
    """What `obj` refers to, each with how a reader finds it."""
    if isinstance(obj, functools.partial):
        return [("func", obj.func), *((f"argument {i}", a) for i, a in enumerate(obj.args)),
                *((f"keyword {k}", v) for k, v in obj.keywords.items())]
    if isinstance(obj, types.MethodType):
        return [("self", obj.__self__), ("function", obj.__func__)]
    if isinstance(obj, types.FunctionType):
        refs: list[tuple[str, Any]] = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                refs.append((f"closure variable {name!r}", cell.cell_contents))
            except ValueError:
                continue
        refs += [(f"global {n!r}", obj.__globals__[n]) for n in sorted(_global_names(obj.__code__))
                 if n in obj.__globals__ and not isinstance(obj.__globals__[n], types.ModuleType)]
        refs += [(f"default {i}", d) for i, d in enumerate(obj.__defaults__ or ())]
        return refs
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"item {i}", v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"key {k!r}", v) for k, v in obj.items()]
    if isinstance(obj, type):
        return []
    return [(f"attribute {k!r}", v) for k, v in getattr(obj, "__dict__", {}).items()]


def package_origin() -> tuple[str, str]:
    """Where this process's `elastic` comes from and its version: (folder, version)."""
    import elastic

    folder = os.path.dirname(elastic.__file__) if getattr(elastic, "__file__", None) else (
        "a namespace package at " + ", ".join(getattr(elastic, "__path__", []) or ["?"]))
    try:
        version = importlib.metadata.version("elastic")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return folder, version


def shadowing_folder(cwd: str) -> str | None:
    """A module or package named `elastic` in `cwd` that is not the package this process
    imported: Ray's processes start in the driver's working directory (or a job's), first on
    their path, where it would be imported instead. A plain folder named elastic (no
    `__init__.py`, a namespace package) shadows only a package that is not itself on the path
    (an editable install's finder); an installed package wins over it."""
    folder = package_origin()[0]
    here = os.path.realpath(folder)
    on_path = {os.path.realpath(p or os.getcwd()) for p in sys.path}
    regular = os.path.realpath(os.path.dirname(folder)) in on_path
    package = os.path.join(cwd, "elastic")
    modules = [os.path.join(cwd, name) for name in os.listdir(cwd)
               if name == "elastic.py" or (name.startswith("elastic.") and name.endswith(".so"))]
    if os.path.isdir(package) and os.path.realpath(package) != here and (
            not regular or os.path.exists(os.path.join(package, "__init__.py"))):
        return package
    return modules[0] if modules else None


def check_origin(expected: tuple[str, str], where: str) -> None:
    """Refuses to go on in a process (`where`: 'the controller', 'worker 3') that imported
    another `elastic` than the driver's (`expected`: its `package_origin`).

    Raises:
        ConfigError: another version, or a namespace package (a folder named elastic).
    """
    from elastic.errors import ConfigError

    folder, version = package_origin()
    if version != expected[1] or folder.startswith("a namespace package"):
        raise ConfigError(
            f"{where} imports elastic {version} from {folder}, but the driver runs elastic "
            f"{expected[1]} from {expected[0]}: install the same version everywhere, and rename "
            "any folder named 'elastic' in the working directory")
