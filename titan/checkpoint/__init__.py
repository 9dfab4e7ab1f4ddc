"""Checkpoints: the folder format and its checks, saving and loading the training state, Hugging Face import
and export."""
