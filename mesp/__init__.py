"""mesp: exact-gradient LoRA fine-tuning in a small, fixed memory budget (MeSP in PyTorch)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["patch", "unpatch"]
__version__ = "0.1.0"


class _Package(types.ModuleType):
    """`mesp.patch` / `mesp.unpatch` are the functions of the mesp.patch module, imported on first
    use: importing a submodule (`mesp.runner` must not load mesp's model code) stays light.
    Binding the submodule itself to the name `patch` (the import system does so when mesp.patch
    is first imported) is ignored, so `mesp.patch(model)` keeps calling the function."""

    @property
    def patch(self) -> Any:
        return importlib.import_module("mesp.patch").patch

    @patch.setter
    def patch(self, value: Any) -> None:
        pass

    @property
    def unpatch(self) -> Any:
        return importlib.import_module("mesp.patch").unpatch


sys.modules[__name__].__class__ = _Package
