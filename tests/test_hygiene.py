"""Project rules that are cheap to check: no pickle, layers import downward only, no cycles, small modules, and
the torch-free layers and commands really run without torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardckpt"

# The layers, lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS: list[set[str]] = [
    {"errors", "knobs", "crashpoints"},
    {"format"},
    {"planner"},
    {"storage"},
    {"catalog", "torch_bytes"},
    {"ops", "write", "read"},
    {"statedict"},
    {"distributed", "dcp"},
    {"api", "checkpointer", "local_tier", "__init__"},
    {"tools", "interop", "integrations"},
    {"cli", "train", "testing"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
TORCH_FREE = ("errors", "knobs", "format", "planner", "storage", "catalog", "ops")

# The one exception: PyTorch DCP's `.metadata` and the headers of its records *are* pickles, so the DCP importer
# must read pickle opcodes. It does so in this module only, through a pickle.Unpickler subclass whose find_class
# admits an explicit table of DCP's own classes and refuses every other global before anything runs.
RESTRICTED_UNPICKLER = PACKAGE / "interop" / "dcp_pickle.py"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """Modules imported when `path` is imported: top-level statements, not TYPE_CHECKING blocks or functions."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            body.extend(getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule, when it is one
    return found


def _all_imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0] if not node.module.startswith("shardckpt") else node.module)
    return names


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_pickle_and_no_torch_load_in_the_package() -> None:
    for path in PACKAGE.rglob("*.py"):
        imports = _all_imports(path)
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
    assert _all_imports(RESTRICTED_UNPICKLER) & {"dill", "cloudpickle", "cPickle"} == set()


def test_every_module_belongs_to_a_layer() -> None:
    assert {_layer(module) for module in _modules()} <= set(RANK)


def test_imports_go_downward_only() -> None:
    """Every import, also inside functions: a lazy import may skip a cost, never a layer."""
    wrong = []
    for module, path in _modules().items():
        for target in _all_imports(path):
            if target.startswith("shardckpt.") and RANK[_layer(target)] > RANK[_layer(module)]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_format_and_planner_are_pure() -> None:
    forbidden = {"torch", "fsspec", "s3fs", "os", "io", "socket", "subprocess", "threading"}
    for layer in ("format", "planner"):
        for path in (PACKAGE / layer).rglob("*.py"):
            imports = _all_imports(path)
            assert not imports & forbidden, (path, imports & forbidden)


def test_no_import_cycles_including_package_inits() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {t for t in _top_level_imports(path) if t in modules and t != module}
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        for target in list(targets):
            parts = target.split(".")
            targets.update(".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in modules)
        parent = module.rsplit(".", 1)[0]
        graph[module] = {t for t in targets if t != parent or module == parent}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_modules_stay_small() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 800, path


BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys
    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (imported as {name})")
    sys.meta_path.insert(0, NoTorch())
    """
)


def _run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )


def test_the_package_and_its_torch_free_layers_import_without_torch() -> None:
    modules = sorted(m for m in _modules() if m == "shardckpt" or _layer(m) in TORCH_FREE)
    result = _run_without_torch(
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        "import shardckpt\nassert shardckpt.ShardckptError and shardckpt.__version__\n",
        *modules,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "du", "gc"])
def test_the_torch_free_commands_run_without_torch(tmp_path: pathlib.Path, command: str) -> None:
    from tests.helpers.checkpoints import sample_state, save_sharded

    root = tmp_path / "root"
    save_sharded(sample_state(), str(root / "step-00000001"), 2)
    target = str(root / "step-00000001") if command in ("inspect", "verify") else str(root)
    extra = ["--dry-run"] if command == "gc" else []
    result = _run_without_torch(
        "import sys\nfrom shardckpt.cli import main\nsys.exit(main(sys.argv[1:]))\n", command, target, "--json", *extra
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("{"), result.stdout
