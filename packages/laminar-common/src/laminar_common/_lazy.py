"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists ``name -> submodule`` once; ``from pkg import name`` imports
the submodule on first use, so ``import laminar_common`` stays cheap and a
CLI's ``--help`` never pays for zmq, grpc or etcd.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` exporting ``exports``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
