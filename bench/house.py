"""The size and shape of the library: lines of code and of docstrings apart, and the
functions with the highest cyclomatic complexity (radon), for statekit/ and each plugin.

Usage: ``python bench/house.py [--top 10] [--rev REV]`` (``--rev`` measures a commit with
``git archive`` into a temporary folder, so that before and after come from one script).
Needs radon (``make bench-setup``, or ``pip install radon``).

Lines are physical lines of ``.py`` files: *docstrings* are the lines of module, class
and function docstrings (``ast.get_docstring`` positions), *comments* the lines holding
only a comment, *blank* the empty ones, and *code* the rest. Complexity is radon's
cyclomatic complexity (https://radon.readthedocs.io/en/latest/intro.html#cyclomatic-complexity),
per function or method.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Lines:
    code: int = 0
    docstrings: int = 0
    comments: int = 0
    blank: int = 0

    @property
    def total(self) -> int:
        return self.code + self.docstrings + self.comments + self.blank

    def add(self, other: Lines) -> None:
        self.code += other.code
        self.docstrings += other.docstrings
        self.comments += other.comments
        self.blank += other.blank


def count_lines(source: str) -> Lines:
    """Physical lines of one module, split into code, docstrings, comments and blank."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        # attribute docstrings (a string right after an assignment) are documentation too
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for prev, cur in zip(body, body[1:]):
                if isinstance(prev, (ast.Assign, ast.AnnAssign)) and isinstance(cur, ast.Expr) \
                        and isinstance(cur.value, ast.Constant) and isinstance(cur.value.value, str):
                    doc.update(range(cur.lineno, (cur.end_lineno or cur.lineno) + 1))
    out = Lines()
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if number in doc:
            out.docstrings += 1
        elif not stripped:
            out.blank += 1
        elif stripped.startswith("#"):
            out.comments += 1
        else:
            out.code += 1
    return out


def packages(root: Path) -> dict[str, Path]:
    """The measured packages: statekit/, statekit_replicate/ (the plugin that ships with the
    core) and each plugin's source folder."""
    found = {"statekit": root / "statekit"}
    if (root / "statekit_replicate" / "__init__.py").exists():
        found["statekit_replicate"] = root / "statekit_replicate"
    for src in sorted(root.glob("plugins/*/src/*")):
        if src.is_dir() and (src / "__init__.py").exists():
            found[src.name] = src
    return found


def measure(root: Path, top: int) -> None:
    from radon.complexity import cc_visit  # noqa: PLC0415 - a benchmark dependency only

    rows = []
    worst = []
    grand = Lines()
    for name, folder in packages(root).items():
        total = Lines()
        for path in sorted(folder.rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            total.add(count_lines(source))
            for block in cc_visit(source):
                blocks = [block, *getattr(block, "methods", [])] if hasattr(block, "methods") else [block]
                for b in blocks:
                    if type(b).__name__ == "Function":
                        where = f"{path.relative_to(root)}:{b.lineno}"
                        qual = f"{b.classname}.{b.name}" if getattr(b, "classname", None) else b.name
                        worst.append((b.complexity, qual, where))
        grand.add(total)
        rows.append((name, total))
    print(f"{'package':<24}{'code':>8}{'docstrings':>12}{'comments':>10}{'blank':>8}{'total':>8}{'doc share':>11}")
    for name, t in [*rows, ("all", grand)]:
        share = t.docstrings / max(t.code + t.docstrings, 1)
        print(f"{name:<24}{t.code:>8}{t.docstrings:>12}{t.comments:>10}{t.blank:>8}{t.total:>8}{share:>10.0%}")
    worst = sorted(set(worst), key=lambda w: (-w[0], w[2]))  # radon lists a method with its class and alone
    at_20 = sum(1 for w in worst if w[0] >= 20)
    print(f"\nfunctions with cyclomatic complexity >= 20: {at_20}; the {top} highest:")
    for complexity, qual, where in worst[:top]:
        print(f"  {complexity:>4}  {qual:<40} {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--rev", help="measure this commit instead of the working tree")
    args = parser.parse_args()
    if args.rev is None:
        measure(ROOT, args.top)
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", args.rev],
                             check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp, filter="data")
        print(f"commit {args.rev}")
        measure(Path(tmp), args.top)


if __name__ == "__main__":
    sys.exit(main())
