"""Checkpoints: sharded save/load that reshards across layouts, the file formats, Hugging Face conversion."""
