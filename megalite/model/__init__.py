"""The GPT/Llama model: transformer layers, embeddings and output head, initialisation, generation."""
