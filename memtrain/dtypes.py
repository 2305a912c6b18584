"""The recipe's dtype names and what they mean to torch: one table for the model, the planner and the loop."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
