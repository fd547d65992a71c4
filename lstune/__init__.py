"""lstune: fine-tune Hugging Face causal LMs on very long sequences."""

__version__ = "0.1.0"
