"""Data pipeline for GPT pretraining: tokenizers, indexed datasets, samples, batching, synthetic corpus.

Modules are imported individually (``megalite.data.gpt_dataset`` etc.) so that
the command-line tools load no more than they need.
"""
