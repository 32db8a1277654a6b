"""Quantized-KV decode attention shaped for TPUs (Pallas TPU / Mosaic), block-spec style.

The same function as the other implementations, for the TPU: one program
per (sequence, kv-head) walks the quantized region one ``[64, D_pad]`` tile of uint16
code words at a time (``cpw`` slots of 64 tokens: 512 tokens at 2 bits) on a
sequential grid axis, so the running max, sum and output stay in VMEM scratch. Per
slot, the codes are unpacked with int32 shifts and masks, scaled in float32 and fed
to the MXU as bf16 (scores ``[g, 64] = q . k^T``, ``acc += p . v``, float32
accumulation); they never exist dequantized in HBM. Metadata of either axis works:
per-channel statistics are repeated over their G tokens, per-token statistics
(stored token-minor, ``[n_groups, Cq]``) are spread over their G channels by a 0/1
matmul. Outlier channels are two small matmuls. Tiles past a sequence's quantized
length repeat the previous block index (no new DMA) and are skipped.

Sinks and the window ring are attended in plain jnp and merged by
``merge.merge_partials``. Blocks: code tiles ``(64, D_pad)`` (a multiple of
the 16-bit ``(16, 128)`` tiling for D_pad = 128), metadata ``(P / G, D_pad)`` or
``(n_groups, P)``, outliers ``(n_out, P)``. Tested on CPU in Pallas' TPU interpret
mode; not yet run on a TPU, where some layouts (e.g. 3-bit tiles of 320 tokens, fp8
metadata blocks of 16 rows) may need other block shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported
from pallas_kernels.kv import layout as kl
from pallas_kernels.kv.quant import QuantizedKV
from pallas_kernels.decode_attention.merge import NEG, merge_partials, pad_to, scaled_queries

SLOT = kl.PACK_STRIDE        # 64 tokens per code slot (word rows per tile)


def supports(layout: kl.KVLayout) -> bool:
  """Layouts this kernel takes: group sizes that divide a tile or are multiples of it."""
  g, tile = layout.config.group_size, layout.pack_tokens
  return tile % g == 0 or g % tile == 0


def check_supported(layout: kl.KVLayout):
  """Raises ``Unsupported`` for a layout ``supports`` refuses."""
  if not supports(layout):
    raise Unsupported(f"the TPU decode kernel needs group_size ({layout.config.group_size}) to "
                     f"divide the {layout.pack_tokens}-token tile or be a multiple of it")


def _slot_meta(x, axis, j, group, dp):
  """Scale or zero-point of slot j broadcast to its ``[64, D_pad]`` codes (float32).

  x: the tile's block: ``[max(1, P // G), D_pad]`` for axis="channel" (one row per G
  tokens), ``[n_groups, P]`` for axis="token" (one column per token)."""
  x = x.astype(jnp.float32)
  if axis == "channel":
    if group >= SLOT:                          # the whole slot lies in one group
      row = (j * SLOT) // group if x.shape[0] > 1 else 0
      return jnp.broadcast_to(x[row:row + 1], (SLOT, dp))
    n = SLOT // group
    rows = x[j * n:(j + 1) * n]                                         # [n, D_pad]
    return jnp.broadcast_to(rows[:, None, :], (n, group, dp)).reshape(SLOT, dp)
  cols = x[:, j * SLOT:(j + 1) * SLOT]                                   # [n_groups, 64]
  spread = (jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], dp), 1) // group
            == jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], dp), 0)).astype(jnp.float32)
  return jax.lax.dot_general(cols, spread, (((0,), (0,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)           # [64, D_pad]


def _kernel(nq_ref, *refs, names, lay: kl.KVLayout, n_tiles: int):
  r = dict(zip(names, refs))
  cfg = lay.config
  bits, cpw, group, dp, n_out = cfg.bits, lay.cpw, cfg.group_size, lay.d_pad, lay.n_out
  P = SLOT * cpw
  b, i = pl.program_id(0), pl.program_id(2)
  nq = nq_ref[b]
  m_ref, l_ref, acc_ref = r["m_scr"], r["l_scr"], r["acc_scr"]

  @pl.when(i == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    if n_out:
      r["acc_out_scr"][...] = jnp.zeros(r["acc_out_scr"].shape, jnp.float32)

  @pl.when(i * P < nq)
  def _tile():
    q_lo = r["q_lo"][...].astype(jnp.bfloat16)                          # [gp, D_pad]
    kw = r["k_codes"][...].astype(jnp.int32)                            # [64, D_pad]
    vw = r["v_codes"][...].astype(jnp.int32)
    mask = (1 << bits) - 1
    for j in range(cpw):
      tok = i * P + j * SLOT + jax.lax.broadcasted_iota(jnp.int32, (1, SLOT), 1)
      kc = ((kw >> (bits * j)) & mask).astype(jnp.float32)
      k = (kc * _slot_meta(r["k_scale"][...], cfg.key_axis, j, group, dp)
           + _slot_meta(r["k_zero"][...], cfg.key_axis, j, group, dp))
      s = jax.lax.dot_general(q_lo, k.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)       # [gp, 64]
      if n_out:
        ko = r["k_outliers"][:, j * SLOT:(j + 1) * SLOT].astype(jnp.float32)   # [n_out, 64]
        s = s + jnp.dot(r["q_out"][...], ko, preferred_element_type=jnp.float32)
      s = jnp.where(tok < nq, s, NEG)
      m_old = m_ref[...]                                                  # [gp, 1]
      m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
      corr = jnp.exp2(m_old - m_new)
      p = jnp.exp2(s - m_new)
      l_ref[...] = l_ref[...] * corr + jnp.sum(p, axis=1, keepdims=True)
      m_ref[...] = m_new
      vc = ((vw >> (bits * j)) & mask).astype(jnp.float32)
      v = (vc * _slot_meta(r["v_scale"][...], cfg.value_axis, j, group, dp)
           + _slot_meta(r["v_zero"][...], cfg.value_axis, j, group, dp))
      acc_ref[...] = acc_ref[...] * corr + jnp.dot(
          p.astype(jnp.bfloat16), v.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
      if n_out:
        vo = r["v_outliers"][:, j * SLOT:(j + 1) * SLOT].astype(jnp.float32)   # [n_out, 64]
        r["acc_out_scr"][...] = r["acc_out_scr"][...] * corr + jax.lax.dot_general(
            p, vo, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

  @pl.when(i == n_tiles - 1)
  def _store():
    r["o_lo"][...] = acc_ref[...]
    if n_out:
      r["o_out"][...] = r["acc_out_scr"][...]
    r["m"][...] = m_ref[...]
    r["l"][...] = l_ref[...]


def quantized_partials(qg, kv: QuantizedKV, *, interpret=False):
  """(m, l ``[B, N, 1, G]``, o_lo ``[B, N, 1, G, D_pad]``, o_out ``[B, N, 1, G, n_out]``)
  over the quantized region; qg ``[B, N, G, A]`` float32, already scaled (log2 units)."""
  lay = kv.layout
  cfg = lay.config
  b, h, g, d = qg.shape
  dp, n_out, group = lay.d_pad, lay.n_out, cfg.group_size
  P = lay.pack_tokens
  n_tiles = lay.cq // P
  gp = -(-g // 8) * 8                                     # query heads: sublane multiple
  nq = lay.num_quantized(kv.lengths).astype(jnp.int32)

  def last_tile(nq_ref, bi):
    return jnp.maximum((nq_ref[bi] + P - 1) // P - 1, 0)

  def meta_spec(axis):
    if axis == "channel":                                 # [B, N, Cq // gs, D_pad]
      rows = max(1, P // group)
      per = P // group if P >= group else None
      def idx(bi, hi, ti, nq_ref):
        t = jnp.minimum(ti, last_tile(nq_ref, bi))
        return (bi, hi, t if per else t * P // group, 0)
      return pl.BlockSpec((None, None, rows, dp), idx)
    return pl.BlockSpec((None, None, lay.n_groups_tok, P),                # [B, N, n_groups, Cq]
                        lambda bi, hi, ti, nq_ref: (bi, hi, 0, jnp.minimum(ti, last_tile(nq_ref, bi))))

  def tok_spec(n):                                         # [B, N, n, Cq], token-minor
    return pl.BlockSpec((None, None, n, P),
                        lambda bi, hi, ti, nq_ref: (bi, hi, 0, jnp.minimum(ti, last_tile(nq_ref, bi))))

  def per_head(shape):
    return pl.BlockSpec((None, None) + shape, lambda bi, hi, ti, nq_ref: (bi, hi) + (0,) * len(shape))

  codes_spec = pl.BlockSpec(
      (None, None, SLOT, dp),
      lambda bi, hi, ti, nq_ref: (bi, hi, jnp.minimum(ti, last_tile(nq_ref, bi)), 0))
  lo_idx = kl.low_channel_index(kv.k_outlier_idx, d)
  inputs = {"q_lo": pad_to(jnp.take_along_axis(qg, lo_idx[:, :, None, :], axis=3), (b, h, gp, dp))}
  specs = {"q_lo": per_head((gp, dp))}
  if n_out:
    q_out = jnp.take_along_axis(qg, kv.k_outlier_idx[:, :, None, :], axis=3)
    inputs["q_out"], specs["q_out"] = pad_to(q_out, (b, h, gp, n_out)), per_head((gp, n_out))
  for name, axis in (("k", cfg.key_axis), ("v", cfg.value_axis)):
    inputs[f"{name}_codes"], specs[f"{name}_codes"] = getattr(kv, f"{name}_codes"), codes_spec
    for f in ("scale", "zero"):
      inputs[f"{name}_{f}"], specs[f"{name}_{f}"] = getattr(kv, f"{name}_{f}"), meta_spec(axis)
    if n_out:
      inputs[f"{name}_outliers"], specs[f"{name}_outliers"] = (getattr(kv, f"{name}_outliers"),
                                                                tok_spec(n_out))
  f32 = jnp.float32
  outs = {"o_lo": (gp, dp), "m": (gp, 1), "l": (gp, 1)}
  if n_out:
    outs["o_out"] = (gp, n_out)
  scratch = {"m_scr": (gp, 1), "l_scr": (gp, 1), "acc_scr": (gp, dp)}
  if n_out:
    scratch["acc_out_scr"] = (gp, n_out)
  names = list(inputs) + list(outs) + list(scratch)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, h, n_tiles),
      in_specs=[specs[n] for n in inputs],
      out_specs=[per_head(s) for s in outs.values()],
      scratch_shapes=[pltpu.VMEM(s, f32) for s in scratch.values()],
  )
  res = pl.pallas_call(
      functools.partial(_kernel, names=names, lay=lay, n_tiles=n_tiles),
      out_shape=[jax.ShapeDtypeStruct((b, h) + s, f32) for s in outs.values()],
      grid_spec=grid_spec,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="decode_attention_tpu",
  )(nq, *inputs.values())
  res = dict(zip(outs, res))
  m = res["m"][:, :, None, :g, 0]
  l = res["l"][:, :, None, :g, 0]
  o_lo = res["o_lo"][:, :, None, :g]
  o_out = res["o_out"][:, :, None, :g] if n_out else None
  return m, l, o_lo, o_out


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def _decode_attention_tpu(q, kv: QuantizedKV, *, sm_scale: float, interpret: bool):
  b, hq, d = q.shape
  h = kv.num_heads
  qg = scaled_queries(q, h, sm_scale)
  if kv.layout.cq == 0:                          # no quantized region: window and sinks only
    g = hq // h
    z = jnp.zeros((b, h, 1, g), jnp.float32)
    m, l = jnp.full_like(z, NEG), z
    o_lo = jnp.zeros((b, h, 1, g, kv.layout.d_pad), jnp.float32)
    o_out = jnp.zeros((b, h, 1, g, kv.layout.n_out), jnp.float32)
  else:
    m, l, o_lo, o_out = quantized_partials(qg, kv, interpret=interpret)
  return merge_partials(qg, kv, m, l, o_lo, o_out).reshape(b, hq, d).astype(q.dtype)


def decode_attention_tpu(q: jax.Array, kv: QuantizedKV, *, sm_scale: float, config=None,
                         interpret: bool = False) -> jax.Array:
  """``q [B, H, A]`` attended to ``kv`` -> ``[B, H, A]`` (see the module docstring);
  compiled on a TPU, or in Pallas' TPU interpret mode anywhere. No tuning knobs."""
  del config
  if not interpret and impl_lib.platform() != "tpu":
    raise Unsupported(f"the TPU kernel compiles for TPUs only (device: {impl_lib.platform()}); "
                      "interpret=True runs it in TPU interpret mode")
  check_supported(kv.layout)
  return _decode_attention_tpu(q, kv, sm_scale=float(sm_scale), interpret=bool(interpret))
