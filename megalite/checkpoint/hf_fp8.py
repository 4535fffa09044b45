"""Block-scaled FP8 Hugging Face checkpoints (DeepSeek-V3's released form), both ways.

A quantised weight W [rows, cols] is stored as ``<name>.weight`` in float8_e4m3fn beside a float32
``<name>.weight_scale_inv`` [ceil(rows / b0), ceil(cols / b1)] for the blocks of b0 x b1 elements
(config.json's ``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [b0, b1]``, 128 x 128
for DeepSeek-V3); the last row and column of blocks may be ragged. The weight is

    W = fp8.float() * scale_inv, each block's scale repeated over its elements.

Import dequantises each weight as it is read (hf_weights.HFWeights opens the shards memory-mapped and reads
tensor by tensor) into the model's dtype. Export writes the weights as they are, or, with
``--export-fp8-blocks``, quantises every linear projection of the layers (not the embeddings, output head,
norms, router or MTP input projection) with scale = amax / 448 per block (448: float8_e4m3fn's largest
finite value; an all-zero block has scale 1) and writes DeepSeek's quantization_config.
"""
from __future__ import annotations

import math
import re

import torch

from megalite.errors import UserError

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max        # 448
SCALE_SUFFIX = "_scale_inv"                            # weight -> weight_scale_inv
DEFAULT_BLOCK = (128, 128)
# the tensors an FP8 export quantises: the layers' linear projections (attention, MLA's kv_a_proj_with_mqa
# included, dense MLP, experts, shared experts), not the MTP module's eh_proj, which DeepSeek keeps in bf16
# like the router and norms
QUANTISED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight$")


def quantization_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """config.json's quantization_config of a block-scaled FP8 checkpoint, as DeepSeek writes it."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def block_size(config) -> tuple[int, int] | None:
    """The (b0, b1) blocks of an HF config's FP8 quantization_config; None without one; a one-line error
    for another quantisation method."""
    quantization = getattr(config, "quantization_config", None)      # probe: set only on a quantised model
    if not quantization:
        return None
    q = quantization if isinstance(quantization, dict) else quantization.to_dict()
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not (isinstance(block, (list, tuple)) and len(block) == 2
                                              and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{config.model_type} quantization_config ({q.get('quant_method')}, weight_block_size "
                        f"{block}) is not supported: megalite reads block-scaled FP8 (quant_method fp8, "
                        "weight_block_size [rows, cols])")
    return int(block[0]), int(block[1])


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor | None, block: tuple[int, int] | None, name: str,
               dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``weight`` times its per-block ``scale_inv``, in ``dtype``; one-line errors naming the tensor."""
    if block is None:
        raise UserError(f"{name} is float8 but config.json has no quantization_config with weight_block_size; "
                        "the checkpoint's config does not describe its FP8 weights")
    if scale_inv is None:
        raise UserError(f"FP8 tensor {name} has no scale tensor {scale_name(name)}; the checkpoint is incomplete")
    expected = scale_shape(weight.shape, block) if weight.dim() == 2 else None
    if expected is None or tuple(scale_inv.shape) != expected:
        raise UserError(f"scale tensor {scale_name(name)} has shape {list(scale_inv.shape)}, but {name} "
                        f"{list(weight.shape)} in {block[0]}x{block[1]} blocks needs "
                        f"{list(expected) if expected else 'a 2-D weight'}")
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of a 2-D weight, scale = amax / 448 per block (ragged
    edge blocks padded with zeros, which change no amax)."""
    rows, cols = weight.shape
    r, c = scale_shape(weight.shape, block)
    padded = torch.zeros(r * block[0], c * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(r, block[0], c, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return fp8.view(r * block[0], c * block[1])[:rows, :cols].contiguous(), scale


def quantize_checkpoint(tensors: dict[str, torch.Tensor], block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """An exported checkpoint's tensors with the QUANTISED ones as FP8 and their scales added."""
    out = {}
    for name, tensor in tensors.items():
        if QUANTISED.match(name) and tensor.dim() == 2:
            out[name], out[scale_name(name)] = quantize(tensor, block)
        else:
            out[name] = tensor
    return out
