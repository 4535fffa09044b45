"""The Llama-style pretrain_gpt.py command line the benchmarks train, built from a shape.

A shape is any object with ``layers hidden ffn heads kv_heads vocab seq``; the benchmarks append what
differs between them (precision, Adam betas, recomputation).
"""


def llama_argv(shape, micro_batch: int, global_batch: int) -> list[str]:
    """GQA, RoPE, RMSNorm, SwiGLU, no biases, untied embeddings, no dropout; random tokens (mock data)."""
    return [
        "--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden), "--ffn-hidden-size", str(shape.ffn),
        "--num-attention-heads", str(shape.heads), "--group-query-attention", "--num-query-groups", str(shape.kv_heads),
        "--seq-length", str(shape.seq), "--max-position-embeddings", str(shape.seq), "--position-embedding-type",
        "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch), "--lr", "1e-4",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.vocab - 1),   # NullTokenizer adds EOD
        "--train-iters", "1000", "--eval-iters", "0"]


def random_batches(shape, seed: int):
    """Endless micro-batches of ``shape.mbs`` x ``shape.seq`` random tokens below the NullTokenizer's EOD,
    as train_step reads them (the shape also needs ``mbs``)."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, shape.vocab - 1, (shape.mbs, shape.seq + 1), generator=generator)
        yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(shape.mbs, shape.seq),
               "position_ids": torch.arange(shape.seq).expand(shape.mbs, shape.seq)}
