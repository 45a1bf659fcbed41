"""The embedded default model and what it needs made once: $DELTASERVE_HOME (home.py), the seeded random-weight
models (model.py) and the published Qwen3.5 tokenizer for the 0.8B-shape stand-in (qwen35_tokenizer.py)."""
