"""The lock (requirements.lock): `make install` installs exactly the versions it names, and it names every
package mpp and its tests need (torch aside: the Makefile's TORCH chooses its build), and no other."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
TORCH_FAMILY = re.compile(r"torch|triton|nvidia-.*")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pins = [line for line in lines if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", pin) for pin in pins), "a lock line is not name==version"
    return {canonical(pin.split("==")[0]): pin.split("==")[1] for pin in pins}


def needed(name: str = "mpp", extras: tuple[str, ...] = ("test",), found: set[str] | None = None) -> set[str]:
    """The installed distributions `name` needs with `extras`, and what they need, and so on."""
    found = set() if found is None else found
    for line in metadata.requires(name) or []:
        requirement = Requirement(line)
        if requirement.marker and not any(requirement.marker.evaluate({"extra": e}) for e in extras or ("",)):
            continue
        key = canonical(requirement.name)
        if key not in found:
            found.add(key)
            needed(requirement.name, tuple(requirement.extras), found)
    return found


def test_the_makefile_installs_with_the_lock_as_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PIP) install -r requirements.lock\n\t$(PIP) install --no-deps -e ." in makefile
    assert re.search(r"^\$\(VENV\)/\.installed: .*requirements\.lock", makefile, re.M)
    assert re.search(r"^lock:", makefile, re.M)


def test_the_lock_names_what_mpp_and_its_tests_need_and_nothing_else() -> None:
    pins, wanted = locked(), {name for name in needed() if not TORCH_FAMILY.fullmatch(name)}
    assert not wanted - set(pins), f"not in requirements.lock (run `make lock`): {sorted(wanted - set(pins))}"
    assert not set(pins) - wanted, f"in requirements.lock but needed by nothing: {sorted(set(pins) - wanted)}"


@pytest.mark.skipif(not (Path(sys.prefix) / ".installed").exists(), reason="an environment `make install` did not make")
def test_make_install_installed_exactly_the_locked_versions() -> None:
    differ = {name: (version, metadata.version(name)) for name, version in locked().items()
              if metadata.version(name) != version}  # fmt: skip
    assert not differ, f"installed versions differ from requirements.lock (locked, installed): {differ}"
