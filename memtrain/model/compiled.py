"""`train.compile`: torch.compile each decoder layer of the model ("regional" compilation).

The matmuls already run in cuBLAS; what compiling a layer buys is the element-wise work between them —
RMSNorm's fp32 upcast, the rotary embedding, SwiGLU's SiLU and product, LoRA's dropout, scaling and
addition — fused into a few kernels, in forward, in backward and in checkpointed recomputation alike.
All decoder layers share one code object, so one compilation serves them all. Activation
checkpointing stays outside: transformers' checkpoint wrapper calls the compiled layer.
"""
from __future__ import annotations

from torch import nn

from memtrain.model.layers import decoder_layer_names, hf_model


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place (nn.Module.compile); returns how many were compiled."""
    modules = dict(hf_model(model).named_modules())
    names = decoder_layer_names(model)
    for name in names:
        modules[name].compile()
    return len(names)
