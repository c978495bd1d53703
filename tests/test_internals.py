"""Other libraries' private parts mpp relies on (mpp.internals): each still there as mpp uses it, and
nothing outside that module reaches into another library's private names."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from mpp.internals import RELIED_ON, Reliance, changed

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("reliance", RELIED_ON, ids=[f"{r.library}: {r.what}" for r in RELIED_ON])
def test_each_private_part_mpp_relies_on_is_still_there(reliance: Reliance) -> None:
    assert reliance.problem() == "", f"{reliance.problem()}: mpp.internals says why mpp needs it; find another way"


def test_a_change_is_named_with_its_library_and_user() -> None:
    gone = Reliance("somelib", "Thing._private", "mpp.somewhere", lambda: "Thing has no _private")
    assert gone.problem() == "somelib: Thing._private (mpp.somewhere) changed: Thing has no _private"
    environment = dict(os.environ)
    assert changed() == []
    # The probes leave this process as they found it: a W&B service left running, named in WANDB_SERVICE,
    # would be shared by the runs the process starts later (a killed run's id then stays "in use").
    assert dict(os.environ) == environment


def test_the_probes_leave_a_service_that_was_running_before_them_running(tmp_path: Path) -> None:
    # A run finished without teardown leaves its service up and named in WANDB_SERVICE, as a test or a
    # notebook may before the probes run: the probes must neither stop it nor leave its name dangling.
    import wandb

    named_before = "WANDB_SERVICE" in os.environ
    wandb.init(mode="offline", dir=tmp_path, settings=wandb.Settings(silent=True)).finish()
    try:
        service = os.environ["WANDB_SERVICE"]
        assert changed() == []
        assert changed() == []
        assert os.environ["WANDB_SERVICE"] == service
        wandb.init(mode="offline", dir=tmp_path, settings=wandb.Settings(silent=True)).finish()
    finally:
        wandb.teardown()
    assert named_before or "WANDB_SERVICE" not in os.environ


def private_uses(path: Path) -> list[str]:
    """`x._name` attributes of objects other than self and cls, and `from lib import _name`, in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("mpp"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls", "os", "sys")):
                found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "__wrapped__":
            found.append(f"line {node.lineno}: .__wrapped__")
        is_getattr = (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
        )
        if is_getattr and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
                found.append(f"line {node.lineno}: {node.func.id} {name}")
    return found


def defined_in_mpp(files: list[Path]) -> set[str]:
    """The underscored names mpp defines: functions, classes, and attributes it assigns."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_")}


def inherited_private_uses(path: Path, own: set[str]) -> list[str]:
    """`self._name` where mpp defines no `_name`: a private part of a class it subclasses."""
    return [f"line {node.lineno}: self.{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            and node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own]  # fmt: skip


def test_no_module_but_mpp_internals_reaches_into_another_librarys_private_parts() -> None:
    """An mpp module's own underscored names are its business; these are the forms that reach into
    other objects, or into the classes mpp subclasses. A namedtuple's `_replace`, `_fields` and
    `_asdict` are its public interface."""
    public = (".\u005freplace", ".\u005fasdict", "hasattr _fields")
    files = sorted((ROOT / "mpp").rglob("*.py"))
    own, found = defined_in_mpp(files), {}
    for path in files:
        if path.name == "internals.py":
            continue
        uses = [use for use in private_uses(path) if not use.endswith(public)] + inherited_private_uses(path, own)
        if uses:
            found[str(path.relative_to(ROOT))] = uses
    assert found == {}, "private parts of other libraries outside mpp/internals.py"


def test_the_search_finds_each_form_of_reaching_in(tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    path.write_text(
        "from lib import _hidden\n"
        "class Bar(Base):\n"
        "    def go(self, loop):\n"
        "        self._mine = loop._combined_loader\n"
        "        getattr(loop, '_fetcher')\n"
        "        return self._should_update(self._mine, f.__wrapped__)\n"
    )
    assert private_uses(path) == [
        "from lib import _hidden",
        "line 4: ._combined_loader",
        "line 5: getattr _fetcher",
        "line 6: .__wrapped__",
    ]
    assert inherited_private_uses(path, defined_in_mpp([path])) == ["line 6: self._should_update"]
