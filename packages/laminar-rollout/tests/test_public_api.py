"""The package's public names: every one in ``__all__`` imports, and the package is typed."""

import importlib
from pathlib import Path

PACKAGE = "laminar_rollout"


def test_every_public_name_imports_and_the_package_is_typed():
    module = importlib.import_module(PACKAGE)
    assert module.__all__ and len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert (Path(module.__file__).parent / "py.typed").is_file()
