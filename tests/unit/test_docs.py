"""Meta-tests on the documentation (as datasette does): the docs cannot fall behind the code.

* every hookspec in ``statekit/hooks/hookspecs.py`` has a section in ``docs/hooks.md`` (a
  mkdocstrings ``:::`` directive, rendered with the exact signature as heading) and a
  ``test_hook_<name>`` test somewhere under ``tests/``;
* every public name in ``statekit.__all__`` has a docstring, with ``Args:`` when it takes
  parameters, ``Returns:`` when it returns a value and ``Raises:`` when it raises;
* every page of ``docs/`` is in the site's navigation (``mkdocs.yml``), and the README
  links every page.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import statekit
import statekit.hooks.hookspecs

from repo_paths import ROOT  # noqa: E402
DOCS = ROOT / "docs"
HOOKS_PAGE = DOCS / "hooks.md"

HOOKSPECS = sorted(
    name
    for name, obj in vars(statekit.hooks.hookspecs).items()
    if name.startswith("statekit_") and callable(obj) and hasattr(obj, "statekit_spec")
)


def test_hookspecs_found():
    assert HOOKSPECS == sorted(
        [
            "statekit_attach",
            "statekit_save_state_pre",
            "statekit_save_state_post",
            "statekit_boundary_state",
            "statekit_load_state_pre",
            "statekit_load_state_post",
            "statekit_manager_options",
            "statekit_manager_start",
            "statekit_checkpoint_committed",
            "statekit_retention_keep",
            "statekit_resume_roots",
            "statekit_manager_wait",
        ]
    )


@pytest.mark.parametrize("hook", HOOKSPECS)
def test_hook_has_docs_section(hook):
    text = HOOKS_PAGE.read_text()
    assert re.search(rf"^::: statekit\.hooks\.hookspecs\.{hook}\s*$", text, re.M), (
        f"docs/hooks.md has no '::: statekit.hooks.hookspecs.{hook}' section"
    )
    doc = inspect.getdoc(getattr(statekit.hooks.hookspecs, hook)) or ""
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, f"{hook} docstring lacks {section}"


@pytest.mark.parametrize("hook", HOOKSPECS)
def test_hook_has_test(hook):
    pattern = re.compile(rf"^\s*(async\s+)?def test_hook_{hook}\b", re.M)
    found = [p for p in (ROOT / "tests").rglob("*.py") if pattern.search(p.read_text())]
    assert found, f"no test_hook_{hook} under tests/"


# --------------------------------------------------------------------------- docstrings

PUBLIC = [name for name in statekit.__all__ if name != "__version__"]


def _function_node(obj):
    """The ``ast`` node of a function's source, or None when the source is not available."""
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _own_nodes(func):
    """The nodes of a function body, not descending into nested functions or classes."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _returns_value(func) -> bool:
    if isinstance(func, ast.FunctionDef) and func.returns is not None:
        annotation = ast.unparse(func.returns)
        if annotation in ("None", "NoReturn", "Never"):
            return False
    return any(
        isinstance(n, ast.Return) and n.value is not None and not (isinstance(n.value, ast.Constant) and n.value.value is None)
        for n in _own_nodes(func)
    ) or any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(func))


def _raises(func) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is not None for n in _own_nodes(func))


def _parameters(obj) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _check_function(name, func, doc, problems):
    if _parameters(func) and "Args:" not in doc:
        problems.append(f"{name}: takes {_parameters(func)} but its docstring has no Args:")
    node = _function_node(func)
    if node is None:
        return
    if _returns_value(node) and not re.search(r"^(Returns|Yields):", doc, re.M):
        problems.append(f"{name}: returns a value but its docstring has no Returns:")
    if _raises(node) and "Raises:" not in doc:
        problems.append(f"{name}: raises but its docstring has no Raises:")


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_documented(name):
    obj = getattr(statekit, name)
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"statekit.{name} has no docstring"
    problems: list[str] = []
    if inspect.isfunction(obj):
        _check_function(f"statekit.{name}", obj, doc, problems)
    elif inspect.isclass(obj):
        if issubclass(obj, BaseException):
            # errors: the class docstring says when it is raised; attributes where it has some
            pass
        else:
            init = obj.__dict__.get("__init__")
            if init is not None and _parameters(init):
                init_doc = inspect.getdoc(init) or ""
                if "Args:" not in doc and "Args:" not in init_doc and "Attributes:" not in doc:
                    problems.append(f"statekit.{name}: __init__ takes {_parameters(init)} but no Args: is documented")
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not inspect.isfunction(member):
                    continue
                member_doc = inspect.getdoc(member) or ""
                if not member_doc.strip():
                    problems.append(f"statekit.{name}.{attr} has no docstring")
                    continue
                _check_function(f"statekit.{name}.{attr}", member, member_doc, problems)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- site and README


def _nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    return set(re.findall(r"([\w/.-]+\.md)\s*$", text, re.M))


def _pages() -> list[str]:
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if not p.name.startswith("_"))


def test_every_page_in_nav():
    missing = sorted(set(_pages()) - _nav_pages())
    assert not missing, f"pages not in mkdocs.yml nav: {missing}"


def test_readme_links_every_page():
    readme = (ROOT / "README.md").read_text()
    missing = [page for page in _pages() if f"docs/{page}" not in readme]
    assert not missing, f"README.md does not link: {missing}"


def test_every_plugin_has_a_page():
    plugins = sorted(p.name.removeprefix("statekit-") for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())
    missing = [name for name in plugins if not (DOCS / "plugins" / f"{name}.md").is_file()]
    assert not missing, f"plugins without a page docs/plugins/<name>.md: {missing}"


def test_manifest_schema_is_linked_from_the_format_page():
    assert (ROOT / "statekit" / "manifest.schema.json").is_file()
    assert "statekit/manifest.schema.json" in (DOCS / "format.md").read_text()
