"""The decode layout (q, k, v weights fused per attention) computes what the checkpoint
layout computes."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import load_config, with_overrides
from moejax.inference.load import decode_layout
from moejax.state import build_model, split_model


def test_fused_projections_give_the_same_logits_and_replace_the_three_weights():
  cfg = load_config("configs/tiny.yaml")
  graphdef, params, buffers = split_model(build_model(cfg, 0))
  tokens_BT = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.model.vocab_size)
  want, _, _ = nnx.merge(graphdef, params, buffers)(tokens_BT)
  fused = decode_layout(graphdef, params, buffers)
  got, _, _ = nnx.merge(*fused)(tokens_BT)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  names = {str(path[-1]) for path, _ in nnx.to_flat_state(fused[1])}
  assert "wqkv_DP" in names and not names & {"wq_DHd", "wk_DKd", "wv_DKd"}
  m = cfg.model
  attn = nnx.merge(*fused).blocks[0].attn
  assert attn.wqkv_DP.shape == (m.d_model, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim)


def test_float32_params_are_stored_in_the_compute_dtype_with_identical_logits():
  cfg = with_overrides(load_config("configs/tiny.yaml"),
                       ["model.param_dtype=float32", "model.dtype=bfloat16"])
  graphdef, params, buffers = split_model(build_model(cfg, 0))
  tokens_BT = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.model.vocab_size)
  want, _, _ = nnx.merge(graphdef, params, buffers)(tokens_BT)
  fused = decode_layout(graphdef, params, buffers)
  got, _, _ = nnx.merge(*fused)(tokens_BT)
  assert np.array_equal(np.asarray(got), np.asarray(want))
  dtypes = {str(path[-1]): var.get_value().dtype for path, var in nnx.to_flat_state(fused[1])}
  assert dtypes["wqkv_DP"] == dtypes["w_gate_EDF"] == dtypes["embed_VD"] == jnp.bfloat16
  assert dtypes["router_DE"] == dtypes["scale"] == jnp.float32   # used in float32
