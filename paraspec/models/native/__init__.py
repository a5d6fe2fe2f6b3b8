"""The native decoder (PyTorch): Llama/Qwen2/Mistral blocks, several sequences, the padded-width forward,
layer-parallel forwards."""
