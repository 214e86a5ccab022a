"""The documentation site's generated parts and links: the CLI reference lists every command, with its options,
from the parsers themselves; the README's relative links point at files that exist. (`make docs` builds the site
strictly; tests/test_readme.py runs its code blocks.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _hook(name: str = "cli_reference"):
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_has_a_section_per_command_with_its_help() -> None:
    from shardckpt.cli.main import COMMAND_MODULES, build_parser

    hook = _hook()
    text = hook.cli_reference_markdown()
    commands = list(hook._subcommands(build_parser()))
    assert len(commands) >= len(COMMAND_MODULES) + 1  # every registered module, and train
    for name in commands:
        assert f"## shardckpt {name} {{#{name}}}" in text, name
    assert "usage: shardckpt verify" in text and "--ckpt" in text  # a command's own help; train's own parser
    assert max(len(line) for line in text.splitlines()) <= hook.WIDTH + 20


def test_cli_reference_page_keeps_its_marker() -> None:
    page = (REPO / "docs" / _hook().PAGE).read_text()
    assert _hook().MARKER in page


def test_api_reference_documents_every_public_name() -> None:
    import shardckpt

    hook = _hook("api_reference")
    text = hook.api_reference_markdown()
    for name in [*shardckpt._LAZY, *shardckpt.__all__]:
        if name not in ("dcp", "__version__"):
            assert f"`shardckpt.{name}`" in text, name
    assert "`shardckpt.dcp.StorageWriter`" in text and "`shardckpt.dcp.StorageReader`" in text
    assert "parent: the URL of a committed checkpoint" in text  # save's docstring, whole
    assert hook.MARKER in (REPO / "docs" / hook.PAGE).read_text()


def test_readme_relative_links_exist() -> None:
    readme = (REPO / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert targets, "the README links to no page"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, missing
