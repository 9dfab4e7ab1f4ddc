"""titan: PyTorch-native pretraining of Llama-family language models."""

__version__ = "0.1.0"
