"""Expert prefetch (issue 36): the recall metric on crafted traces, the predictors, the
learned predictor against planted structure, and the routing-trace recorder against the
model's own routing."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.config import load_config
from moejax.data import ByteTokenizer
from moejax.inference.eval_prefetch import evaluate_recall
from moejax.inference.load import TrainedModel
from moejax.inference.prefetch import (Frequency, Learned, LookaheadGate, NextToken,
                                       PreviousToken, check_lookahead, expert_frequency,
                                       fetch_sizes, layer_pairs, load_predictor, model_digest,
                                       next_token_pairs, recall_counts, save_predictor,
                                       top_m_mask)
from moejax.inference.routing_trace import RoutingTrace, record_trace
from moejax.state import build_model, split_model

SMALL = ["model.d_model=32", "model.num_layers=3", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.ffn_hidden=48", "moe.expert_hidden=32", "moe.num_experts=4",
         "model.max_seq_len=64", "data.seq_len=16", "model.dtype=float32", "model.init_std=0.2",
         "moe.first_dense_layers=1", "moe.expert_impl=dense"]


def _trace(expert_LTK, used_LTK=None, seq_len=None, E=4, D=2, hidden_LTD=None, moe_layers=None):
  """A RoutingTrace of given routing (hidden states random unless given)."""
  expert_LTK = np.asarray(expert_LTK, np.int32)
  M, T, _ = expert_LTK.shape
  used = np.ones(expert_LTK.shape, bool) if used_LTK is None else np.asarray(used_LTK, bool)
  layers = tuple(moe_layers or range(1, M + 1))
  if hidden_LTD is None:
    hidden_LTD = np.random.default_rng(0).normal(size=(max(layers) + 1, T, D)).astype(np.float32)
  position_T = np.tile(np.arange(seq_len or T, dtype=np.int32), T // (seq_len or T))
  return RoutingTrace(hidden_LTD, expert_LTK, used, np.full((M, T, E), 1 / E, np.float32),
                      position_T, layers)


class _Fixed:
  """A predictor returning given scores."""
  name = "fixed"

  def __init__(self, scores_TE):
    self.scores_TE = np.asarray(scores_TE, np.float32)

  def scores(self, trace, src, dst):
    return self.scores_TE


# ---------------------------------------------------------------- recall ---

def test_recall_counts_on_crafted_routing():
  expert_TK = np.array([[0, 1], [2, 3], [1, 2]])
  used_TK = np.array([[True, True], [True, False], [True, True]])   # token 1: slot 2 dropped
  scores_TE = np.array([[4, 3, 2, 1],      # ranks 0 1 2 3
                        [1, 2, 3, 4],      # ranks 3 2 1 0 (3 is fetched but unused)
                        [4, 1, 3, 2]],     # ranks 0 2 3 1: expert 1 comes last
                       np.float32)
  assert recall_counts(scores_TE, expert_TK, used_TK, 1) == (1, 5)   # {0} | {3} | {0}
  assert recall_counts(scores_TE, expert_TK, used_TK, 2) == (4, 5)   # 2 | 1 | 1 (of 2, 1, 2)
  assert recall_counts(scores_TE, expert_TK, used_TK, 3) == (4, 5)   # token 2 still lacks 1
  for m in (4, 5, 100):   # m >= E fetches every expert
    assert recall_counts(scores_TE, expert_TK, used_TK, m) == (5, 5)


def test_top_m_breaks_ties_by_lower_expert_index():
  mask = top_m_mask(np.array([[1.0, 2.0, 2.0, 2.0]]), 2)
  assert mask.tolist() == [[False, True, True, False]]


def test_always_right_and_always_wrong_predictors():
  rng = np.random.default_rng(1)
  E, K, T = 8, 2, 50
  expert_TK = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
  trace = _trace(expert_TK[None], E=E)
  used_TE = trace.used_TE(1).astype(np.float32)
  cfg = load_config(None, SMALL + ["moe.num_experts=8", "model.num_layers=2"])
  right = _Fixed(used_TE + rng.random((T, E)) * 0.1)   # used first, noise below
  wrong = _Fixed(-used_TE)
  for p, expect in ((right, {2: 1.0, 3: 1.0, 4: 1.0}), (wrong, {2: 0.0, 3: 0.0, 4: 0.0})):
    rows = evaluate_recall(trace, [p], cfg, [1])
    got = {r["m"]: r["recall"] for r in rows if r["layer"] == "all"}
    assert got == expect
  # m >= E: everything fetched, whatever the scores.
  assert recall_counts(-used_TE, expert_TK, np.ones_like(expert_TK, bool), E) == (T * K, T * K)


def test_overall_recall_sums_hits_over_layers():
  # Layer 1: 4 tokens, 1 used slot each; layer 2: 4 tokens, 2 used slots each (K = 2).
  expert_LTK = np.array([[[0, 1], [0, 1], [0, 1], [0, 1]], [[2, 3]] * 4])
  used_LTK = np.array([[[True, False]] * 4, [[True, True]] * 4])
  trace = _trace(expert_LTK, used_LTK, moe_layers=(1, 2))
  cfg = load_config(None, SMALL)          # 3 layers, MoE layers 1 and 2, E = 4, k = 2
  scores = _Fixed(np.tile([0.0, 0.0, 3.0, 2.0], (4, 1)))   # top-1 {2}, top-2 {2, 3}
  rows = evaluate_recall(trace, [scores], cfg, [1])
  at = {(r["layer"], r["m"]): r for r in rows}
  assert at[(1, 2)]["recall"] == 0.0 and at[(2, 2)]["recall"] == 1.0
  assert at[("all", 2)]["hits"] == 8 and at[("all", 2)]["used"] == 12
  assert at[("all", 2)]["recall"] == pytest.approx(8 / 12)
  assert at[(2, 3)]["source_layer"] == 1 and at[("all", 4)]["recall"] == 1.0


def test_previous_token_stays_inside_its_sequence():
  # Two sequences of 3 tokens, K = 1; frequency favours expert 2.
  trace = _trace([[[0], [0], [1], [2], [2], [2]]], seq_len=3)
  freq = Frequency(np.array([[0.1, 0.2, 0.6, 0.1]], np.float32), (1,))
  hits, used = recall_counts(PreviousToken(freq).scores(trace, 0, 1), trace.expert_LTK[0],
                             trace.used_LTK[0], 1)
  # seq 0: first token (frequency: 2) miss, 0 after 0 hit, 1 after 0 miss; seq 1: frequency
  # says 2 (a leak from seq 0 would say 1) hit, then two hits.
  assert (hits, used) == (4, 6)
  np.testing.assert_allclose(expert_frequency(trace)[0], [2 / 6, 1 / 6, 3 / 6, 0.0])


def test_lookahead_checks():
  cfg = load_config(None, SMALL)   # layers 0 (dense), 1, 2
  assert layer_pairs(cfg, 1) == [(0, 1), (1, 2)] and layer_pairs(cfg, 2) == [(0, 2)]
  assert check_lookahead(cfg, None) == [1, 2]
  assert check_lookahead(cfg, [2, 1, 2]) == [1, 2]
  for bad in (0, 3, -1):
    with pytest.raises(ValueError, match=r"must be in \[1, 2\]"):
      check_lookahead(cfg, [bad])
  with pytest.raises(ValueError, match="no MoE layer"):
    check_lookahead(load_config(None, SMALL + ["moe.first_dense_layers=3"]), None)
  assert fetch_sizes(2) == [2, 3, 4] and fetch_sizes(1) == [1, 2]


# --------------------------------------------------------- planted structure ---

def _planted(rng, A_DE, b_E, T, k):
  """Layer 1's experts are the top-k of a linear function of layer 0's hidden state."""
  h_TD = rng.normal(size=(T, A_DE.shape[0])).astype(np.float32)
  expert_TK = np.argsort(-(h_TD @ A_DE + b_E), axis=-1)[:, :k]
  hidden_LTD = np.stack([h_TD, rng.normal(size=h_TD.shape).astype(np.float32)])
  return _trace(expert_TK[None], E=A_DE.shape[1], hidden_LTD=hidden_LTD, moe_layers=(1,))


def test_learned_beats_frequency_on_planted_structure():
  rng = np.random.default_rng(0)
  D, E, k = 16, 8, 2
  A_DE, b_E = rng.normal(size=(D, E)), np.linspace(-1, 1, E)   # skewed: frequency is no fool
  train, held_out = _planted(rng, A_DE, b_E, 4000, k), _planted(rng, A_DE, b_E, 2000, k)
  cfg = load_config(None, SMALL + ["moe.num_experts=8", "model.num_layers=2"])
  learned = Learned.fit(train, [(0, 1)])
  freq = Frequency(expert_frequency(train), train.moe_layers)
  rows = evaluate_recall(held_out, [learned, freq], cfg, [1])
  got = {(r["predictor"], r["m"]): r["recall"] for r in rows if r["layer"] == "all"}
  assert got[("learned", 2)] > 0.8 and got[("frequency", 2)] < 0.5
  for m in (2, 3, 4):
    assert got[("learned", m)] > got[("frequency", m)] + 0.3


def _planted_next(rng, A_DE, T, seq_len, k):
  """Layer 1's experts at token t + 1 are the top-k of a linear function of token t's layer-1
  hidden state (a new sequence every seq_len rows: its first token's experts are random)."""
  h_TD = rng.normal(size=(T, A_DE.shape[0])).astype(np.float32)
  next_TK = np.argsort(-(h_TD @ A_DE), axis=-1)[:, :k]
  expert_TK = np.roll(next_TK, 1, axis=0)
  first = np.arange(0, T, seq_len)
  expert_TK[first] = np.argsort(rng.normal(size=(len(first), A_DE.shape[1])), -1)[:, :k]
  hidden_LTD = np.stack([rng.normal(size=h_TD.shape).astype(np.float32), h_TD])
  return _trace(expert_TK[None], seq_len=seq_len, E=A_DE.shape[1], hidden_LTD=hidden_LTD,
                moe_layers=(1,))


def test_next_token_maps_learn_planted_next_token_routing():
  rng = np.random.default_rng(1)
  A_DE = rng.normal(size=(16, 8))
  train, held_out = (_planted_next(rng, A_DE, T, 50, 2) for T in (4000, 2000))
  cfg = load_config(None, SMALL + ["moe.num_experts=8", "model.num_layers=2"])
  assert next_token_pairs(cfg) == [(1, 1)]
  learned = Learned.fit(train, [(0, 1)], next_pairs=[(1, 1)])
  freq = Frequency(expert_frequency(train), train.moe_layers)
  rows = evaluate_recall(held_out, [], cfg, [1], [NextToken(learned), PreviousToken(freq), freq])
  got = {(r["predictor"], r["m"]): r for r in rows if r["layer"] == "all"}
  # Scored on the rows with a previous token: 2000 - 40 sequence starts, 2 experts each.
  assert got[("learned, next token", 2)]["used"] == (2000 - 40) * 2
  assert got[("learned, next token", 2)]["recall"] > 0.8
  assert got[("previous", 2)]["recall"] < 0.5 and got[("frequency", 2)]["recall"] < 0.5
  # The regression's estimate (a chance of use) is high where the next token uses the expert.
  est_TE = learned.next_scores(held_out.hidden_LTD[1], 1, 1)
  assert est_TE.shape == (2000, 8)
  used_next_TE = np.roll(held_out.used_TE(1), -1, axis=0)[held_out.position_T < 49]
  est_TE = est_TE[held_out.position_T < 49]
  assert est_TE[used_next_TE].mean() > est_TE[~used_next_TE].mean() + 0.4


# --------------------------------------------------------------- recorder ---

def _trained(cfg, seed=0, step=0) -> TrainedModel:
  graphdef, params, buffers = split_model(build_model(cfg, seed))
  return TrainedModel(cfg, graphdef, params, buffers, ByteTokenizer(), step)


@pytest.mark.parametrize("extra", [[], ["moe.routing=topk_softmax"],
                                   ["moe.routing=top_p", "moe.max_k=3", "moe.top_p=0.6",
                                    "moe.capacity_factor=0.6"]])
def test_recorder_routes_as_the_model_and_gate_at_distance_zero_is_exact(extra):
  cfg = load_config(None, SMALL + extra)
  tm = _trained(cfg)
  windows = [np.random.default_rng(i).integers(0, 256, (3, 20)).astype(np.int32)
             for i in range(2)]
  trace = record_trace(tm, windows)
  assert trace.hidden_LTD.shape == (3, 120, 32) and trace.moe_layers == (1, 2)
  assert trace.position_T.tolist() == list(range(20)) * 6
  # The model's own per-expert loads (after capacity) equal the trace's used slots.
  stats_of = jax.jit(lambda p, b, w: nnx.merge(tm.graphdef, p, b)(w)[1])
  for b, w in enumerate(windows):
    stats = stats_of(tm.params, tm.buffers, w)
    for i, s in enumerate(stats):
      rows = slice(60 * b, 60 * (b + 1))
      counts_E = np.bincount(trace.expert_LTK[i, rows][trace.used_LTK[i, rows]], minlength=4)
      np.testing.assert_array_equal(counts_E, np.asarray(s["load_E"]))
  if "moe.capacity_factor=0.6" in extra:
    assert not trace.used_LTK.all()        # some slots dropped or unselected
  gate = LookaheadGate.from_model(tm)
  K = trace.expert_LTK.shape[-1]
  for i, layer in enumerate(trace.moe_layers):
    hits, used = recall_counts(gate.scores(trace, layer, layer), trace.expert_LTK[i],
                               trace.used_LTK[i], K)
    assert hits == used > 0


def test_stored_predictor_refuses_another_model_step_or_lookahead(tmp_path):
  cfg = load_config(None, SMALL)
  tm = _trained(cfg, step=7)
  trace = record_trace(tm, [np.arange(40, dtype=np.int32).reshape(2, 20)])
  learned = Learned.fit(trace, layer_pairs(cfg, 1), next_pairs=next_token_pairs(cfg))
  assert sorted(learned.next_maps) == [(1, 1), (2, 1), (2, 2)]
  freq = Frequency(expert_frequency(trace), trace.moe_layers)
  meta = {"step": 7, "model_digest": model_digest(tm), "lookahead": [1],
          "pairs": [list(p) for p in layer_pairs(cfg, 1)], "train_tokens": 40, "eps": 1e-6}
  save_predictor(tmp_path, Learned(learned.maps),
                 freq, meta)   # a file of the layout before next-token maps: none loaded
  assert load_predictor(tmp_path, tm, [1])[0].next_maps == {}
  meta["next_pairs"] = [list(p) for p in next_token_pairs(cfg)]
  save_predictor(tmp_path, learned, freq, meta)
  loaded, loaded_freq, _ = load_predictor(tmp_path, tm, [1])
  np.testing.assert_array_equal(loaded.scores(trace, 0, 1), learned.scores(trace, 0, 1))
  np.testing.assert_array_equal(loaded.next_scores(trace.hidden_LTD[2], 2, 1),
                                learned.next_scores(trace.hidden_LTD[2], 2, 1))
  np.testing.assert_array_equal(loaded_freq.frequency_LE, freq.frequency_LE)
  with pytest.raises(ValueError, match="another model or checkpoint"):
    load_predictor(tmp_path, dataclasses.replace(tm, step=8), [1])
  with pytest.raises(ValueError, match="another model or checkpoint"):
    load_predictor(tmp_path, _trained(cfg, seed=1, step=7), [1])
  with pytest.raises(ValueError, match=r"not \[2\].*--lookahead 1 2"):
    load_predictor(tmp_path, tm, [1, 2])
  (tmp_path / "predictor.npz").write_bytes(b"not an npz")
  with pytest.raises(ValueError, match="not a predictor file"):
    load_predictor(tmp_path, tm, [1])
