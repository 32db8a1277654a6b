"""MoE layers with int8 / int4 expert weights (inference.expert_bits): the forward pass, the
layer-by-layer initialization, the checkpoint round trip."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.checkpoint import Checkpointer
from moejax.config import ConfigError, load_config
from moejax.inference.quantize import dequantize_params, expert_nbytes, quantize_params
from moejax.model import moe as moe_mod
from moejax.state import abstract_model, build_model, init_state, split_model

# Widths 64: int4 scale groups of 32 rows divide D/2 and F/2. Float32 compute, so the
# quantized and dequantized models differ only by the order of float32 sums.
SMALL = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.ffn_hidden=48", "moe.expert_hidden=64", "moe.num_experts=4",
         "model.max_seq_len=32", "data.seq_len=16", "model.init_std=0.1"]
QUANTIZED = [("8-bit per channel", 8, 0), ("4-bit group 32", 4, 32)]


def small_cfg(*extra):
  return load_config(None, SMALL + list(extra))


def quantized_cfg(bits, group, *extra):
  return small_cfg(f"inference.expert_bits={bits}", f"inference.expert_group_size={group}",
                   *extra)


def _tokens(seed, B=2, T=12):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, 256, dtype=jnp.int32)


@pytest.mark.parametrize("impl", ["gmm", "blocked"])
@pytest.mark.parametrize("name, bits, group", QUANTIZED)
def test_quantized_model_matches_its_dequantized_16bit_model(name, bits, group, impl):
  """The quantized forward (gmm: codes dequantized inside the Pallas kernel, interpreted on
  CPU; blocked: dequantized first) against the 16-bit layout holding the same numbers."""
  cfg_q = quantized_cfg(bits, group, f"moe.expert_impl={impl}")
  cfg16 = small_cfg(f"moe.expert_impl={impl}")
  graphdef_q, params_q, buffers = split_model(build_model(cfg_q, 0))
  params16 = dequantize_params(cfg16, cfg_q, params_q)
  graphdef16 = abstract_model(cfg16)[0]
  toks = _tokens(1)
  logits_q, _, _ = nnx.merge(graphdef_q, params_q, buffers)(toks)
  logits16, _, _ = nnx.merge(graphdef16, params16, buffers)(toks)
  # Float rounding only (the weights are equal): 1e-5 of the logits' scale.
  scale = float(jnp.abs(logits16).max())
  np.testing.assert_allclose(logits_q, logits16, rtol=0, atol=1e-5 * scale)
  assert float(jnp.abs(logits_q - logits16).max()) < 1e-3 * float(logits16.std())


@pytest.mark.parametrize("name, bits, group", QUANTIZED)
def test_quantize_params_keeps_everything_but_the_experts(name, bits, group):
  cfg16, cfg_q = small_cfg(), quantized_cfg(bits, group)
  _, params16, buffers = split_model(build_model(cfg16, 0))
  params_q = quantize_params(cfg_q, params16)
  ffn = params_q["blocks"][0]["ffn"]
  assert ffn["w_gate_up_codes"][...].dtype == (jnp.int8 if bits == 8 else jnp.uint8)
  assert "w_gate_EDF" not in ffn and "w_gate_up_codes" not in params16["blocks"][0]["ffn"]
  back = dequantize_params(cfg16, cfg_q, params_q)
  flat16, flat_back = dict(nnx.to_flat_state(params16)), dict(nnx.to_flat_state(back))
  for path, var in flat16.items():
    want, got = np.asarray(var[...]), np.asarray(flat_back[path][...])
    if path[-1] in moe_mod.FLOAT_EXPERT_NAMES:   # symmetric rounding: at most scale / 2
      qmax = 127 if bits == 8 else 7
      bound = np.abs(want).max() / qmax / 2 + 1e-7
      assert 0 < np.abs(got - want).max() <= bound, path
    else:
      np.testing.assert_array_equal(got, want, err_msg=str(path))
  if bits == 8:   # and the model computes the same function (gate and up where they belong)
    toks = _tokens(2)
    want, _, _ = nnx.merge(abstract_model(cfg16)[0], params16, buffers)(toks)
    got, _, _ = nnx.merge(abstract_model(cfg_q)[0], params_q, buffers)(toks)
    assert float(jnp.abs(got - want).max()) < 0.1 * float(want.std())
  # 16-bit experts, in bf16, against codes and float32 scales.
  ratio = expert_nbytes(cfg_q, params_q) / (expert_nbytes(cfg16, params16) / 2)
  assert ratio == {8: (1 + 4 / 64) / 2, 4: (0.5 + 4 / 32) / 2}[bits]   # I = 64, group 32


def test_quantized_init_draws_and_quantizes_one_layer_at_a_time(monkeypatch):
  """build_model never holds the float experts of more than one layer: every quantize call
  gets one layer's [E, D, 2F] or [E, F, D], once per MoE layer, and the state holds codes."""
  cfg = quantized_cfg(4, 32, "model.num_layers=3", "moe.first_dense_layers=1")
  shapes = []
  real = moe_mod._quantize_layer

  def spy(w_gate_up, w_down, bits, group_size):
    shapes.extend([tuple(w_gate_up.shape), tuple(w_down.shape)])
    return real(w_gate_up, w_down, bits, group_size)

  monkeypatch.setattr(moe_mod, "_quantize_layer", spy)
  _, params, _ = split_model(build_model(cfg, 0))
  E, D, F = 4, 64, 64
  assert shapes == [(E, D, 2 * F), (E, F, D)] * 2     # two MoE layers, each on its own
  floats = [(p, v[...].shape) for p, v in nnx.to_flat_state(params)
            if jnp.issubdtype(v[...].dtype, jnp.floating) and v[...].ndim == 3
            and not p[-1].endswith("_scales")]
  assert floats == [], floats                          # no float expert matrix is kept


def test_mixtral_shaped_int4_model_holds_22gb_of_codes():
  """The abstract build (eval_shape) of Mixtral-8x7B with int4 experts: codes only."""
  cfg = load_config("configs/mixtral_8x7b.yaml", ["inference.expert_bits=4"])
  _, params, _ = abstract_model(cfg)
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(params)}
  codes = sum(x.size for p, x in flat.items() if p[-1].endswith("_codes"))
  assert all(x.dtype == jnp.uint8 for p, x in flat.items() if p[-1].endswith("_codes"))
  assert codes == 32 * 8 * 3 * 4096 * 14336 // 2        # 22.5e9 bytes
  assert not any(p[-1] in moe_mod.FLOAT_EXPERT_NAMES for p in flat)


def test_quantized_params_checkpoint_round_trip(tmp_path):
  cfg = quantized_cfg(4, 32)
  _, params, buffers = split_model(build_model(cfg, 0))
  Checkpointer(tmp_path / "ck").save_params(7, params, buffers, cfg)
  ckpt = Checkpointer(tmp_path / "ck")
  _, tparams, tbuffers = abstract_model(cfg)
  restored, _, meta = ckpt.restore_params(tparams, tbuffers, cfg)
  assert meta["step"] == 7
  chex.assert_trees_all_equal(restored, params)
  saved = ckpt.manager.item_metadata(7)["state"]
  codes = [k for k in saved if "w_gate_up_codes" in k]
  assert codes and not [k for k in saved if "w_gate_EDF" in k]
  # A different group size changes the scales' shapes: refused by name, not by orbax.
  with pytest.raises(Exception, match="inference.expert_group_size"):
    ckpt.restore_params(*abstract_model(quantized_cfg(4, 16))[1:], quantized_cfg(4, 16))


def test_quantized_experts_refuse_training_and_expert_parallel():
  cfg = quantized_cfg(4, 32)
  with pytest.raises(ConfigError, match="cannot be trained.*moejax quantize"):
    init_state(cfg)
  from moejax.parallel import ExpertParallel, make_mesh
  ep = ExpertParallel(make_mesh(cfg.mesh, cfg.moe.num_experts))
  with pytest.raises(ValueError, match="not expert-parallel"):
    build_model(cfg, 0, ep)
