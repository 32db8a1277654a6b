"""experiments/offload_policy_bounds.py's Belady replay, with and without a foresight horizon."""
import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "offload_policy_bounds",
    Path(__file__).resolve().parents[2] / "experiments" / "offload_policy_bounds.py")
bounds = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bounds)


def test_belady_horizon_between_lru_and_optimum():
  # One MoE layer, one expert a token, cycling through 3 experts with 2 slots: LRU misses
  # every time; the optimum keeps one of the two cached experts each miss.
  seq = [(0, [e]) for e in [0, 1, 2] * 10]
  best = bounds.belady(seq, 2)
  assert best < len(seq) // 2 + 2
  assert bounds.belady(seq, 2, horizon=0) == len(seq)  # no foresight: least recent goes
  assert bounds.belady(seq, 2, horizon=1) == best  # the next token decides each eviction
  assert bounds.belady(seq, 2, horizon=10 ** 6) == best


def test_belady_horizon_counts_tokens_not_layers():
  # Two layers a token, 6 keys in a 3-token cycle, 4 slots: the optimum needs the next two
  # tokens (4 entries) in sight; two entries (one token) are not enough.
  seq = [(l, [e]) for e in [0, 1, 2] * 6 for l in (0, 1)]
  best = bounds.belady(seq, 4)
  assert bounds.belady(seq, 4, horizon=2, layers_per_token=2) == best
  assert bounds.belady(seq, 4, horizon=1, layers_per_token=2) > best
  assert bounds.belady(seq, 4, horizon=0, layers_per_token=2) == len(seq)
