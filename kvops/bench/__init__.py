"""`kvops bench`: the engine against transformers' generate, and KV cache dtypes against each other."""
