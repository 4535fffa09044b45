"""Block-scaled FP8 checkpoints (megalite/checkpoint/hf_fp8.py): quantise and dequantise against a
block-by-block reference written here, ragged edge blocks, the import of an FP8 checkpoint against its
dequantised twin, --export-fp8-blocks, and the one-line errors naming the tensor."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpoint.files import CheckpointReader
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_fp8 import dequantize, quantize
from megalite.errors import UserError
from unit.checkpoint.test_convert_checkpoint import TOOL, make_hf

SHAPES = [(256, 128), (300, 200), (5, 7), (129, 257)]


def reference_quantize(w, b0, b1):
    """One block at a time: s = amax / 448, q = fp8(block / s), and back."""
    rows, cols = w.shape
    scales = torch.empty(math.ceil(rows / b0), math.ceil(cols / b1))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    back = torch.empty(rows, cols)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            s = block.abs().max() / 448.0
            s = s if s > 0 else torch.tensor(1.0)
            scales[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (block / s).to(torch.float8_e4m3fn)
            back[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() * s
    return q, scales, back


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (16, 8)])
def test_quantise_dequantise_match_the_block_by_block_reference(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[1])
    w[: block[0], : block[1]] = 0                       # an all-zero block keeps scale 1
    q, scale = quantize(w, block)
    ref_q, ref_scale, ref_back = reference_quantize(w, *block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    back = dequantize(q, scale, block, "w", torch.float32)
    assert torch.equal(back, ref_back)
    assert (back - w).abs().max() <= w.abs().max() / 8       # e4m3: 3 mantissa bits, relative error <= 1/16


def test_dequantise_expands_each_scale_over_its_ragged_block():
    q = torch.ones(5, 7).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    back = dequantize(q, scale, (4, 4), "w", torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert back[3, 3] == 1 and back[3, 4] == 2 and back[4, 3] == 3 and back[4, 6] == 4


@pytest.mark.parametrize("scale, block, message", [
    (None, (4, 4), "FP8 tensor w has no scale tensor w_scale_inv"),
    (torch.ones(2, 1), (4, 4), r"scale tensor w_scale_inv has shape \[2, 1\], but w \[5, 7\] in 4x4 blocks needs \[2, 2\]"),
    (torch.ones(2, 2), None, "w is float8 but config.json has no quantization_config"),
])
def test_bad_scales_are_one_line_errors_naming_the_tensor(scale, block, message):
    with pytest.raises(UserError, match=message) as error:
        dequantize(torch.ones(5, 7).to(torch.float8_e4m3fn), scale, block, "w", torch.float32)
    assert "\n" not in str(error.value)


def fp8_twin(tmp_path):
    """A tiny Llama exported with --export-fp8-blocks, and the same model with those weights dequantised."""
    make_hf(str(tmp_path / "hf"), "llama_mqa_untied")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    result = subprocess.run([sys.executable, TOOL, "--from", "megalite", "--to", "hf", "--input", str(tmp_path / "ckpt"),
                             "--output", str(tmp_path / "fp8"), "--export-fp8-blocks"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fp8 = str(tmp_path / "fp8")
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    twin = {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}
    for name, t in twin.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"]
            twin[name] = t.float() * scale.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
    os.makedirs(tmp_path / "twin")
    save_file(twin, str(tmp_path / "twin" / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(fp8, "config.json")))
    json.dump({k: v for k, v in config.items() if k != "quantization_config"}, open(tmp_path / "twin" / "config.json", "w"))
    return fp8, str(tmp_path / "twin"), tensors, config


def test_fp8_export_and_import_equal_the_dequantised_twin(tmp_path):
    fp8, twin, tensors, config = fp8_twin(tmp_path)
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    quantised = sorted(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    assert quantised and all(".self_attn." in n or ".mlp." in n for n in quantised)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32          # embeddings, norms, head stay
    for n in quantised:                                                          # 64 x 176: ragged blocks
        assert tensors[n + "_scale_inv"].shape == tuple(math.ceil(d / 128) for d in tensors[n].shape)
    a, b = (CheckpointReader(hf_to_megalite(d, str(tmp_path / f"m_{i}"))) for i, d in enumerate((fp8, twin)))
    assert sorted(a.names()) == sorted(b.names())
    assert all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.names())


def test_fp8_checkpoint_with_a_missing_or_misshaped_scale_is_refused(tmp_path):
    fp8, _, tensors, _ = fp8_twin(tmp_path)
    name = next(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    broken = dict(tensors)
    broken[name + "_scale_inv"] = torch.ones(2, 2)
    save_file(broken, os.path.join(fp8, "model.safetensors"))
    result = subprocess.run([sys.executable, TOOL, "--from", "hf", "--to", "megalite", "--input", fp8,
                             "--output", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"scale tensor {name}_scale_inv has shape [2, 2]" in result.stderr
    del broken[name + "_scale_inv"]
    save_file(broken, os.path.join(fp8, "model.safetensors"))
    with pytest.raises(UserError, match=f"FP8 tensor {name} has no scale tensor {name}_scale_inv"):
        hf_to_megalite(fp8, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
