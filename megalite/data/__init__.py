"""Tokenized data: tokenizers, Megatron .bin/.idx files, GPT samples, blending, samplers."""
