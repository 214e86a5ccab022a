"""Project rules that are cheap to check: no pickle, pure layers stay pure, modules stay small."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardckpt"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0] if not node.module.startswith("shardckpt") else node.module)
    return names


# The one exception: PyTorch DCP's `.metadata` and the headers of its records *are* pickles, so the DCP importer
# must read pickle opcodes. It does so in this module only, through a pickle.Unpickler subclass whose find_class
# admits an explicit table of DCP's own classes and refuses every other global before anything runs.
RESTRICTED_UNPICKLER = PACKAGE / "dcp_pickle.py"


def test_no_pickle_and_no_torch_load_in_the_package() -> None:
    for path in PACKAGE.rglob("*.py"):
        imports = _imports(path)
        if path != RESTRICTED_UNPICKLER:
            assert not imports & {"pickle", "cPickle", "dill", "cloudpickle"}, path
        assert "torch.load(" not in path.read_text(), path


def test_the_restricted_unpickler_only_ever_unpickles_through_its_find_class() -> None:
    tree = ast.parse(RESTRICTED_UNPICKLER.read_text())
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "pickle"
    }
    assert calls == set(), calls  # no pickle.load/loads/dump/Unpickler(...) call: only the subclass is used
    bases = [ast.unparse(base) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
    assert "pickle.Unpickler" in bases
    methods = {
        item.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and "pickle.Unpickler" in map(ast.unparse, node.bases)
        for item in node.body
        if isinstance(item, ast.FunctionDef)
    }
    assert {"find_class", "persistent_load"} <= methods
    assert _imports(RESTRICTED_UNPICKLER) & {"dill", "cloudpickle", "cPickle"} == set()


def test_format_and_planner_are_pure() -> None:
    forbidden = {"torch", "fsspec", "s3fs", "os", "io", "socket", "subprocess", "threading"}
    for layer in ("format", "planner"):
        for path in (PACKAGE / layer).rglob("*.py"):
            imports = _imports(path)
            assert not imports & forbidden, (path, imports & forbidden)
            upward = {
                m
                for m in imports
                if m.startswith("shardckpt.") and m.split(".")[1] not in {"errors", "format", "planner"}
            }
            assert not upward, (path, upward)
            if layer == "format":
                assert not {m for m in imports if m.startswith("shardckpt.planner")}, path


def test_storage_does_not_import_upper_layers() -> None:
    for path in (PACKAGE / "storage").rglob("*.py"):
        upper = {
            m
            for m in _imports(path)
            if m.startswith("shardckpt.")
            and m.split(".")[1] in {"writer", "coordinator", "restorer", "api", "cli", "planner", "format"}
        }
        assert not upper, (path, upper)


def test_modules_stay_small() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 800, path
