import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model import routing


def test_softmax_topk_picks_largest_and_renormalizes():
  logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
  r = routing.route(logits, mode="softmax_topk", top_k=2, renormalize=True)
  np.testing.assert_array_equal(r.expert_TK, [[1, 2], [0, 2]])
  np.testing.assert_allclose(r.weight_TK, [[0.6 / 0.9, 0.3 / 0.9], [0.5 / 0.8, 0.3 / 0.8]], rtol=1e-6)
  r = routing.route(logits, mode="softmax_topk", top_k=2, renormalize=False)
  np.testing.assert_allclose(r.weight_TK, [[0.6, 0.3], [0.5, 0.3]], rtol=1e-6)


def test_topk_softmax_softmaxes_the_chosen_logits():
  logits = jnp.array([[1.0, 3.0, 2.0, -5.0]])
  r = routing.route(logits, mode="topk_softmax", top_k=2, renormalize=False)
  np.testing.assert_array_equal(r.expert_TK, [[1, 2]])
  np.testing.assert_allclose(r.weight_TK, jax.nn.softmax(jnp.array([[3.0, 2.0]])), rtol=1e-6)


def test_top_p_takes_experts_until_mass_reached():
  probs = jnp.array([[0.7, 0.2, 0.05, 0.05],   # 0.7 < 0.8 -> add 0.2 -> 0.9: two experts
                     [0.95, 0.03, 0.01, 0.01],  # one expert suffices
                     [0.3, 0.3, 0.2, 0.2]])     # capped at max_k = 3
  r = routing.route(jnp.log(probs), mode="top_p", top_k=1, top_p=0.8, max_k=3, renormalize=False)
  np.testing.assert_array_equal(r.selected_TK, [[1, 1, 0], [1, 0, 0], [1, 1, 1]])
  np.testing.assert_allclose(r.weight_TK[0], [0.7, 0.2, 0.0], rtol=1e-6)


def test_capacity_drops_latest_lowest_priority_assignments():
  # 4 tokens all prefer expert 0 first and expert 1 second; capacity 2 per expert.
  logits = jnp.tile(jnp.array([[2.0, 1.0, -9.0]]), (4, 1))
  r = routing.route(logits, mode="softmax_topk", top_k=2, renormalize=True, capacity=2)
  # top-1 slots of tokens 0, 1 fit expert 0; tokens 2, 3 are dropped there. Second choices
  # (expert 1) of tokens 0, 1 fit; tokens 2, 3 dropped.
  np.testing.assert_array_equal(r.keep_TK, [[1, 1], [1, 1], [0, 0], [0, 0]])
  assert float(r.weight_TK[2:].sum()) == 0.0
  pos = routing.position_in_expert(r.expert_TK, r.selected_TK, 3)
  np.testing.assert_array_equal(pos, [[0, 0], [1, 1], [2, 2], [3, 3]])


def test_load_balancing_loss_hand_computed():
  # Uniform router, balanced assignment -> exactly 1.
  probs = jnp.full((4, 2), 0.5)
  expert = jnp.array([[0], [1], [0], [1]])
  assert float(routing.load_balancing_loss(probs, expert, jnp.ones((4, 1), bool))) == pytest.approx(1.0)
  # All tokens to expert 0 with P = (0.75, 0.25): E * (1 * 0.75 + 0 * 0.25) = 1.5
  probs = jnp.tile(jnp.array([[0.75, 0.25]]), (4, 1))
  expert = jnp.zeros((4, 1), jnp.int32)
  assert float(routing.load_balancing_loss(probs, expert, jnp.ones((4, 1), bool))) == pytest.approx(1.5)


def test_z_loss_hand_computed():
  logits = jnp.array([[0.0, 0.0], [jnp.log(3.0), 0.0]])
  expected = (np.log(2.0) ** 2 + np.log(4.0) ** 2) / 2
  assert float(routing.router_z_loss(logits)) == pytest.approx(expected, rel=1e-6)


def test_bias_selects_but_does_not_weight():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
  bias = jnp.array([0.0, 0.0, 1.0])
  r = routing.route(logits, mode="softmax_topk", top_k=1, renormalize=False, bias_E=bias)
  assert int(r.expert_TK[0, 0]) == 2
  assert float(r.weight_TK[0, 0]) == pytest.approx(0.2, rel=1e-6)
  new = routing.bias_update(jnp.zeros(3), jnp.array([5.0, 1.0, 0.0]), 0.1)
  np.testing.assert_allclose(new, [-0.1, 0.1, 0.1])


def test_stats_of_split_token_groups_add_up_to_the_whole_batch():
  """One implementation serves both MoE paths: the single device takes load_stats of one
  group; the expert-parallel dispatch adds every device's stat_sums first. Dropless routing
  is per token, so any split of the tokens must give the whole batch's statistics, and
  those must be the hand formulas."""
  logits = jax.random.normal(jax.random.key(0), (32, 8)) * 2
  kw = dict(mode="top_p", top_k=1, top_p=0.7, max_k=3, renormalize=True)
  r = routing.route(logits, **kw)
  whole = routing.load_stats(routing.stat_sums(r), 32)
  chex.assert_trees_all_close(
      {k: whole[k] for k in ("aux_loss", "z_loss", "experts_per_token", "dropped_frac")},
      {"aux_loss": routing.load_balancing_loss(r.probs_TE, r.expert_TK, r.selected_TK),
       "z_loss": routing.router_z_loss(r.logits_TE),
       "experts_per_token": r.selected_TK.sum() / 32.0, "dropped_frac": 0.0}, rtol=1e-6)
  chex.assert_shape([whole["load_E"], whole["routed_E"]], (8,))
  assert 1.0 < float(whole["experts_per_token"]) < 3.0     # top-p: a variable number
  groups = [routing.stat_sums(routing.route(g, **kw)) for g in jnp.split(logits, 4)]
  summed = jax.tree.map(lambda *v: sum(v), *groups)
  chex.assert_trees_all_close(routing.load_stats(summed, 32), whole, rtol=1e-6)


def test_capacity_and_slots_come_from_the_moe_config():
  from moejax.config import load_config
  moe = lambda *o: load_config(None, list(o)).moe
  assert routing.slots_per_token(moe("moe.top_k=2")) == 2
  assert routing.slots_per_token(moe("moe.routing=top_p", "moe.max_k=3")) == 3
  assert routing.expert_capacity(moe("moe.capacity_factor=0"), 100) is None   # dropless
  assert routing.expert_capacity(moe("moe.capacity_factor=1", "moe.top_k=2"), 100) == 25
  # top-p routing sizes the buffers for max_k slots per token
  assert routing.expert_capacity(moe("moe.capacity_factor=1", "moe.routing=top_p",
                                     "moe.max_k=4"), 100) == 50
