"""Bytes of quantised weights, constants included, in bitsandbytes' layout.

4-bit (nf4 / fp4), blocks of 64 weights:
  packed weights     one uint8 per two weights
  absmax             one scale per block: fp32, or with double quantisation uint8 codes of
                     (absmax - offset) in blocks of 256, plus an fp32 scale per 256 blocks,
                     the fp32 offset and the 256-entry fp32 code table of that second level
  code               the 16-entry fp32 code table of the 4-bit type, one per tensor
int8 (LLM.int8): one int8 per weight and one fp32 scale per output row.

Pure arithmetic, checked against the real tensors of a quantised model in tests/model/test_qlora.py.
"""

from __future__ import annotations

import dataclasses
import math

BLOCK_4BIT = 64  # bitsandbytes' default 4-bit blocksize (Params4bit / BitsAndBytesConfig)
BLOCK_NESTED = 256  # blocksize of the second level under double quantisation
FP32_BYTES = 4
CODE_4BIT_BYTES = 16 * FP32_BYTES
CODE_NESTED_BYTES = 256 * FP32_BYTES


def quantized_weight_bytes(numel: int, rows: int, quant_type: str, double_quant: bool) -> int:
    """Bytes one quantised weight matrix of `numel` elements and `rows` output rows occupies."""
    if quant_type == "int8":
        return numel + rows * FP32_BYTES
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"unknown quantisation type {quant_type!r}")
    packed = math.ceil(numel / 2)
    blocks = math.ceil(numel / BLOCK_4BIT)
    if double_quant:
        scales = blocks + math.ceil(blocks / BLOCK_NESTED) * FP32_BYTES + FP32_BYTES + CODE_NESTED_BYTES
    else:
        scales = blocks * FP32_BYTES
    return packed + scales + CODE_4BIT_BYTES


def with_quantized_params(states, counts, storage_bytes: int):
    """Model states with the GPU parameter term at the quantised size (unchanged without quantisation).

    Quantised recipes keep whole parameters on each GPU (ZeRO-0..2; checks refuse ZeRO-3 and
    parameter offload), so the term is the model's weight bytes.
    """
    if not counts.quantized:
        return states
    return dataclasses.replace(states, gpu_params=counts.weight_bytes(storage_bytes))
