"""Runnable examples: ``python -m ckptstore.examples.train`` (torch), ``...train_jax`` (JAX)."""
