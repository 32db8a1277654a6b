"""Decode attention on a plain bf16 (or fp16) cache ``k, v [B, N, S, A]``: the quantized
Triton kernel's shape (split-K programs, online softmax in log2 units, a jnp merge of the
splits' partials) with the keys and values read as they are."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode_attention.merge import NEG, scaled_queries
from pallas_kernels.decode_attention.merge import combine as _combine, pad_to as _pad_to
from pallas_kernels.decode_attention.triton import (
    _check_compilable, _check_splits, _choose_splits, _dot, _dot_t, _np2, _softmax_update, _tile)


@dataclasses.dataclass(frozen=True)
class TritonBf16Config:
  """Knobs of the bf16-cache Triton kernel: keys per block (a power of two >= 16), splits
  (None: about ``target_programs``), launch settings."""
  block_k: int = 64
  num_splits: int | None = None
  target_programs: int = 1024
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.block_k < 16 or self.block_k & (self.block_k - 1):
      raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
    _check_splits(self.num_splits)


def _bf16_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, t, bk, bps, gp, df, d):
  sidx = pl.program_id(2)
  L = jnp.minimum(len_ref[0], t)
  q = q_ref[...]
  start = sidx * bps * bk
  nblk = jnp.clip((L - start + bk - 1) // bk, 0, bps)
  rows0 = jnp.arange(bk, dtype=jnp.int32)
  cols = jnp.arange(df, dtype=jnp.int32)

  def body(i, carry):
    rows = start + i * bk + rows0
    k = _tile(k_ref, rows, cols, t, d)
    s = jnp.where((rows < L)[None, :], _dot_t(q, k), NEG)
    carry, p = _softmax_update(carry, s)
    m, l, (acc,) = carry
    v = _tile(v_ref, rows, cols, t, d)
    return (m, l, (acc + _dot(p, v),))

  init = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
          (jnp.zeros((gp, df), jnp.float32),))
  m, l, (acc,) = jax.lax.fori_loop(0, nblk, body, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def _decode_bf16(q, k, v, lengths, *, sm_scale, config: TritonBf16Config, interpret):
  b, hq, d = q.shape
  _, h, t, _ = k.shape
  g = hq // h
  gp = max(16, _np2(g))
  df = max(16, _np2(d))
  block_k = config.block_k
  num_blocks = -(-t // block_k)
  ns, bps = _choose_splits(num_blocks, b * h, config.num_splits, config.target_programs)
  qg = scaled_queries(q, h, sm_scale)
  qp = _pad_to(qg, (b, h, gp, df)).astype(jnp.bfloat16)
  kernel = functools.partial(_bf16_kernel, t=t, bk=block_k, bps=bps, gp=gp, df=df, d=d)
  full = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda bi, hi, si: (bi, hi, 0, 0))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, h, ns),
      in_specs=[pl.BlockSpec((1,), lambda bi, hi, si: (bi,)), full(qp), full(k), full(v)],
      out_specs=[pl.BlockSpec((None, None, None, gp, df), lambda bi, hi, si: (bi, hi, si, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (bi, hi, si, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (bi, hi, si, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, h, ns, gp, df), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, ns, gp), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, ns, gp), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="decode_attention_bf16",
  )(lengths.astype(jnp.int32), qp, k, v)
  (o,) = _combine(m, l, [o])
  return o[:, :, :g, :d].reshape(b, hq, d).astype(q.dtype)


def decode_attention_bf16_triton(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                                 sm_scale: float, config: TritonBf16Config | None = None,
                                 interpret: bool = False) -> jax.Array:
  """``q [B, H, A]``, ``k, v [B, N, S, A]`` (bf16 or f16, read as is), ``lengths int[B]``
  -> ``[B, H, A]``."""
  _check_compilable(interpret)
  return _decode_bf16(q, k, v, lengths, sm_scale=float(sm_scale), config=config or TritonBf16Config(),
                      interpret=bool(interpret))
