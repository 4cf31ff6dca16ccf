"""Make torchvision importable when its compiled ops do not match the installed torch.

The torchvision wheels on PyPI are built against CUDA torch. Beside a CPU-only torch build their
compiled extension cannot load, and `import torchvision` then dies registering fake kernels for
ops that were never defined ("operator torchvision::nms does not exist"). timm imports
torchvision, so this would take the whole CLI down. dpbench uses none of torchvision's compiled
ops (only its dataset readers and pure-Python models), so in that one situation we skip the two
registration modules and import the rest. Nothing happens when torchvision imports cleanly.

The shim waits for the first `import torchvision` (by timm, transformers or dpbench itself): importing
dpbench imports no torch, so `dpbench --help` and a refused config answer in well under a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

_REGISTRATION_MODULES = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


def _import_torchvision_without_compiled_ops() -> None:
    try:
        importlib.import_module("torchvision")
        return
    except ModuleNotFoundError:
        return  # not installed: whoever needs it reports that
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    for name in _REGISTRATION_MODULES:
        sys.modules[name] = types.ModuleType(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("torchvision")


class _ShimOnFirstImport:
    """A meta path finder that finds nothing itself: the first `import torchvision` anywhere goes
    through _import_torchvision_without_compiled_ops, then gets the module it imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _import_torchvision_without_compiled_ops()
        module = sys.modules.get("torchvision")
        return None if module is None else importlib.util.spec_from_loader(name, _Imported(module))


class _Imported:
    """The loader of a module that is already imported: hands it over unchanged."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # the import system stamped ours on it


if "torchvision" not in sys.modules and not any(isinstance(f, _ShimOnFirstImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShimOnFirstImport())
