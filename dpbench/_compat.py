"""Make torchvision importable when its compiled ops do not match the installed torch.

The torchvision wheels on PyPI are built against CUDA torch. Beside a CPU-only torch build their
compiled extension cannot load, and `import torchvision` then dies registering fake kernels for
ops that were never defined ("operator torchvision::nms does not exist"). timm imports
torchvision, so this would take the whole CLI down. dpbench uses none of torchvision's compiled
ops (only its dataset readers and pure-Python models), so in that one situation we skip the two
registration modules and import the rest. Nothing happens when torchvision imports cleanly.
"""

from __future__ import annotations

import importlib
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


_import_torchvision_without_compiled_ops()
