"""Precision search: one format per unit of the model, chosen by an
exact solver from measured per-unit damage, emitted as an ordinary llmcompressor recipe.
docs/precision-search.md says what is built and what vLLM serves mixed."""
