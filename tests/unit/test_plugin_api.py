"""The declared plugin API: the plugins of this repository and the plugin template import
nothing from statekit but ``statekit.plugin_api``, and only names of its ``__all__``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

import statekit.plugin_api as plugin_api

from repo_paths import ROOT  # noqa: E402
API = "statekit.plugin_api"

# Integrations: modules of a plugin distribution that drive statekit as user code does (the
# Trainer mixin of statekit-transformers saves through statekit.CheckpointManager, with
# Trainer's rotation as a statekit.RetentionPolicy). They are clients, not plugins: they
# import only statekit's public names (statekit.__all__).
CLIENTS = sorted(
    ROOT / "plugins/statekit-transformers/src/statekit_transformers" / name for name in ("retention.py", "trainer.py")
)

SOURCES = sorted(
    p
    for p in [
        *ROOT.glob("plugins/*/src/**/*.py"),
        *ROOT.glob("examples/plugin-template/src/**/*.py"),
        *ROOT.glob("statekit_replicate/**/*.py"),  # shipped inside the statekit distribution, a plugin all the same
    ]
    if p not in CLIENTS
)


def _is_statekit(module: str) -> bool:
    return module == "statekit" or module.startswith("statekit.")


def _names_a_module(text: str) -> bool:
    """True for a string naming an importable statekit module (a lazy ``import_module`` target)."""
    if not text.startswith("statekit.") or not text.replace(".", "").replace("_", "").isalnum():
        return False
    try:
        return importlib.util.find_spec(text) is not None
    except (ImportError, ValueError):
        return False


def violations(source: str, where: str) -> list[str]:
    """Every statekit import of ``source`` other than declared names of ``statekit.plugin_api``.

    Args:
        source: Python source code.
        where: its file name, for the messages.

    Returns:
        One message per violation (empty when the source complies).
    """
    allowed = set(plugin_api.__all__)
    found: list[str] = []
    api_aliases: set[str] = set()  # names bound to the plugin_api module itself
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_statekit(alias.name):
                    continue
                if alias.name != API:
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                elif alias.asname:
                    api_aliases.add(alias.asname)
                else:
                    found.append(f"{where}:{node.lineno}: import {API} binds 'statekit': use 'from {API} import ...'")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_statekit(node.module):
            if node.module == "statekit":
                names = [a.name for a in node.names]
                if names == ["plugin_api"]:
                    api_aliases.update(a.asname or a.name for a in node.names)
                    continue
                found.append(f"{where}:{node.lineno}: from statekit import {', '.join(names)}")
            elif node.module != API:
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            else:
                for alias in node.names:
                    if alias.name.startswith("_") or alias.name not in allowed:
                        found.append(f"{where}:{node.lineno}: {alias.name!r} is not in {API}.__all__")
    for node in ast.walk(tree):
        # attributes reached through the module: api.X
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in api_aliases:
            if node.attr.startswith("_") or node.attr not in allowed:
                found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} is not in {API}.__all__")
        # modules named in strings, for importlib.import_module (docstrings are not code)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != API and _names_a_module(node.value):
            found.append(f"{where}:{node.lineno}: names module {node.value!r}")
    return found


def test_sources_found():
    packages = {p.relative_to(ROOT).parts[:3] if p.relative_to(ROOT).parts[0] != "statekit_replicate" else ("statekit_replicate",)
                for p in SOURCES}
    assert len(packages) == 7, packages  # five plugins, the template and statekit_replicate
    assert [p.name for p in CLIENTS] == ["retention.py", "trainer.py"]


@pytest.mark.parametrize("path", CLIENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_integrations_import_only_public_names(path):
    """A client module imports ``statekit`` itself and uses only names of ``statekit.__all__``."""
    import statekit

    tree = ast.parse(path.read_text())
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_statekit(node.module):
            problems.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            problems += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_statekit(a.name) and a.name != "statekit"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "statekit":
            if node.attr not in statekit.__all__:
                problems.append(f"line {node.lineno}: statekit.{node.attr} is not public")
    assert not problems, problems
    assert not any(p.name == "in_use.py" for p in SOURCES)  # the offload shim of core privates is gone


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_sources_import_only_the_plugin_api(path):
    problems = violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import statekit",
        "import statekit.format as fmt",
        "from statekit import hookimpl",
        "from statekit import format as fmt",
        "from statekit.engine.context import Checkpoint",
        "from statekit.storage.inuse import _is_live",
        "from statekit.plugin_api import _private",
        "from statekit.plugin_api import Entry",
        "import statekit.plugin_api as api\napi.unwrap_model\napi._hidden",
        "def f():\n    from statekit.errors import StatekitError",
        "import importlib\nimportlib.import_module('statekit.engine.context')",
    ],
)
def test_violations_are_found(source):
    assert violations(source, "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "from statekit.plugin_api import Checkpoint, hookimpl",
        "import statekit.plugin_api as api\napi.read_header",
        "from statekit import plugin_api\nplugin_api.check_fit",
        "import statekit_offload.loading\nfrom statekit_rng import plugin",
    ],
)
def test_compliant_sources_pass(source):
    assert violations(source, "x.py") == []


def test_all_names_resolve():
    assert len(set(plugin_api.__all__)) == len(plugin_api.__all__)
    for name in plugin_api.__all__:
        assert not name.startswith("_")
        assert hasattr(plugin_api, name), name


def test_names_are_re_exported_not_implemented():
    """Every name is owned by another statekit module (plugin_api defines nothing)."""
    for name in plugin_api.__all__:
        obj = getattr(plugin_api, name)
        owner = getattr(obj, "__module__", None)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert owner != API and importlib.import_module(owner) is not plugin_api, name
    tree = ast.parse(Path(plugin_api.__file__).read_text())
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defined


def test_plugin_api_does_not_import_the_api_or_the_cli():
    tree = ast.parse(Path(plugin_api.__file__).read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m and m.split(".")[:2] in (["statekit", "api"], ["statekit", "cli"])]


def test_plugins_use_the_declared_names():
    """Every name of the plugin API but the errors is used by a plugin or the template (nothing speculative)."""
    used: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == API:
                used.update(a.name for a in node.names)
    offload_reexports = {  # statekit-offload's own public API re-exports them (lazily, by name)
        "InUseMarker",
        "in_use_markers",
        "is_in_use",
        "mark_in_use",
        "release_in_use",
        "remove_stale_markers",
    }
    errors = {  # every error class is declared: a plugin raises and catches them
        name
        for name in plugin_api.__all__
        if inspect.isclass(getattr(plugin_api, name)) and issubclass(getattr(plugin_api, name), (Exception, Warning))
    }
    # promised before statekit-rng moved to accelerator_generators (the lookup behind it): stays importable
    kept = {"current_accelerator_type"}
    unused = set(plugin_api.__all__) - used - offload_reexports - errors - kept
    assert not unused, f"names of statekit.plugin_api no plugin uses: {sorted(unused)}"


def test_rank_path_names_the_files_a_per_rank_save_writes(tmp_path):
    """A plugin names per-rank files with ``rank_path``; the core's per-rank files follow the same rule."""
    import statekit

    manifest = statekit.save(str(tmp_path), {"pos": {"index": 17}}, per_rank=["pos"])
    assert plugin_api.rank_path("pos", 0) + ".json" in manifest.files
    assert plugin_api.rank_path("dataloader_0", 3) == "dataloader_0/rank-00003"
    assert plugin_api.rank_name(123456) == "rank-123456"
    assert plugin_api.parse_rank_path("rng/rank-00001.json") == ("rng", 1)
    assert plugin_api.parse_rank_path("model_0/rank-00002.safetensors") == ("model_0", 2)
    assert plugin_api.parse_rank_path(plugin_api.rank_path("a/b", 7)) == ("a/b", 7)
    assert plugin_api.parse_rank_path("model.safetensors") is None
    assert plugin_api.parse_rank_path("rng/rank-1.json") is None
