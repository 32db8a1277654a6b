"""The LM head's custom backward: the float32 logits' cotangent is cast to the compute dtype,
so the head's two backward GEMMs take 16-bit operands (not tf32 on a float32 one)."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from moejax.config import load_config
from moejax.model.layers import lm_head_logits
from moejax.state import forward_loss, init_state


def _plain(x, head):
  return jnp.dot(x, head, preferred_element_type=jnp.float32)


def _grads(f, x, head):
  return jax.grad(lambda x, h: jnp.sum(jnp.sin(f(x, h))), argnums=(0, 1))(x, head)


def _dot_operand_dtypes(jaxpr):
  """(shapes, dtypes) of every dot_general's operands, nested jaxprs included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(tuple((v.aval.shape, v.aval.dtype) for v in eqn.invars))
    for sub in _sub_jaxprs(eqn.params.values()):
      out += _dot_operand_dtypes(sub)
  return out


def _sub_jaxprs(values):
  """The jaxprs nested in an equation's params (pjit, custom_vjp, scan, ... bodies)."""
  for v in values:
    if isinstance(v, jax.extend.core.ClosedJaxpr):
      yield v.jaxpr
    elif isinstance(v, jax.extend.core.Jaxpr):
      yield v
    elif isinstance(v, (tuple, list)):
      yield from _sub_jaxprs(v)


def _inputs(dtype):
  kx, kh = jax.random.split(jax.random.key(0))
  return (jax.random.normal(kx, (2, 5, 16), dtype),
          jax.random.normal(kh, (16, 48), dtype) * 0.3)


def test_float32_gradients_equal_autodiff():
  x, head = _inputs(jnp.float32)
  np.testing.assert_array_equal(lm_head_logits(x, head), _plain(x, head))
  for a, b in zip(_grads(lm_head_logits, x, head), _grads(_plain, x, head)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_backward_gemms_take_bf16_operands_and_match_float32():
  x, head = _inputs(jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda x, h: _grads(lm_head_logits, x, h))(x, head).jaxpr
  dots = _dot_operand_dtypes(jaxpr)
  assert len(dots) == 3
  assert all(d == jnp.bfloat16 for dot in dots for _, d in dot), dots
  plain_dots = _dot_operand_dtypes(jax.make_jaxpr(lambda x, h: _grads(_plain, x, h))(x, head).jaxpr)
  assert any(d == jnp.float32 for dot in plain_dots for _, d in dot)   # what it replaces
  ref = _grads(_plain, x.astype(jnp.float32), head.astype(jnp.float32))
  for a, b in zip(_grads(lm_head_logits, x, head), ref):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=3e-2, atol=3e-2)


def test_bf16_model_gradient_has_no_float32_vocab_gemm():
  cfg = load_config(None, ["model.dtype=bfloat16"])
  graphdef, st = init_state(cfg)
  V = cfg.model.vocab_size
  toks = np.random.default_rng(0).integers(0, V, (2, 17)).astype(np.int32)
  loss = lambda p: forward_loss(cfg, graphdef, p, st.buffers, toks[:, :-1], toks[:, 1:])[0]
  dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(st.params).jaxpr)
  vocab_dots = [dot for dot in dots if any(V in s for s, _ in dot)]
  assert len(vocab_dots) >= 3
  assert all(d != jnp.float32 for dot in vocab_dots for _, d in dot), vocab_dots
