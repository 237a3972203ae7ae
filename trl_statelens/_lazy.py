"""Module attributes imported on first use (PEP 562), so light commands never import torch."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names (``exports``: name -> submodule) are
    imported on first access and then kept as plain module attributes."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(module, name, value)  # the next access does not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
