"""Grouped (ragged) matmul for Mixture-of-Experts: gmm, tgmm, quantized-weight gmm.

Rows of ``lhs`` are sorted by expert: group g owns ``group_sizes[g]`` consecutive
rows starting at ``sum(group_sizes[:g])``. Work is split into (group, row-tile)
work tiles (gmm_plan.py), so an expert with no rows costs no weight reads: at
decode, the bytes read are about the routed experts' weights only.

Backends: GPU and CPU-interpret use the Triton-style kernels of gmm_gpu.py; TPU
uses the block-spec kernel of gmm_tpu.py. Accumulation is float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _platform
from pallas_kernels.gmm_gpu import gmm_gpu, tgmm_gpu
from pallas_kernels.gmm_plan import GmmTiling, default_tiling, make_tile_metadata
from pallas_kernels.gmm_quant import QuantizedExpertWeights, dequantize_expert_weights

__all__ = ["gmm", "tgmm", "GmmTiling", "default_tiling"]


def _check_group_sizes(group_sizes_E, e: int):
  if getattr(group_sizes_E, "ndim", None) != 1 or group_sizes_E.shape[0] != e:
    raise ValueError(
        f"group_sizes must be [E] with E={e} (number of experts), got shape "
        f"{getattr(group_sizes_E, 'shape', None)}")
  if not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array, got {group_sizes_E.dtype}")


def _check_float(name, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating array (bf16/f16/f32), got {x.dtype}")


def _check_tiling(tiling):
  if tiling is not None and not isinstance(tiling, GmmTiling):
    raise ValueError(f"tiling must be a GmmTiling or None, got {type(tiling).__name__}")


def _use_tpu(interpret: bool) -> bool:
  return not interpret and _platform.backend() == "tpu"


def _gmm_call(lhs_MK, rhs, group_sizes_E, *, n, transpose_rhs, out_dtype, tiling,
              interpret, scales=None, bits=None, scale_group=None):
  m = lhs_MK.shape[0]
  if _use_tpu(interpret):
    from pallas_kernels import gmm_tpu  # only where a TPU is present
    if bits is not None:  # no in-kernel dequantization on TPU yet
      rhs = dequantize_expert_weights(
          QuantizedExpertWeights(rhs, scales, bits, scale_group), lhs_MK.dtype)
    return gmm_tpu.gmm_tpu(lhs_MK, rhs, group_sizes_E, n=n, tiling=tiling,
                           transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  meta = make_tile_metadata(group_sizes_E, m, tiling.bm)
  return gmm_gpu(lhs_MK, rhs, meta, scales, n=n, tiling=tiling, transpose_rhs=transpose_rhs,
                 out_dtype=out_dtype, interpret=interpret, bits=bits, scale_group=scale_group)


def _tgmm_call(lhs, rhs_MN, group_sizes_E, *, lhs_km, out_dtype, tiling, interpret):
  e = group_sizes_E.shape[0]
  m = rhs_MN.shape[0]
  if _use_tpu(interpret):
    from pallas_kernels import gmm_tpu
    return gmm_tpu.tgmm_tpu(lhs, rhs_MN, group_sizes_E, tiling=tiling, lhs_km=lhs_km,
                            out_dtype=out_dtype)
  offsets_E1 = make_tile_metadata(group_sizes_E, m, tiling.bm).offsets_E1
  return tgmm_gpu(lhs, rhs_MN, offsets_E1, num_groups=e, tiling=tiling, lhs_km=lhs_km,
                  out_dtype=out_dtype, interpret=interpret)


# --- float weights: differentiable -------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_float(lhs_MK, rhs_EKN, group_sizes_E, out_dtype, tiling, interpret):
  n = rhs_EKN.shape[2]
  return _gmm_call(lhs_MK, rhs_EKN, group_sizes_E, n=n, transpose_rhs=False,
                   out_dtype=out_dtype, tiling=tiling, interpret=interpret)


def _gmm_float_fwd(lhs_MK, rhs_EKN, group_sizes_E, out_dtype, tiling, interpret):
  out = _gmm_float(lhs_MK, rhs_EKN, group_sizes_E, out_dtype, tiling, interpret)
  return out, (lhs_MK, rhs_EKN, group_sizes_E)


def _gmm_float_bwd(out_dtype, tiling, interpret, res, dout_MN):
  del out_dtype, tiling
  lhs_MK, rhs_EKN, group_sizes_E = res
  e, k, n = rhs_EKN.shape
  m = lhs_MK.shape[0]
  # The cotangent in the inputs' dtype (bf16 stays on the fast tensor-core path even
  # when the forward returned f32 via preferred_element_type).
  dout_MN = dout_MN.astype(jnp.promote_types(lhs_MK.dtype, rhs_EKN.dtype))
  # dlhs[m] = dout[m] @ rhs[g].T: a gmm reading rhs transposed (no copy).
  dlhs_MK = _gmm_call(dout_MN, rhs_EKN, group_sizes_E, n=k, transpose_rhs=True,
                      out_dtype=lhs_MK.dtype, tiling=default_tiling(m, n, k, e),
                      interpret=interpret)
  # drhs[g] = lhs[rows of g].T @ dout[rows of g].
  drhs_EKN = _tgmm_call(lhs_MK, dout_MN, group_sizes_E, lhs_km=False,
                        out_dtype=rhs_EKN.dtype,
                        tiling=default_tiling(m, k, n, e, op="tgmm"), interpret=interpret)
  return dlhs_MK, drhs_EKN, None


_gmm_float.defvjp(_gmm_float_fwd, _gmm_float_bwd)


# --- quantized weights: forward, gradient w.r.t. lhs only ---------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_quant(lhs_MK, q, group_sizes_E, out_dtype, tiling, interpret):
  _, k, n = q.shape
  return _gmm_call(lhs_MK, q.codes, group_sizes_E, n=n, transpose_rhs=False,
                   out_dtype=out_dtype, tiling=tiling, interpret=interpret,
                   scales=q.scales, bits=q.bits, scale_group=q.group_size)


def _gmm_quant_fwd(lhs_MK, q, group_sizes_E, out_dtype, tiling, interpret):
  return _gmm_quant(lhs_MK, q, group_sizes_E, out_dtype, tiling, interpret), (
      lhs_MK, q, group_sizes_E)


def _gmm_quant_bwd(out_dtype, tiling, interpret, res, dout_MN):
  del out_dtype, tiling
  lhs_MK, q, group_sizes_E = res
  e, k, n = q.shape
  w_EKN = dequantize_expert_weights(q, dout_MN.dtype)  # materialized for the backward only
  dlhs_MK = _gmm_call(dout_MN, w_EKN, group_sizes_E, n=k, transpose_rhs=True,
                      out_dtype=lhs_MK.dtype, tiling=default_tiling(lhs_MK.shape[0], n, k, e),
                      interpret=interpret)
  dcodes = np.zeros(q.codes.shape, jax.dtypes.float0)  # integer codes: no gradient
  dq = QuantizedExpertWeights(dcodes, jnp.zeros_like(q.scales), q.bits, q.group_size)
  return dlhs_MK, dq, None


_gmm_quant.defvjp(_gmm_quant_fwd, _gmm_quant_bwd)


def _quant_tiling(tiling: GmmTiling, q: QuantizedExpertWeights, interpret: bool) -> GmmTiling:
  """bk must divide the scale group so that each K step uses one row of scales."""
  if q.group_size is None:
    return tiling
  pow2 = q.group_size & -q.group_size
  bk = min(tiling.bk, pow2)
  if bk < 16 and not interpret:
    raise ValueError(
        f"group_size={q.group_size} needs a K tile of {bk} < 16 rows; use a group size "
        "divisible by 16")
  return tiling if bk == tiling.bk else GmmTiling(**{**tiling.__dict__, "bk": bk})


def gmm(lhs_MK, rhs_EKN, group_sizes_E, *, preferred_element_type=None,
        tiling: GmmTiling | None = None, interpret: bool | None = None):
  """Grouped matmul: out[m] = lhs[m] @ rhs[g(m)] for rows sorted by group.

  Args:
    lhs_MK: [M, K] float (bf16/f32), rows sorted by group.
    rhs_EKN: [E, K, N] float, or a QuantizedExpertWeights of that shape (int8 /
      packed int4 codes dequantized in the kernel; differentiable w.r.t. lhs
      only, the weights get zero cotangents).
    group_sizes_E: [E] integer; group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
      Rows at or beyond sum(group_sizes) are ZERO in the output. Sizes are clipped
      so that their sum is at most M.
    preferred_element_type: output dtype (default lhs.dtype); accumulation is f32.
    tiling: GmmTiling for the forward kernel (default: default_tiling(M, K, N, E));
      the backward kernels use their own default tilings.
    interpret: None = decide from the backend (interpret on CPU).

  Returns:
    out_MN: [M, N]. Differentiable (jax.custom_vjp) w.r.t. lhs and float rhs; the
    backward casts the output cotangent to the inputs' dtype (bf16 inputs: bf16 products,
    f32 accumulation). lhs and rhs of different float dtypes are promoted in the
    kernel; f32 products run in IEEE f32 (slow on tensor cores): pass bf16 for speed.
  """
  quantized = isinstance(rhs_EKN, QuantizedExpertWeights)
  if getattr(lhs_MK, "ndim", None) != 2:
    raise ValueError(f"lhs must be [M, K], got shape {getattr(lhs_MK, 'shape', None)}")
  shape = rhs_EKN.shape if quantized else getattr(rhs_EKN, "shape", None)
  if shape is None or len(shape) != 3:
    raise ValueError(f"rhs must be [E, K, N], got shape {shape}")
  e, k, n = shape
  if lhs_MK.shape[1] != k:
    raise ValueError(f"lhs K={lhs_MK.shape[1]} does not match rhs K={k} (rhs shape {shape})")
  _check_float("lhs", lhs_MK)
  if not quantized:
    _check_float("rhs", rhs_EKN)
  _check_group_sizes(group_sizes_E, e)
  _check_tiling(tiling)
  out_dtype = jnp.dtype(preferred_element_type or lhs_MK.dtype)
  m = lhs_MK.shape[0]
  if m == 0 or n == 0:
    return jnp.zeros((m, n), out_dtype)
  interpret = _platform.resolve_interpret(interpret)
  tiling = tiling or default_tiling(m, k, n, e)
  if quantized:
    return _gmm_quant(lhs_MK, rhs_EKN, group_sizes_E, out_dtype,
                      _quant_tiling(tiling, rhs_EKN, interpret), interpret)
  return _gmm_float(lhs_MK, rhs_EKN, group_sizes_E, out_dtype, tiling, interpret)


def tgmm(lhs_KM, rhs_MN, group_sizes_E, *, preferred_element_type=None,
         tiling: GmmTiling | None = None, interpret: bool | None = None):
  """Transposed grouped matmul: out[g] = lhs[:, rows of g] @ rhs[rows of g] -> [E, K, N].

  Args:
    lhs_KM: [K, M] float; rhs_MN: [M, N] float; rows (columns of lhs) sorted by group.
    group_sizes_E: [E] integer; rows past sum(group_sizes) are ignored; a group of
      size 0 gives zeros.
  This is the weight gradient of gmm (which calls the kernel on lhs [M, K]
  directly). Not differentiable itself.
  """
  for name, x in (("lhs", lhs_KM), ("rhs", rhs_MN)):
    if getattr(x, "ndim", None) != 2:
      raise ValueError(f"{name} must be 2-D, got shape {getattr(x, 'shape', None)}")
    _check_float(name, x)
  k, m = lhs_KM.shape
  if rhs_MN.shape[0] != m:
    raise ValueError(f"lhs is [K, M] with M={m} but rhs is [M, N] with M={rhs_MN.shape[0]}")
  if getattr(group_sizes_E, "ndim", None) != 1:
    raise ValueError(
        f"group_sizes must be [E], got shape {getattr(group_sizes_E, 'shape', None)}")
  e = group_sizes_E.shape[0]
  _check_group_sizes(group_sizes_E, e)
  _check_tiling(tiling)
  n = rhs_MN.shape[1]
  out_dtype = jnp.dtype(preferred_element_type or lhs_KM.dtype)
  if m == 0 or k == 0 or n == 0:
    return jnp.zeros((e, k, n), out_dtype)
  interpret = _platform.resolve_interpret(interpret)
  tiling = tiling or default_tiling(m, k, n, e, op="tgmm")
  return _tgmm_call(lhs_KM, rhs_MN, group_sizes_E, lhs_km=True, out_dtype=out_dtype,
                    tiling=tiling, interpret=interpret)
