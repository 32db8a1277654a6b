"""Inference: loading a trained run (load.py), sampling (sampling.py), the on-device
generation engine (generate.py) and its expert-offload counterpart (offload_engine.py)."""
from moejax.inference.load import TrainedModel, load_trained
from moejax.inference.sampling import SamplingConfig, sample
from moejax.inference.generate import (CacheFactory, Engine, cache_nbytes, dense_caches,
                                       end_token_ids)
from moejax.inference.offload_engine import OffloadEngine

__all__ = ["CacheFactory", "Engine", "OffloadEngine", "SamplingConfig", "TrainedModel",
           "cache_nbytes", "dense_caches", "end_token_ids", "load_trained", "sample"]
