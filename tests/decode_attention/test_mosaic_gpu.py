"""The Mosaic GPU implementation (``decode_attention/mosaic_gpu.py``, Hopper only) on a CPU
machine: which layouts it takes, ``Unsupported`` for the rest, the in-place code reads
(``read_plan``) bit for bit in numpy, and the kernel traced and lowered for CUDA, with the
structure of its Mosaic GPU module checked. It has no interpret mode (the dequantization is
inline PTX on MMA registers): its numerics are tests/decode_attention/test_gpu.py's."""
import collections
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.interpreters import mlir

from pallas_kernels import Unsupported, _implementation
from pallas_kernels.decode_attention import api, mosaic_gpu, mosaic_gpu_ptx
from pallas_kernels.decode_attention.mosaic_gpu import MosaicGpuConfig
from pallas_kernels.kv import packing
from pallas_kernels.kv import quant as kq


def _layout(a=128, max_len=4096, **kw):
  cfg = kq.KVQuantConfig(**{"bits": 2, "group_size": 32, "outlier_fraction": 0.02, **kw})
  return kq.KVLayout(cfg, a, max_len)


@pytest.mark.parametrize("kw,ratio,reason", [
    ({}, 4, None),                                                   # 2-bit, 3 outlier channels
    ({"bits": 3}, 4, None),
    ({"bits": 4, "outlier_fraction": 0.0}, 8, None),
    ({"bits": 8, "outlier_fraction": 0.03}, 16, None),               # 4 outliers, 16 heads
    ({"group_size": 64}, 1, None),
    ({"group_size": 128, "residual_window": 128}, 4, None),          # a multiple of the slot
    ({"outlier_fraction": 0.05}, 4, "at most 4 outlier channels, got 6"),
    ({"outlier_fraction": 0.15}, 4, "D_pad a multiple of 64, got 112"),     # 109 low-bit channels
    ({"bits": 3, "group_size": 64}, 4, "5-element vectors"),           # fp8 (5, 128) metadata tile
    ({"bits": 3, "group_size": 64, "meta_dtype": "bfloat16"}, 4, "needs float8_e4m3fn metadata"),
    ({"meta_dtype": "float16"}, 4, "16-bit zero-points lose precision"),
    ({"key_axis": "token", "value_axis": "channel"}, 4, "keys per channel and values per token"),
    ({"group_size": 16}, 4, "group_size 16 must be >= 32"),
    ({"bits": 3, "group_size": 128}, 4, "divide 320"),                # 3-bit tiles: 320 tokens
    ({}, 32, "at most 16 query heads per kv-head, got 32"),
    ({"a": 96}, 4, "D_pad a multiple of 64, got 96"),
    ({"max_len": 64, "residual_window": 64}, 4, "no quantized region"),
])
def test_supports(kw, ratio, reason):
  lay = _layout(**kw)
  assert mosaic_gpu.supports(lay, ratio) is (reason is None)
  got = mosaic_gpu.unsupported_reason(lay, ratio)
  assert (got is None) if reason is None else (reason in got), got


def _kv(frac=0.02, b=1, n=2, max_len=256, **kw):
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=frac, **kw)
  return jax.eval_shape(lambda: kq.empty_kv(cfg, b, n, 128, max_len))


def test_unsupported_inputs_are_clear_errors():
  q = jnp.zeros((1, 8, 128), jnp.bfloat16)
  with pytest.raises(Unsupported, match="Mosaic GPU kernel has no interpret mode"):
    api.decode_attention(q, _kv(), implementation="mosaic_gpu")          # interpret=None on a CPU
  with pytest.raises(Unsupported, match="Mosaic GPU kernel at most 4 outlier channels, got 6"):
    api.decode_attention(q, _kv(0.05), implementation="mosaic_gpu", interpret=False)
  with pytest.raises(Unsupported, match="at most 16 query heads per kv-head"):
    api.decode_attention(jnp.zeros((1, 64, 128), jnp.bfloat16), _kv(), implementation="mosaic_gpu",
                         interpret=False)
  if not _implementation.is_hopper():
    with pytest.raises(Unsupported, match="needs a Hopper GPU"):
      api.decode_attention(q, _kv(), implementation="mosaic_gpu", interpret=False)


def test_is_hopper_is_false_on_cpu():
  assert jax.default_backend() != "cpu" or not _implementation.is_hopper()


@pytest.mark.parametrize("kw,match", [({"num_splits": 0}, "num_splits"), ({"num_splits": True}, "num_splits"),
                                      ({"target_programs": 0}, "target_programs")])
def test_bad_configs_are_clear_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    MosaicGpuConfig(**kw)


@pytest.mark.parametrize("n_tiles,batch_heads,config,want", [
    (8, 64, MosaicGpuConfig(), (4, 2)),                 # 256 programs wanted: 4 per (b, n)
    (64, 8, MosaicGpuConfig(), (32, 2)),
    (8, 1, MosaicGpuConfig(), (8, 1)),                  # at most one split per tile
    (6, 1, MosaicGpuConfig(num_splits=4), (3, 2)),      # a divisor of the tile count
    (7, 2, MosaicGpuConfig(num_splits=4), (1, 7)),
    (8, 64, MosaicGpuConfig(target_programs=64), (1, 8)),
])
def test_splits_divide_the_tiles(n_tiles, batch_heads, config, want):
  ns, bps = mosaic_gpu._choose_splits(n_tiles, batch_heads, config)
  assert (ns, bps) == want and ns * bps == n_tiles


# --- in-place code reads ------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_read_plan_places_every_slot_inside_the_mantissa(bits):
  """After the plan's rotations (cumulative over the tile) each slot's codes sit at the
  position it reads them from, inside the mantissa, with a multiplier <= max(64, 2**bits);
  at 2 bits three rotations serve eight slots (the rotate-per-slot form needs seven)."""
  cpw = packing.codes_per_word(bits, 16)
  plan = mosaic_gpu_ptx.read_plan(bits, cpw)
  assert sorted(plan) == list(range(cpw))
  lo, hi = min(4, 10 - bits), 10 - bits
  rot = 0
  for j in range(cpw):
    delta, pos = plan[j]
    rot = (rot + delta) % 32
    assert (bits * j - rot) % 32 == pos and lo <= pos <= hi, (j, plan[j])
    assert 2 ** (10 - pos) <= max(64, 2 ** bits)
  if bits == 2:
    assert sum(1 for d, _ in plan.values() if d) == 3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_in_place_dequantization_in_numpy(bits):
  """The in-place arithmetic bit for bit: codes packed as the cache packs them (slot j at
  bits [bits * j, bits * (j + 1)) of each 16-bit half), the plan's rotations of the 32-bit
  register, the lop3 mask at the slot's position with 1.0 ORed in, then one fp16 fma with
  s2 = s * 2**(10 - pos) and z2 = z - s2 rounded to fp16: within the rounding of z2 (at most
  (s * 2**(10 - pos) + |z|) * 2**-11, i.e. 1/32 of a quantization step at 2**(10 - pos) = 64)
  and of the result of s * code + z."""
  rng = np.random.default_rng(bits)
  cpw, n = packing.codes_per_word(bits, 16), 4096
  codes = rng.integers(0, 1 << bits, size=(cpw, 2, n)).astype(np.uint32)   # slot, half, pair
  halves = sum(codes[j] << (bits * j) for j in range(cpw))                  # [2, n] 16-bit words
  w = halves[0] | (halves[1] << 16)
  s = rng.uniform(0.01, 8.0, size=n).astype(np.float16)
  z = rng.uniform(-40.0, 40.0, size=n).astype(np.float16)
  plan = mosaic_gpu_ptx.read_plan(bits, cpw)
  for j in range(cpw):
    delta, pos = plan[j]
    w = ((w >> delta) | (w << (32 - delta))) & 0xFFFFFFFF if delta else w      # in place
    mask = ((1 << bits) - 1) << pos
    t = (w & (mask | (mask << 16))) | 0x3C003C00
    m = np.float16(2.0 ** (10 - pos))
    s2 = (s * m).astype(np.float16)                                          # exact: a power of two
    z2 = (z.astype(np.float64) - s2).astype(np.float16)
    for half in (0, 1):
      v = ((t >> (16 * half)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
      x = (v * s2 + z2.astype(np.float64)).astype(np.float16).astype(np.float64)   # one fma
      want = s.astype(np.float64) * codes[j, half] + z
      tol = (float(m) * s.astype(np.float64) + np.abs(z) + np.abs(want)) * 2.0 ** -11 + 1e-6
      assert np.all(np.abs(x - want) <= tol), (j, half, np.max(np.abs(x - want) / tol))


# --- lowering for CUDA (no GPU needed) ----------------------------------------------------

def _lower(bits=2, group=32, frac=0.02, heads=8, meta="float8_e4m3fn", b=2, n=2, max_len=4096,
           config=MosaicGpuConfig()):
  """(the Mosaic GPU module as text, without locations; the whole lowered call as text) of
  ``_decode_attention_mosaic`` (the jitted kernel pair, no device check), lowered for CUDA."""
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, outlier_fraction=frac, residual_window=group,
                         sink_tokens=4, meta_dtype=meta)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, b, n, 128, max_len))
  q = jax.ShapeDtypeStruct((b, n * heads, 128), jnp.bfloat16)
  assert mosaic_gpu.supports(kv.layout, heads)
  modules = []
  rule = mosaic_core._mosaic_gpu_lowering_rule

  def spy(ctx, *a, module, **kw):
    modules.append(module.operation.get_asm(enable_debug_info=False))
    return rule(ctx, *a, module=module, **kw)

  mosaic_core._mosaic_gpu_lowering_rule = spy          # looked up by name at lowering time
  mlir.register_lowering(mosaic_core.mosaic_gpu_p, spy, "cuda")
  try:
    fn = lambda q, kv: mosaic_gpu._decode_attention_mosaic(q, kv, sm_scale=128 ** -0.5, config=config)
    text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    mosaic_core._mosaic_gpu_lowering_rule = rule
    mlir.register_lowering(mosaic_core.mosaic_gpu_p, rule, "cuda")
  assert len(modules) == 1
  return modules[0], text


@pytest.mark.parametrize("bits,group,frac,heads,meta", [
    (2, 32, 0.02, 4, "float8_e4m3fn"),
    (2, 128, 0.0, 16, "float8_e4m3fn"),     # groups of two slots: rotate-per-slot reads
    (3, 32, 0.03, 8, "float8_e4m3fn"),      # 320-token tiles, 4 outliers
    (3, 32, 0.02, 1, "float8_e4m3fn"),
    (4, 64, 0.03, 16, "float8_e4m3fn"),
    (4, 32, 0.0, 8, "float8_e4m3fn"),
    (8, 128, 0.02, 4, "float8_e4m3fn"),
    (8, 64, 0.03, 12, "float8_e4m3fn"),     # 12 heads: MMA N = 16
])
def test_lowers_for_cuda(bits, group, frac, heads, meta):
  """Traces the whole kernel (metadata staging, in-place or rotated code reads,
  outliers in the MMA's padding columns, inline PTX) and the merge kernel, lowered for CUDA."""
  module, text = _lower(bits, group, frac, heads, meta)
  assert "mosaic_gpu" in text and "decode_attention_merge" in text
  assert "mma.sync.aligned.m16n8k16" in module


def _op_runs(text, markers):
  """The module's lines holding any of ``markers`` ({substring: letter}) as letters in
  program order, runs counted: 'T9 W64 T4'."""
  seq = [next(k for m, k in markers.items() if m in line) for line in text.splitlines()
         if any(m in line for m in markers)]
  return " ".join(f"{k}{len(list(g))}" for k, g in itertools.groupby(seq))


_COPY, _MMA = {"cp.async.bulk.tensor": "T"}, {"wgmma.mma_async": "W", "mma.sync.aligned": "W"}


@pytest.mark.parametrize("heads,mmas", [(8, 128), (16, 256)])
def test_each_warp_multiplies_its_own_rows_without_wgmma(heads, mmas):
  """A tile's scores and outputs are mma.sync (8 slots x 8 K-steps, 8 slots x 8 channel
  blocks, per 8 padded query heads) and no wgmma; the value words are transposed in
  registers once per tile (32 blocks) and each slot's p once per 8 tokens (2 per 8 heads)."""
  module, _ = _lower(heads=heads)
  assert module.count("mma.sync.aligned.m16n8k16") == mmas
  assert "wgmma" not in module
  assert module.count("movmatrix.sync.aligned.m8n8.trans.b16") == 32 + 8 * 2 * (mmas // 128)


def test_tile_zero_is_in_flight_while_the_query_arrives():
  """The first tile's 8 copies are issued right after the query's, before the program
  waits for the query."""
  module, _ = _lower()
  assert _op_runs(module, {**_COPY, "mbarrier.try_wait": "w"}).startswith("T9 w2 ")


def test_next_tile_is_fetched_early_with_outliers_late_without():
  """With outliers (staged per tile) the next tile's key half (4 copies) is fetched as soon
  as this tile's key words are in registers, before its score MMAs, and its value half
  before the output MMAs; without outliers, after them. Per tile: 8 slots x 8 K-steps of
  score MMAs, 8 slots x 8 channel blocks of output MMAs."""
  assert _op_runs(_lower(frac=0.02)[0], {**_COPY, **_MMA}) == "T13 W64 T4 W64"
  assert _op_runs(_lower(frac=0.0)[0], {**_COPY, **_MMA}) == "T9 W64 T4 W64 T4"


def test_in_place_reads_rotate_three_times_per_eight_slots():
  """Groups up to one slot read codes where a rotation left them (read_plan): at 2 bits
  3 rotations per tile where groups of 128 tokens rotate before every slot's read (8)."""
  rot = lambda group: _lower(group=group)[0].count("shf.r.wrap.b32")
  assert rot(32) * 8 == rot(128) * 3 > 0


def test_default_call_is_two_kernels_and_nothing_else():
  """The Mosaic kernel and the Triton merge: the query operand (scale, channel order,
  padding) and the quantized token count are built in the kernel, so no XLA op around them
  launches a GPU kernel (each cost 1-2 us plus a gap on an H200: ~4 us of a 0.118 ms call at
  B=8, 32k); in particular no sort or scatter (H200 trace, 2026-12-03: scatters 21 us,
  sorts 6 us, the Mosaic kernel 20 us at B = 1, 32k)."""
  _, text = _lower()
  ops = collections.Counter(re.findall(r"= (stablehlo\.[a-z_]+)", text))
  assert ops.pop("stablehlo.custom_call") == 2
  assert set(ops) <= {"stablehlo.reshape", "stablehlo.constant"}, ops
