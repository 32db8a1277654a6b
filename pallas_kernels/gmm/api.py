"""Public grouped matmul: ``gmm`` and ``tgmm``, input checks, implementation choice, VJPs.

Shapes: M rows (routed token rows, sorted by group), I contraction (input width),
O output width, E groups (experts), Q quantization groups along I. Group g owns the
``group_sizes[g]`` consecutive rows starting at ``sum(group_sizes[:g])``.

Implementations (``implementation=``, see ``pallas_kernels._implementation``):
  "triton": Pallas kernels in the Triton style (triton.py); compiled on a GPU,
            interpreted elsewhere with ``interpret=True``. Quantized weights are
            dequantized in registers. Work is split into (group, row-tile) tiles, so
            an expert with no rows costs no weight reads.
  "tpu":    Pallas TPU block-spec kernels (tpu.py); compiled on a TPU, TPU interpret
            mode elsewhere. Float weights only.
  "xla":    ``jax.lax.ragged_dot`` (xla.py); everywhere; quantized weights dequantized
            first.
Default order: ("tpu", "xla") on a TPU, else ("triton", "xla"). Config classes:
``TritonConfig`` (alias ``GmmTiling``) and ``TpuConfig`` (plan.py); they tune the forward
kernel, the backward kernels use their implementation's defaults.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _implementation as impl_lib
from pallas_kernels.gmm import xla
from pallas_kernels.gmm.plan import TpuConfig, TritonConfig
from pallas_kernels.gmm.quant import QuantizedExpertWeights, dequantize_expert_weights

__all__ = ["gmm", "tgmm", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("triton", "tpu", "xla")
_CONFIGS = {"triton": TritonConfig, "tpu": TpuConfig}


def _default_order() -> tuple[str, ...]:
  return ("tpu", "xla") if impl_lib.platform() == "tpu" else ("triton", "xla")


def _kernels(name: str):
  """The Pallas module of an implementation, imported on first use."""
  return importlib.import_module(f"pallas_kernels.gmm.{name}")


# --- input checks --------------------------------------------------------------


def _check_group_sizes(group_sizes_E, e: int | None):
  shape = getattr(group_sizes_E, "shape", None)
  if getattr(group_sizes_E, "ndim", None) != 1 or (e is not None and shape[0] != e):
    want = "[E]" if e is None else f"[E] with E={e} (number of experts)"
    raise ValueError(f"group_sizes must be {want}, got shape {shape}")
  if not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array, got {group_sizes_E.dtype}")


def _check_float(name, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating array (bf16/f16/f32), got {x.dtype}")


# --- Pallas implementations: float weights, differentiable ---------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm_float(lhs_MI, rhs_EIO, group_sizes_E, kernels, out_dtype, config, interpret):
  return kernels.gmm(lhs_MI, rhs_EIO, group_sizes_E, o=rhs_EIO.shape[2], transpose_rhs=False,
                     out_dtype=out_dtype, config=config, interpret=interpret)


def _gmm_float_fwd(lhs_MI, rhs_EIO, group_sizes_E, kernels, out_dtype, config, interpret):
  out_MO = _gmm_float(lhs_MI, rhs_EIO, group_sizes_E, kernels, out_dtype, config, interpret)
  return out_MO, (lhs_MI, rhs_EIO, group_sizes_E)


def _gmm_float_bwd(kernels, out_dtype, config, interpret, res, dout_MO):
  del out_dtype, config
  lhs_MI, rhs_EIO, group_sizes_E = res
  e, i, o = rhs_EIO.shape
  dlhs_cfg, drhs_cfg = kernels.backward_configs(lhs_MI.shape[0], i, o, e)
  # The cotangent in the inputs' dtype (bf16 stays on the fast tensor-core path even
  # when the forward returned f32 via preferred_element_type).
  dout_MO = dout_MO.astype(jnp.promote_types(lhs_MI.dtype, rhs_EIO.dtype))
  # dlhs[m] = dout[m] @ rhs[g].T: a gmm reading rhs transposed (no copy).
  dlhs_MI = kernels.gmm(dout_MO, rhs_EIO, group_sizes_E, o=i, transpose_rhs=True,
                        out_dtype=lhs_MI.dtype, config=dlhs_cfg, interpret=interpret)
  # drhs[g] = lhs[rows of g].T @ dout[rows of g].
  drhs_EIO = kernels.tgmm(lhs_MI, dout_MO, group_sizes_E, config=drhs_cfg, lhs_im=False,
                          out_dtype=rhs_EIO.dtype, interpret=interpret)
  return dlhs_MI, drhs_EIO, None


_gmm_float.defvjp(_gmm_float_fwd, _gmm_float_bwd)


# --- Pallas implementations: quantized weights, gradient w.r.t. lhs only --------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm_quant(lhs_MI, q, group_sizes_E, kernels, out_dtype, config, interpret):
  return kernels.gmm(lhs_MI, q.codes, group_sizes_E, q.scales, o=q.shape[2],
                     transpose_rhs=False, out_dtype=out_dtype, config=config,
                     interpret=interpret, bits=q.bits, scale_group=q.group_size)


def _gmm_quant_fwd(lhs_MI, q, group_sizes_E, kernels, out_dtype, config, interpret):
  out_MO = _gmm_quant(lhs_MI, q, group_sizes_E, kernels, out_dtype, config, interpret)
  return out_MO, (lhs_MI, q, group_sizes_E)


def _gmm_quant_bwd(kernels, out_dtype, config, interpret, res, dout_MO):
  del out_dtype, config
  lhs_MI, q, group_sizes_E = res
  e, i, o = q.shape
  dlhs_cfg, _ = kernels.backward_configs(lhs_MI.shape[0], i, o, e)
  w_EIO = dequantize_expert_weights(q, dout_MO.dtype)  # materialized for the backward only
  dlhs_MI = kernels.gmm(dout_MO, w_EIO, group_sizes_E, o=i, transpose_rhs=True,
                        out_dtype=lhs_MI.dtype, config=dlhs_cfg, interpret=interpret)
  dcodes = np.zeros(q.codes.shape, jax.dtypes.float0)  # integer codes: no gradient
  dq = QuantizedExpertWeights(dcodes, jnp.zeros_like(q.scales), q.bits, q.group_size)
  return dlhs_MI, dq, None


_gmm_quant.defvjp(_gmm_quant_fwd, _gmm_quant_bwd)


# --- one entry per implementation: Unsupported before any work -----------------


def _gmm_pallas(name, lhs_MI, rhs, group_sizes_E, *, config, out_dtype, interpret):
  kernels = _kernels(name)
  quantized = isinstance(rhs, QuantizedExpertWeights)
  kernels.check(interpret, quantized=quantized)
  (m, i), (e, _, o) = lhs_MI.shape, rhs.shape
  cfg = kernels.forward_config(config, m, i, o, e, interpret=interpret, quantized=quantized,
                               quant_group=rhs.group_size if quantized else None)
  if m == 0 or i == 0 or o == 0:
    return jnp.zeros((m, o), out_dtype)
  fn = _gmm_quant if quantized else _gmm_float
  return fn(lhs_MI, rhs, group_sizes_E, kernels, out_dtype, cfg, interpret)


def _gmm_xla(lhs_MI, rhs, group_sizes_E, *, config, out_dtype, interpret):
  del config, interpret
  if 0 in lhs_MI.shape or 0 in rhs.shape:
    return jnp.zeros((lhs_MI.shape[0], rhs.shape[2]), out_dtype)
  return xla.gmm(lhs_MI, rhs, group_sizes_E, out_dtype=out_dtype)


def _tgmm_pallas(name, lhs_IM, rhs_MO, group_sizes_E, *, config, out_dtype, interpret):
  kernels = _kernels(name)
  kernels.check(interpret)
  (i, m), o, e = lhs_IM.shape, rhs_MO.shape[1], group_sizes_E.shape[0]
  cfg = kernels.forward_config(config, m, i, o, e, interpret=interpret, op="tgmm")
  if m == 0 or i == 0 or o == 0:
    return jnp.zeros((e, i, o), out_dtype)
  return kernels.tgmm(lhs_IM, rhs_MO, group_sizes_E, config=cfg, lhs_im=True,
                      out_dtype=out_dtype, interpret=interpret)


def _tgmm_xla(lhs_IM, rhs_MO, group_sizes_E, *, config, out_dtype, interpret):
  del config, interpret
  (i, m), o, e = lhs_IM.shape, rhs_MO.shape[1], group_sizes_E.shape[0]
  if m == 0 or i == 0 or o == 0:
    return jnp.zeros((e, i, o), out_dtype)
  return xla.tgmm(lhs_IM, rhs_MO, group_sizes_E, lhs_im=True, out_dtype=out_dtype)


_GMM = {"triton": functools.partial(_gmm_pallas, "triton"),
        "tpu": functools.partial(_gmm_pallas, "tpu"), "xla": _gmm_xla}
_TGMM = {"triton": functools.partial(_tgmm_pallas, "triton"),
         "tpu": functools.partial(_tgmm_pallas, "tpu"), "xla": _tgmm_xla}


# --- public ----------------------------------------------------------------------


def gmm(lhs_MI, rhs_EIO, group_sizes_E, *, preferred_element_type=None,
        implementation: str | Sequence[str] | None = None,
        config: TritonConfig | TpuConfig | None = None, interpret: bool | None = None):
  """Grouped matmul: out[m] = lhs[m] @ rhs[g(m)] for rows sorted by group.

  Args:
    lhs_MI: [M, I] float (bf16/f16/f32), rows sorted by group.
    rhs_EIO: [E, I, O] float, or a QuantizedExpertWeights of that shape (int8 / packed
      int4 codes; differentiable w.r.t. lhs only, the weights get zero cotangents).
    group_sizes_E: [E] integer; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
      Rows at or beyond sum(group_sizes) are ZERO in the output. Sizes are clipped so
      that their sum is at most M.
    preferred_element_type: output dtype (default lhs.dtype); accumulation is f32.
    implementation: None (default order), "triton", "tpu", "xla", or a sequence tried
      in order (an implementation that cannot take the inputs is skipped).
    config: TritonConfig / TpuConfig for the forward kernel of that implementation.
    interpret: None = interpret unless on a GPU or TPU (Pallas implementations only).

  Returns:
    out_MO: [M, O]. Differentiable w.r.t. lhs and float rhs; the backward casts the
    output cotangent to the inputs' dtype (bf16 inputs: bf16 products, f32
    accumulation). lhs and rhs of different float dtypes are promoted; f32 products in
    the Pallas kernels are IEEE f32 (slow on tensor cores): pass bf16 for speed.
  """
  quantized = isinstance(rhs_EIO, QuantizedExpertWeights)
  if getattr(lhs_MI, "ndim", None) != 2:
    raise ValueError(f"lhs must be [M, I], got shape {getattr(lhs_MI, 'shape', None)}")
  shape = rhs_EIO.shape if quantized else getattr(rhs_EIO, "shape", None)
  if shape is None or len(shape) != 3:
    raise ValueError(f"rhs must be [E, I, O], got shape {shape}")
  if lhs_MI.shape[1] != shape[1]:
    raise ValueError(
        f"lhs I={lhs_MI.shape[1]} does not match rhs I={shape[1]} (rhs shape {shape})")
  _check_float("lhs", lhs_MI)
  if not quantized:
    _check_float("rhs", rhs_EIO)
  _check_group_sizes(group_sizes_E, shape[0])
  out_dtype = jnp.dtype(preferred_element_type or lhs_MI.dtype)
  return impl_lib.dispatch(
      "gmm", _GMM, implementation, _default_order, config, _CONFIGS,
      lhs_MI, rhs_EIO, group_sizes_E, out_dtype=out_dtype,
      interpret=impl_lib.resolve_interpret(interpret))


def tgmm(lhs_IM, rhs_MO, group_sizes_E, *, preferred_element_type=None,
         implementation: str | Sequence[str] | None = None,
         config: TritonConfig | TpuConfig | None = None, interpret: bool | None = None):
  """Transposed grouped matmul: out[g] = lhs[:, rows of g] @ rhs[rows of g].

  Args:
    lhs_IM: [I, M] float; rhs_MO: [M, O] float; rows (columns of lhs) sorted by group.
    group_sizes_E: [E] integer; rows past sum(group_sizes) are ignored; a group of
      size 0 gives zeros.
    preferred_element_type, implementation, config, interpret: as for ``gmm``.

  Returns:
    out_EIO: [E, I, O]. This is the weight gradient of gmm (whose backward calls the
    kernel on lhs [M, I] directly). Not differentiable itself.
  """
  for name, x in (("lhs", lhs_IM), ("rhs", rhs_MO)):
    if getattr(x, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(x, 'shape', None)}")
    _check_float(name, x)
  if rhs_MO.shape[0] != lhs_IM.shape[1]:
    raise ValueError(f"lhs is [I, M] with M={lhs_IM.shape[1]} but rhs is [M, O] with "
                     f"M={rhs_MO.shape[0]}")
  _check_group_sizes(group_sizes_E, None)
  out_dtype = jnp.dtype(preferred_element_type or lhs_IM.dtype)
  return impl_lib.dispatch(
      "tgmm", _TGMM, implementation, _default_order, config, _CONFIGS,
      lhs_IM, rhs_MO, group_sizes_E, out_dtype=out_dtype,
      interpret=impl_lib.resolve_interpret(interpret))
