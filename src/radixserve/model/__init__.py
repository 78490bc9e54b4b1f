"""Model definitions, weight loaders, attention backends, sampling and KV tensors (torch)."""
