"""megalite: Megatron-style GPT/Llama pretraining that reads in an afternoon."""

__version__ = "0.1.0"
