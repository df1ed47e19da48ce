"""The public surface is deliberate: each package's ``__all__`` lists exactly its public names.

Like httpx's test_exported_members: a name added to a package without ``__all__`` (or left in
``__all__`` after it was removed) fails here, and so does an import that drags torch into
``import lorafleet``.
"""

from __future__ import annotations
import __future__

import importlib
import subprocess
import sys
import types

import pytest

PACKAGES = [
    "lorafleet",
    "lorafleet.publisher",
    "lorafleet.bundle",
    "lorafleet.errors",
    "lorafleet.front",
    "lorafleet.clients",
]


def _public_names(module: types.ModuleType) -> list[str]:
    """Names the module defines or re-exports: not private, not a submodule, not an import
    from outside lorafleet (``typing.Any``, ``collections.abc.Mapping``...)."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") and name != "__version__":
            continue
        if isinstance(value, (types.ModuleType, __future__._Feature)):
            continue
        origin = getattr(value, "__module__", None)
        if isinstance(value, (type, types.FunctionType)) and not (origin or "").startswith(
            "lorafleet"
        ):
            continue
        if origin == "typing":  # ClassVar, Any...: special forms are neither types nor functions
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_all_lists_exactly_the_public_names(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:  # a lazily loaded name (PEP 562) joins vars() once looked up
        getattr(module, name)
    assert module.__all__ == sorted(_public_names(module))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_importable(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_top_level_surface() -> None:
    import lorafleet
    from lorafleet.bundle import AdapterBundle
    from lorafleet.errors import LorafleetError
    from lorafleet.publisher import AsyncPublisher, Publisher, PublishResult

    assert lorafleet.Publisher is Publisher and lorafleet.AsyncPublisher is AsyncPublisher
    assert lorafleet.AdapterBundle is AdapterBundle and lorafleet.PublishResult is PublishResult
    assert lorafleet.LorafleetError is LorafleetError
    assert isinstance(lorafleet.__version__, str)


def test_import_lorafleet_does_not_import_torch() -> None:
    # Every top-level name, not just the package: they load lazily.
    code = "import sys, lorafleet; [getattr(lorafleet, n) for n in lorafleet.__all__]; " + (
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
