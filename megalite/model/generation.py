"""Autoregressive text generation for a GPTModel, with a KV cache.

``generate`` runs the prompt through the model once (prefill), keeping every layer's keys and values
in a ``KVCache``; each later step feeds only the newest token, which attends to the cache. The next
token is the argmax (``greedy``) or is sampled after temperature, top-k and top-p (nucleus)
filtering, from a ``torch.Generator`` seeded with ``seed`` so runs are reproducible.

Inference only: one process, tensor (and pipeline, context) parallel size 1, batch size 1.
"""
from __future__ import annotations

import torch

from megalite.errors import UserError
from megalite.model.attention.kv_cache import KVCache


def check_sampling(temperature: float, top_k: int, top_p: float, greedy: bool) -> None:
    """UserError for sampling settings that select nothing or make no sense."""
    if not greedy and not temperature > 0:
        raise UserError(f"--temperature {temperature} must be > 0 (use --greedy for argmax decoding)")
    if top_k < 0:
        raise UserError(f"--top-k {top_k} must be >= 0 (0 keeps every token)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p} must be in (0, 1] (1 keeps every token)")


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[V] logits -> scaled by 1/temperature, with tokens outside the top-k and outside the nucleus
    (the fewest most-likely tokens whose probability sums to at least ``top_p``) set to -inf."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs         # probability mass of the more likely tokens
        remove = torch.zeros_like(before, dtype=torch.bool).scatter(0, order, before >= top_p)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
               generator: torch.Generator | None) -> int:
    if greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, greedy: bool = False, eos_id: int | None = None, seed: int | None = None,
             use_cache: bool = True) -> list[int]:
    """The new token ids after ``prompt_ids`` (at most ``max_new_tokens``; ends early after ``eos_id``).

    ``use_cache=False`` recomputes the whole sequence every step (the reference the cache must match).
    """
    check_sampling(temperature, top_k, top_p, greedy)
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise UserError("the prompt is empty: generation needs at least one token to start from")
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {max_new_tokens} must be >= 0")
    vocab = model.config.vocab_size or model.config.padded_vocab_size
    bad = [i for i in prompt_ids if not 0 <= i < vocab]
    if bad:
        raise UserError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}; "
                        "is the tokenizer the one the model was trained with?")
    total, limit = len(prompt_ids) + max_new_tokens, model.config.max_position_embeddings
    if total > limit:
        raise UserError(f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens = {total} exceeds the "
                        f"model's {limit} positions (max_position_embeddings); shorten the prompt or lower "
                        "--max-new-tokens")
    device = next(model.parameters()).device
    generator = None
    if not greedy:
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
    cache = KVCache(max_length=total) if use_cache else None
    sequence = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    step_input = sequence
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(step_input, kv_cache=cache)[0, -1]
                token = next_token(logits, temperature, top_k, top_p, greedy, generator)
                new.append(token)
                if token == eos_id or len(new) == max_new_tokens:
                    break
                step = torch.tensor([[token]], dtype=torch.long, device=device)
                sequence = torch.cat([sequence, step], dim=1)
                step_input = step if use_cache else sequence
    finally:
        model.train(was_training)
    return new
