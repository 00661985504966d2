"""Checkpoint formats: `hf` (Hugging Face safetensors directories)."""
