"""The Hugging Face conversion writes part by part: each file it writes holds at most one layer's tensors
once files are small, the tensors of a written file are freed before the next part is converted, and the
several files load (megalite: load_model; Hugging Face: from_pretrained of the shards) with the logits and
tensors of the one-file conversion."""
import json
import os
import weakref

import pytest
import torch

from megalite.checkpoint import hf_shards
from megalite.checkpoint.files import CheckpointReader
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from megalite.checkpoint.hf_weights import HFWeights
from megalite.checkpoint.sharded import load_model

transformers = pytest.importorskip("transformers")
LAYERS, HIDDEN, FFN, VOCAB = 12, 512, 1024, 128


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def layer_bytes() -> int:
    """One layer's tensors, fp32: qkv (8 + 2 * 4 heads of 64), proj, fc1 (gate; up), fc2 and two norms."""
    return 4 * (HIDDEN * (16 * 64) + HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN)


class Recorder:
    """Wraps a writer: records the bytes of each write, and keeps only weak references to the tensors it
    was given, so that ``check_freed`` (called at each write and at each read of the source) finds any
    that the converter still holds."""

    def __init__(self, write, tensors_of):
        self.write, self.tensors_of, self.sizes, self.earlier = write, tensors_of, [], []

    def check_freed(self):
        alive = [name for name, ref in self.earlier if ref() is not None]
        assert not alive, f"still held while the next part is converted: {alive[:3]}"

    def __call__(self, *args, **kwargs):
        tensors = self.tensors_of(args)
        self.check_freed()
        self.sizes.append(hf_shards.tensor_bytes(tensors))
        self.earlier += [(name, weakref.ref(t)) for name, t in tensors.items()]
        return self.write(*args, **kwargs)

    def checking_before(self, read):
        def checked(*args, **kwargs):
            self.check_freed()
            return read(*args, **kwargs)
        return checked


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


def test_import_writes_one_layer_at_a_time_and_loads_as_one_file(hf_dir, tmp_path, monkeypatch):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    one = CheckpointReader(hf_to_megalite(hf_dir, str(tmp_path / "one")))
    monkeypatch.setattr(hf_shards, "SHARD_BYTES", 1)               # every part is a file of its own
    recorder = Recorder(hf_shards.write_tensor_file, lambda args: args[2])
    monkeypatch.setattr(hf_shards, "write_tensor_file", recorder)
    monkeypatch.setattr(HFWeights, "take", recorder.checking_before(HFWeights.take))
    many = CheckpointReader(hf_to_megalite(hf_dir, str(tmp_path / "many")))

    assert len(recorder.sizes) == LAYERS + 2                       # embedding, each layer, norm + head
    assert max(recorder.sizes) == layer_bytes()
    assert len(one.metadata["files"]) == 1 and len(many.metadata["files"]) == LAYERS + 2
    assert sorted(one.names()) == sorted(many.names())
    assert all(torch.equal(one.tensor(n), many.tensor(n)) and one.dtype(n) == many.dtype(n) for n in one.names())
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    ours = logits(load_model(many.directory), ids)
    assert torch.equal(ours, logits(load_model(one.directory), ids))
    torch.testing.assert_close(ours, logits(reference, ids).logits, atol=1e-4, rtol=1e-4)


def test_export_writes_hf_shards_one_layer_at_a_time(hf_dir, tmp_path, monkeypatch):
    ckpt = hf_to_megalite(hf_dir, str(tmp_path / "ckpt"))
    one = megalite_to_hf(ckpt, str(tmp_path / "one"))
    from safetensors import torch as safetensors_torch
    monkeypatch.setattr(hf_shards, "SHARD_BYTES", 1)
    recorder = Recorder(safetensors_torch.save_file, lambda args: args[0])
    monkeypatch.setattr(safetensors_torch, "save_file", recorder)
    monkeypatch.setattr(CheckpointReader, "tensor", recorder.checking_before(CheckpointReader.tensor))
    many = megalite_to_hf(ckpt, str(tmp_path / "many"))

    assert max(recorder.sizes) == layer_bytes()
    names = sorted(os.listdir(many))
    shards = [f"model-{i:05d}-of-{LAYERS + 2:05d}.safetensors" for i in range(1, LAYERS + 3)]
    assert [n for n in names if n.startswith("model")] == shards + ["model.safetensors.index.json"]
    assert not any(n.endswith(hf_shards.HF_PARTIAL) for n in names)
    index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
    assert index["metadata"]["total_size"] == sum(recorder.sizes)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    models = [transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32) for d in (one, many)]
    first, second = (m.state_dict() for m in models)
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert torch.equal(logits(models[0], ids).logits, logits(models[1], ids).logits)
