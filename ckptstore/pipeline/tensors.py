"""torch's side of the dtype registry, for the faces that build torch tensors themselves.

Part of the engine's interface (docs/design.md, "The engine's interface"). Importing this
module imports torch; the DCP and Lightning faces and the tensor-object adapters do, and only
they.
"""

from __future__ import annotations

from ckptstore.stage.torch import dtype_table, numpy_dtype, tensor_from_numpy, torch_dtype

__all__ = ["dtype_table", "numpy_dtype", "tensor_from_numpy", "torch_dtype"]
