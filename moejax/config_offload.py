"""inference.offload: the expert-offload section of the config (read by
inference/offload_engine.py); config.py nests it in InferenceConfig and validates it with
offload_problem."""
from __future__ import annotations

import dataclasses

# The choices OffloadEngine honours.
OFFLOAD_POLICIES = ("lru", "lfu", "predictive")
OFFLOAD_PREDICTORS = ("gate", "learned")
OFFLOAD_HOST_MEMORY = ("auto", "pinned_host", "unpinned_host", "numpy")
OFFLOAD_TRANSFERS = ("device_put", "in_jit")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """Expert offload at generation: routed experts in host memory, a pool of HBM slots (one
  expert of any MoE layer each) caching them. On when one of the two sizes is set."""
  hbm_expert_slots: int = 0      # slots in the pool, shared by every MoE layer (both 0: off)
  hbm_budget_bytes: int = 0      # or a byte budget: budget // (one expert's bytes) slots
  policy: str = "lru"            # lru | lfu | predictive (also prefetches the next layers)
  lookahead: int = 1             # predictive: MoE layers up to this many ahead are prefetched
  prefetch_width: int = 0        # predictive: each token's top-m experts per layer; 0: the
                                 # routing's K (top_k; max_k for top_p / entropy)
  predictor: str = "gate"        # predictive: gate (the next routers on this residual) |
                                 # learned (RUN_DIR/predictor.npz, moejax train-predictor)
  host_memory: str = "auto"      # auto (pinned_host where the device has it, else numpy) |
                                 # pinned_host | unpinned_host | numpy
  transfer: str = "device_put"   # device_put (async copy, then a slot write) | in_jit

  @property
  def enabled(self) -> bool:
    return self.hbm_expert_slots > 0 or self.hbm_budget_bytes > 0


def offload_problem(o: OffloadConfig, num_layers: int, num_moe_layers: int,
                    num_experts: int) -> str | None:
  """What is wrong with inference.offload for a model of this depth (None: nothing), as far
  as it can be told without the weights (the byte budget against one expert's size is
  checked where the shapes are known: offload_engine.offload_slots)."""
  name, L, E, moe = "inference.offload", num_layers, num_experts, num_moe_layers
  for key in ("hbm_expert_slots", "hbm_budget_bytes", "prefetch_width"):
    if getattr(o, key) < 0:
      return f"{name}.{key}={getattr(o, key)}: must be >= 0"
  if o.hbm_expert_slots and o.hbm_budget_bytes:
    return (f"{name}: set one of hbm_expert_slots ({o.hbm_expert_slots}) and "
            f"hbm_budget_bytes ({o.hbm_budget_bytes}), not both")
  if o.policy == "predictive" and not 1 <= o.lookahead < L:
    return (f"{name}.lookahead={o.lookahead}: must be in [1, {L - 1}] "
            f"(layers ahead; the model has {L})")
  if o.prefetch_width > E:
    return f"{name}.prefetch_width={o.prefetch_width} exceeds moe.num_experts={E}"
  if o.predictor != "gate" and o.policy != "predictive":
    return (f"{name}.predictor={o.predictor}: only policy predictive prefetches "
            f"(policy is {o.policy}); set {name}.policy=predictive")
  if o.transfer == "in_jit" and o.host_memory == "numpy":
    return (f"{name}.transfer=in_jit reads a host memory kind: host_memory "
            "pinned_host, unpinned_host or auto, not numpy")
  if not o.enabled:
    return None
  if not moe:
    return f"{name}: the model has no MoE layer, no experts to offload"
  if o.hbm_expert_slots > moe * E:
    return (f"{name}.hbm_expert_slots={o.hbm_expert_slots}: more than the "
            f"{moe * E} experts ({moe} MoE layers x {E}); at most {moe * E}")
  return None
