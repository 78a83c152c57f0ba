"""vLLM model classes built on ``shared_numerics`` (registered through the ``zerokld`` model-adapter hook)."""
