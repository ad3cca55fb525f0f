"""Run Python code as if some modules were not installed (their files absent).

``python tests/without.py MODULE[,MODULE...] (-c CODE | -m MODULE | SCRIPT) [ARGS...]``

A meta-path finder placed first raises ``ModuleNotFoundError(name=MODULE)`` for each
hidden module, which is what the import system raises for a file that is not there,
in both forms: ``import pkg.ext`` raises it, and ``from pkg import ext`` turns it into
the plain ``ImportError("cannot import name ...")`` a missing file gives. (A
``sys.modules[MODULE] = None`` entry is not the same: a from-import special-cases it.)
Used by the tests of the package's optional C extensions, in fresh processes.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys


class Hide(importlib.abc.MetaPathFinder):
    """Finds nothing for the hidden modules, as if their files were absent."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    hidden = set(sys.argv[1].split(","))
    sys.meta_path.insert(0, Hide(hidden))
    for name in hidden:
        sys.modules.pop(name, None)
    what, rest = sys.argv[2], sys.argv[3:]
    if what == "-c":
        code, args = rest[0], rest[1:]
        sys.argv = ["-c", *args]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    elif what == "-m":
        sys.argv = [rest[0], *rest[1:]]
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [what, *rest]
        runpy.run_path(what, run_name="__main__")


if __name__ == "__main__":
    main()
