"""Make the registry's torchvision importable beside a CPU torch (the vLLM venv, `make test-vllm`).

vLLM's Qwen-VL models import transformers' torchvision image processor at module level, and transformers imports
torchvision whenever it is installed. The torchvision the package registry serves for torch 2.13 is a CUDA build:
its C++ ops (`_C.so`) cannot load beside CPU torch, torchvision notices that (`extension._has_ops()` is False), but
two fake-kernel registrations in its `_meta_registrations.py` are not guarded by that check and fail the import
(`operator torchvision::nms does not exist`), so every `import transformers.image_utils` fails. Defining those two
operators' schemas (no kernels) first lets the import finish; the pure-Python transforms the processors use work,
and a call to nms still fails, saying the C++ ops are missing.

Called when vlmrl is imported (vlmrl/__init__.py), before anything imports transformers: without torchvision
installed (the default venv) it only looks the package up; where torchvision imports by itself it changes nothing.
"""

from __future__ import annotations

import importlib.util
import sys

# torchvision/_meta_registrations.py registers fake kernels for these two without checking that its ops loaded.
UNGUARDED_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library holding the schemas, kept alive for the process


def make_torchvision_importable() -> str:
    """'absent' (not installed), 'native' (imports as it is) or 'schemas' (imported after defining UNGUARDED_OPS)."""
    global _library
    if _library is not None:
        return "schemas"
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        return "absent"
    try:
        import torchvision  # noqa: F401

        return "native"
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package: the import runs again from the start
    library = torch.library.Library("torchvision", "DEF")
    for schema in UNGUARDED_OPS:
        library.define(schema)
    _library = library
    import torchvision  # noqa: F401, F811

    return "schemas"
