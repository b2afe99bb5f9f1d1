"""Adapters that let serving engines (SGLang, Hugging Face transformers) run the tier engine."""
