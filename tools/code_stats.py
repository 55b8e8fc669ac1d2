"""Sizes of the library code: the largest modules and functions under ``packages/``.

    python tools/code_stats.py [--top 15] [--root packages]

Lines are counted as in the file (blank lines and comments included). Functions are found by
indentation: a ``def``, ``cdef``, ``cpdef`` or ``class`` line opens a block that ends at the
next line indented no deeper (Python and Cython alike; nested functions count inside their
parent and on their own). Vendored C and generated files are left out.
"""

from __future__ import annotations

import argparse
import os
import re

_OPEN = re.compile(r"^(\s*)(?:async\s+)?(?:class|c?p?def(?:\s+class)?)\s+(?:[\w\[\], *]+?\s+)?\**(\w+)\s*[(:]")


def _modules(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("build", "_vendor", "__pycache__") and not x.endswith(".egg-info")]
        out += [os.path.join(d, f) for f in files if f.endswith((".py", ".pyx", ".pxd", ".h"))]
    return sorted(out)


def _functions(path: str) -> list[tuple[int, str]]:
    lines = open(path, encoding="utf-8").read().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _OPEN.match(line)
        if not m or path.endswith((".pxd", ".h")):
            continue
        indent = len(m.group(1))
        end = i + 1
        for j in range(i + 1, len(lines)):
            s = lines[j]
            if s.strip() and not s.lstrip().startswith("#") and len(s) - len(s.lstrip()) <= indent:
                break
            end = j + 1
        while end > i + 1 and not lines[end - 1].strip():
            end -= 1
        found.append((end - i, f"{m.group(2)}"))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", "packages"))
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    root = os.path.abspath(a.root)
    mods = [(sum(1 for _ in open(f, encoding="utf-8")), os.path.relpath(f, root)) for f in _modules(root)]
    funcs = [(n, f"{os.path.relpath(f, root)}:{name}") for f in _modules(root) for n, name in _functions(f)]
    total = sum(n for n, _ in mods)
    print(f"{len(mods)} modules, {total} lines; {len(funcs)} functions and classes")
    print("\nlargest modules (lines):")
    for n, name in sorted(mods, reverse=True)[:a.top]:
        print(f"  {n:6d}  {name}")
    print("\nlargest functions (lines; classes excluded):")
    shown = 0
    for n, name in sorted(funcs, reverse=True):
        path = name.split(":")[0]
        text = open(os.path.join(root, path), encoding="utf-8").read()
        if re.search(rf"^\s*(?:cdef\s+)?class\s+{re.escape(name.split(':')[1])}\b", text, re.M):
            continue
        print(f"  {n:6d}  {name}")
        shown += 1
        if shown == a.top:
            break


if __name__ == "__main__":
    main()
