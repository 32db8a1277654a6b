"""Inference: loading a trained run (load.py), sampling (sampling.py) and the on-device
generation engine (generate.py)."""
from moejax.inference.load import TrainedModel, load_trained
from moejax.inference.sampling import SamplingConfig, sample
from moejax.inference.generate import (CacheFactory, Engine, cache_nbytes, dense_caches,
                                       end_token_ids)

__all__ = ["CacheFactory", "Engine", "SamplingConfig", "TrainedModel", "cache_nbytes",
           "dense_caches", "end_token_ids", "load_trained", "sample"]
