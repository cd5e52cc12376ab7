"""Runnable examples: `python -m jaxmlp.examples.train_moe` trains a small MoE language model."""
