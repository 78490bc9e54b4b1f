"""radixserve: an LLM serving engine built around RadixAttention."""

__version__ = "0.1.0"
