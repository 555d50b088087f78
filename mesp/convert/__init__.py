"""Trained models written out for other tools: the adapter folded into its base as an HF
safetensors (or MLX quantized) model directory or a llama.cpp GGUF file, or the adapter alone as
a llama.cpp LoRA GGUF."""
