"""Package-level contracts: light import, one namespace, settings docs in sync."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from modelexpress import errors
from modelexpress.settings import MxSettings, write_env_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = ("torch", "nixl", "fastapi", "vllm", "uvicorn", "redis")


def test_import_modelexpress_is_light() -> None:
    code = ("import json, sys, modelexpress, modelexpress.errors, modelexpress.settings;"
            "print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    loaded = set(json.loads(out))
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


@pytest.mark.parametrize("module", ["modelexpress._cli_support", "modelexpress.p2p.cli",
                                    "modelexpress.demo"])
def test_cli_modules_do_not_import_each_other(module: str) -> None:
    # cli.py registers the commands of p2p/cli.py and demo.py; they share
    # _cli_support and never import cli.py (or each other) back.
    commands = {"modelexpress.cli", "modelexpress.p2p.cli", "modelexpress.demo"}
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert (set(json.loads(out)) & commands) - {module} == set()
    # ... not even lazily, inside a function
    import ast

    path = ROOT / (module.replace(".", "/") + ".py")
    imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Import) for alias in node.names}
    assert not (imported & commands), f"{module} imports {imported & commands}"


def test_mapped_packages_import_under_one_namespace() -> None:
    import modelexpress.engines.vllm
    import modelexpress.server
    assert pathlib.Path(modelexpress.server.__file__).parent == ROOT / "server"
    assert pathlib.Path(modelexpress.engines.vllm.__file__).parent == ROOT / "engines" / "vllm"


def test_every_error_derives_from_mxerror() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.MxError), name
        assert name in (errors.__doc__ or ""), f"{name} missing from the tree in the docstring"


def test_the_error_tree_in_the_docstring_is_the_class_tree() -> None:
    """Each class drawn under another in ``errors``' docstring derives from it (first
    base), so the drawing callers read to choose their ``except`` stays true."""
    import re
    parents: dict[int, str] = {}
    seen = 0
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^(\s*)(?:([│ ]*)[├└]── )?(\w+Error)\b", line)
        if not m:
            continue
        depth = 0 if m.group(2) is None else (len(m.group(2)) // 4 + 1)
        name = m.group(3)
        parents[depth] = name
        if depth:
            cls, parent = getattr(errors, name), getattr(errors, parents[depth - 1])
            assert cls.__bases__[0] is parent, f"{name} is drawn under {parents[depth - 1]}"
            seen += 1
    assert seen == len(errors.__all__) - 1  # every class but the root is drawn once


def test_deployment_env_table_matches_settings() -> None:
    doc = ROOT / "docs" / "DEPLOYMENT.md"
    assert write_env_table(doc, check=True), (
        "docs/DEPLOYMENT.md env table is stale: run python -m modelexpress.settings --write-docs")


def test_settings_read_env_and_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_VMM_ARENA", "1")
    monkeypatch.setenv("MX_SERVER_TOKEN", "s3cret")
    settings = MxSettings()
    assert settings.vmm_arena is True
    assert settings.server_token is not None
    assert settings.server_token.get_secret_value() == "s3cret"
    monkeypatch.setenv("MX_STORE", "postgres://x")
    with pytest.raises(Exception, match="sqlite:///"):
        MxSettings()


# What `modelexpress doctor` reports on a machine set up as CI is (`./dev setup`): every
# check, in print order, with the statuses it may have there.
DOCTOR_ON_CI = {
    "python": {"ok"},
    "torch": {"ok"},
    "/dev/shm": {"ok"},
    "vmm C extension": {"ok"},
    "CUDA VMM arena": {"info", "ok"},  # info: no GPU on CI; ok on an H200 host
    "vmm host self-test": {"ok"},
    "nixl": {"ok"},
    "nixl plugins": {"ok"},
    "ucx transports": {"ok"},
    "shm arena atomics": {"ok"},
    "shm arena round trip": {"ok"},
    "local host copy loop": {"ok"},
    "server deps": {"ok"},
    "control plane": {"info", "ok"},  # info: no server deployed at MX_SERVER_URL
    "vllm": {"ok"},
    "vllm shm arena": {"ok"},
}
# Checks of an optional dependency. Where it is missing they warn (or say "info"), and
# the test accepts that unless MX_REQUIRE_DEPS=1 (tests/conftest.py): CI sets it.
DOCTOR_OPTIONAL = {
    "vmm C extension": ("modelexpress.vmm._alloc_ext",),
    "local host copy loop": ("modelexpress.local._copyloop",),
    "nixl": ("nixl", "nixl_cu12", "nixl_cu13"),
    "nixl plugins": ("nixl", "nixl_cu12", "nixl_cu13"),
    "ucx transports": ("nixl", "nixl_cu12", "nixl_cu13"),
    "vllm": ("vllm",),
    "vllm shm arena": ("vllm",),
}


def _installed(*modules: str) -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in modules)


def test_doctor_reports_a_healthy_machine_and_exits_0() -> None:
    proc = subprocess.run([sys.executable, "-m", "modelexpress", "doctor", "--json"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    statuses = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert list(statuses) == list(DOCTOR_ON_CI), "a check is missing, extra or reordered"
    require = os.environ.get("MX_REQUIRE_DEPS") == "1"
    for name, allowed in DOCTOR_ON_CI.items():
        status, detail = statuses[name]
        if not require and not _installed(*DOCTOR_OPTIONAL.get(name, ("modelexpress",))):
            allowed = allowed | {"warn", "info"}
        assert status in allowed, f"doctor: {name} is {status} ({detail})"
    assert report["healthy"] is True
    assert proc.returncode == 0, proc.stderr[-2000:]


OPTIONAL_EXTENSIONS = {  # doctor check -> the compiled part it reports
    "vmm C extension": "modelexpress.vmm._alloc_ext",
    "shm arena atomics": "modelexpress.shm_arena._atomics",
    "local host copy loop": "modelexpress.local._copyloop",
}


def test_doctor_names_each_missing_extension_and_the_machine_stays_healthy() -> None:
    # Every C extension is optional: without them (tests/without.py hides their files)
    # doctor warns about each by name and what to do, and nothing required fails.
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "without.py"),
                           ",".join(OPTIONAL_EXTENSIONS.values()), "-m", "modelexpress",
                           "doctor", "--json"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    statuses = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    for check, module in OPTIONAL_EXTENSIONS.items():
        status, detail = statuses[check]
        assert status == "warn" and module in detail, (check, status, detail)
    assert statuses["vmm host self-test"][0] == "ok"  # the Python core took over
    assert statuses["shm arena round trip"][0] == "ok"  # ... and the fallback atomics
    assert report["healthy"] is True and proc.returncode == 0, proc.stderr[-2000:]


def test_identity_is_content_addressed_and_versionless() -> None:
    from modelexpress.identity import ModelIdentity

    a = ModelIdentity(model="m", tp_size=2, rank=1, extra=(("b", "2"), ("a", "1")))
    b = ModelIdentity(model="m", tp_size=2, rank=1, extra=(("a", "1"), ("b", "2")))
    assert a.id == b.id and len(a.id) == 32
    assert ModelIdentity.from_dict(a.to_dict()) == a
    assert "version" not in json.dumps(a.canonical())
    assert ModelIdentity(model="m", tp_size=2, rank=0).id != a.id
    with pytest.raises(errors.ConfigError, match="rank"):
        ModelIdentity(model="m", tp_size=2, rank=2)


# Where each mapped package's source lives (setup.py's package-dir mapping).
_SOURCE_ROOTS = {"modelexpress": "modelexpress", "modelexpress.server": "server",
                 "modelexpress.engines": "engines"}


def _project_modules() -> dict[str, pathlib.Path]:
    """Every project module by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for package, folder in _SOURCE_ROOTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _import_graph() -> dict[str, dict[str, str]]:
    """module -> {module it imports: "file:line"}, from every ``import`` and ``from``
    statement, at module level, under ``TYPE_CHECKING`` or inside a function alike.

    A name a package's ``__init__`` re-exports counts as an import of the module that
    defines it, and a package's ``__init__`` importing its own modules is no edge: a
    re-export ties nothing together.
    """
    import ast

    modules = _project_modules()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}

    def is_package(name: str) -> bool:
        return modules[name].name == "__init__.py"

    def owner(dotted: str) -> str | None:  # the project module a dotted name lives in
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def base(name: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = name.split(".")[:len(name.split(".")) - node.level + is_package(name)]
        return ".".join(parts + ([node.module] if node.module else []))

    reexports: dict[str, dict[str, str]] = {}
    for name, tree in trees.items():
        if is_package(name):
            reexports[name] = {alias.asname or alias.name: f"{base(name, node)}.{alias.name}"
                               for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                               for alias in node.names}

    def resolve_from(package: str, attr: str, hops: int = 0) -> str:
        target = owner(reexports.get(package, {}).get(attr, package)) or package
        if target != package and is_package(target) and hops < 8:
            return resolve_from(target, attr, hops + 1)
        return target

    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = base(name, node)
                for alias in node.names:
                    if f"{src}.{alias.name}" in modules:
                        targets.append(f"{src}.{alias.name}")
                    elif (found := owner(src)) is not None and is_package(found):
                        targets.append(resolve_from(found, alias.name))
                    else:
                        targets.append(owner(src))
            for target in targets:
                if target is None or target == name:
                    continue
                if is_package(name) and target.startswith(name + "."):
                    continue  # a package's face re-exporting its own modules
                where = f"{modules[name].relative_to(ROOT)}:{node.lineno}"
                graph[name].setdefault(target, where)
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, {}))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def _describe(graph: dict[str, dict[str, str]], cycles: list[list[str]]) -> str:
    lines = []
    for component in cycles:
        lines.append("circle: " + ", ".join(component))
        lines += [f"  {a} -> {b} ({graph[a][b]})" for a in component for b in graph[a]
                  if b in component]
    return "\n".join(lines)


def _part(module: str) -> str:
    """The part of the house a module belongs to: its subpackage (``modelexpress.p2p``,
    ``modelexpress.server``, ...) or, at the top, the module itself."""
    return ".".join(module.split(".")[:2])


def test_project_modules_import_each_other_in_one_direction() -> None:
    # Imports inside functions count: a lazy import back up is still a circle, and
    # the next change moves it to the top of the file.
    graph = _import_graph()
    assert "modelexpress.p2p.target" in graph and "modelexpress.server.store.base" in graph
    assert "modelexpress.p2p.result" in graph["modelexpress.p2p.target"]  # edges are read
    cycles = _cycles(graph)
    assert not cycles, "import circles between project modules:\n" + _describe(graph, cycles)


def test_packages_import_each_other_in_one_direction() -> None:
    # The same one level up: modules of p2p importing local while a local module imports
    # p2p (or settings importing a package that imports settings) is a layer that
    # reaches back up, even without a circle of files.
    parts: dict[str, dict[str, str]] = {}
    for module, targets in _import_graph().items():
        edges = parts.setdefault(_part(module), {})
        for target, where in targets.items():
            if _part(target) != _part(module):
                edges.setdefault(_part(target), f"{module} -> {target}, {where}")
    cycles = _cycles(parts)
    assert not cycles, "import circles between packages:\n" + _describe(parts, cycles)
