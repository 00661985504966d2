"""Experiment code on top of the library: recipes (`experiments.recipes`), gin configs, benchmarks,
soaks. Not installed with `sfrrl_jax`; run from a checkout (`python experiments/train.py ...`)."""
