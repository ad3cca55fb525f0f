"""Every ``MxSettings`` field is read by the code: no setting declared, documented and ignored.

The scan reads the source of ``modelexpress/``, ``server/`` and ``engines/``
(``modelexpress/settings.py`` itself excluded; comments and docstrings are not code,
so the syntax tree is scanned, not the text). A field counts as read where an
expression reads it as an attribute of a settings object: a name or attribute
ending in ``settings`` (``settings.x``, ``self._settings.x``,
``self.options.settings.x``), a name annotated or assigned as ``MxSettings``
(``s: MxSettings`` ... ``s.x``), or ``MxSettings(...).x``; ``getattr(settings, "x")``
counts too. Another object's attribute of the same name (``self.store``) does not.
"""

from __future__ import annotations

import ast
import pathlib

from modelexpress.settings import MxSettings

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("modelexpress", "server", "engines")
DECLARED_IN = ROOT / "modelexpress" / "settings.py"

# Fields consumed without an attribute read in our code (e.g. handed whole to
# pydantic or uvicorn). Empty today: server/serve.py passes server_host,
# server_port and log_level to uvicorn.run as ``settings.<field>``, and
# server/app.py reads the store, token and timeouts the same way. An entry here
# must say who consumes the field.
CONSUMED_ELSEWHERE: dict[str, str] = {}

# Declared and documented, but read nowhere yet. Each entry is a known gap with the
# change that closes it; the test below fails once the field is read, so the entry
# is removed with that change.
KNOWN_UNWIRED: dict[str, str] = {}


def _is_settings_type(node: ast.expr | None) -> bool:
    """``MxSettings``, ``MxSettings | None``, ``"MxSettings"`` and the like."""
    if node is None:
        return False
    return "MxSettings" in ast.unparse(node)


def _settings_names(tree: ast.AST) -> set[str]:
    """Names bound to a settings object in a module: annotated or assigned ``MxSettings``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _is_settings_type(node.annotation):
            names.add(node.arg)
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and _is_settings_type(node.annotation)):
            names.add(node.target.id)
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and _is_settings_type(node.value.func)):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_settings_object(node: ast.expr, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names or node.id.lower().endswith("settings")
    if isinstance(node, ast.Attribute):
        return node.attr.lower().endswith("settings")
    if isinstance(node, ast.Call):
        return _is_settings_type(node.func)
    return False


def settings_read(paths: list[pathlib.Path], root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    """Field -> ``path:line`` (relative to ``root``) of each read of it in ``paths``."""
    fields = set(MxSettings.model_fields)
    reads: dict[str, list[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _settings_names(tree)
        for node in ast.walk(tree):
            field = None
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and _is_settings_object(node.value, names)):
                field = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "getattr" and len(node.args) >= 2
                  and _is_settings_object(node.args[0], names)
                  and isinstance(node.args[1], ast.Constant)):
                field = node.args[1].value
            if field in fields:
                where = f"{path.relative_to(root)}:{node.lineno}"
                reads.setdefault(field, []).append(where)
    return reads


def _sources() -> list[pathlib.Path]:
    paths = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))
             if p != DECLARED_IN]
    assert len(paths) > 20, f"the scan found only {len(paths)} files under {SCANNED}"
    return paths


def test_every_setting_is_read_by_the_code() -> None:
    reads = settings_read(_sources())
    exempt = CONSUMED_ELSEWHERE.keys() | KNOWN_UNWIRED.keys()
    unread = sorted(f for f in MxSettings.model_fields if f not in reads and f not in exempt)
    assert not unread, (
        f"MxSettings fields read nowhere in {', '.join(SCANNED)}: {unread}. Read each where "
        "its options are built (e.g. AgentOptions.from_settings), or remove it.")


def test_known_unwired_settings_are_still_unwired() -> None:
    reads = settings_read(_sources())
    wired = {f: reads[f] for f in KNOWN_UNWIRED if f in reads}
    assert not wired, f"now read, remove from KNOWN_UNWIRED: {wired}"


def test_exemption_lists_name_real_fields() -> None:
    fields = set(MxSettings.model_fields)
    assert set(CONSUMED_ELSEWHERE) <= fields and set(KNOWN_UNWIRED) <= fields
    assert not set(CONSUMED_ELSEWHERE) & set(KNOWN_UNWIRED)


def test_the_scan_counts_only_reads_of_a_settings_object(tmp_path: pathlib.Path) -> None:
    # What a read is, on a file written for the purpose: the scan must not be
    # satisfied by another object's attribute of the same name, a comment or a
    # docstring, and must see every form of read listed in the module docstring.
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""settings.vmm_arena in a docstring is not a read."""\n'
        "from modelexpress.settings import MxSettings\n"
        "def f(s: MxSettings, other):\n"
        "    # settings.store in a comment is not a read\n"
        "    other.gc_after_s = other.stale_after_s  # another object\n"
        "    return s.log_level, getattr(s, 'server_port')\n"
        "class Loader:\n"
        "    def g(self):\n"
        "        return self._settings.server_url, self.options.settings.client_retries\n"
        "def h():\n"
        "    cfg = MxSettings()\n"
        "    return cfg.server_host, MxSettings().store\n")
    reads = settings_read([sample], root=tmp_path)
    assert set(reads) == {"log_level", "server_port", "server_url", "client_retries",
                          "server_host", "store"}
