"""The llama.cpp backend: a GGUF on llama.cpp's kernels, the work run in child processes, widened drafts."""
