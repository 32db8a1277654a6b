"""The Mosaic GPU decode kernel on a CPU machine: which layouts it takes, clear errors for
the rest, and that it traces and lowers for CUDA (its numerics are checked on a GPU by
experiments/check_decode_gpu.py --mosaic: the dequantization is inline PTX on MMA registers,
which has no interpret mode)."""
import collections
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import decode_attention_mgpu as dm
from pallas_kernels import kv_quant as kq
from pallas_kernels.decode_attention import choose_backend, decode_attention


def _layout(**kw):
  cfg = kq.KVQuantConfig(**{"bits": 2, "group_size": 32, "outlier_fraction": 0.02, **kw})
  return kq.KVLayout(cfg, 128, 4096)


@pytest.mark.parametrize("kw,ratio,ok", [
    ({}, 4, True),
    ({"bits": 3}, 4, True),
    ({"bits": 4, "outlier_fraction": 0.0}, 8, True),
    ({"group_size": 64}, 4, True),
    ({"outlier_fraction": 0.15}, 4, False),                           # 19 outlier channels > 4
    ({"key_axis": "token", "value_axis": "channel"}, 4, False),      # not KIVI's assignment
    ({"group_size": 16}, 4, False),                                    # groups below 32 tokens
    ({}, 32, False),                                                   # > 16 query heads per kv-head
])
def test_supports(kw, ratio, ok):
  assert dm.supports(_layout(**kw), ratio) is ok


def test_unsupported_layout_is_a_clear_error():
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.15)
  kv = kq.empty_kv(cfg, 1, 2, 128, 256)
  q = jnp.zeros((1, 8, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="Mosaic GPU decode kernel does not support"):
    decode_attention(q, kv, backend="mosaic")
  with pytest.raises(ValueError, match="backend must be"):
    decode_attention(q, kv, backend="cuda")


@pytest.mark.parametrize("bits,group,phase,inflight,frac,omma,stages,heads,split", [
    (2, 32, 8, 1, 0.02, False, 2, 8, False), (2, 32, 1, 0, 0.0, False, 1, 4, True),
    (3, 32, 2, 1, 0.02, False, 1, 4, False), (4, 64, 8, 1, 0.03, False, 2, 16, False),
    (8, 128, 8, 1, 0.0, True, 1, 4, False), (2, 32, 8, 1, 0.02, True, 1, 12, False),
    (4, 32, 4, 1, 0.03, True, 2, 4, False), (2, 32, 4, 1, 0.02, True, 1, 4, False),
    (2, 32, 8, 1, 0.02, True, 1, 4, True), (3, 32, 2, 1, 0.02, False, 1, 4, True)])
def test_lowers_for_cuda(bits, group, phase, inflight, frac, omma, stages, heads, split):
  """Traces the whole kernel (layouts, metadata staging, inline PTX, pipeline or the
  hand-written tile fetches of ``split_fetch``) and lowers it for CUDA."""
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, outlier_fraction=frac, residual_window=group)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 2 * heads, 128), jnp.bfloat16)    # heads per kv-head: MMA N 8 or 16
  fn = lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, phase_slots=phase,
                                              inflight=inflight, outliers_in_mma=omma,
                                              stages=stages, split_fetch=split)
  text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  # window and merge in the Triton merge kernel where the kernel writes the whole split form
  assert ("decode_attention_merge" in text) == dm._split_in_mma(kv.layout, omma)


@pytest.mark.parametrize("bits,frac,staged,inplace,meta", [
    (2, 0.02, False, False, "float8_e4m3fn"), (2, 0.02, True, False, "float8_e4m3fn"),
    (3, 0.03, True, False, "float8_e4m3fn"), (4, 0.03, True, False, "float8_e4m3fn"),
    (8, 0.02, True, False, "float8_e4m3fn"), (2, 0.0, True, False, "float8_e4m3fn"),
    (2, 0.02, True, True, "float8_e4m3fn"), (3, 0.02, True, True, "float8_e4m3fn"),
    (4, 0.0, False, True, "bfloat16"), (8, 0.02, True, True, "float16")])
def test_lowers_for_cuda_outlier_staging(bits, frac, staged, inplace, meta):
  """Outliers patched per register (staged=False) or staged once per tile as fp16 (3 or 4
  outlier channels: odd and even first columns; 3-bit tiles of 320 tokens, not a multiple
  of the 128 threads that stage them); codes read in place (``in_place_codes``, its slot
  multipliers in each metadata dtype)."""
  cfg = kq.KVQuantConfig(bits=bits, group_size=32, outlier_fraction=frac, residual_window=32,
                         meta_dtype=meta)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
  fn = lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, staged_outliers=staged,
                                              in_place_codes=inplace)
  text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("bits,frac,meta,inplace,heads", [
    (2, 0.02, "float8_e4m3fn", True, 8), (3, 0.03, "float8_e4m3fn", True, 4),
    (4, 0.0, "bfloat16", False, 16), (8, 0.02, "float16", True, 8),
    (2, 0.03, "float8_e4m3fn", False, 12)])
def test_lowers_for_cuda_explicit_and_merged_barriers(bits, frac, meta, inplace, heads):
  """explicit_barriers + merged_barriers on every bit width, metadata dtype, with and
  without outliers, in-place codes and 4-16 query heads per kv-head:
  the kernel's own commits are then its only barriers (two per tile)."""
  cfg = kq.KVQuantConfig(bits=bits, group_size=32, outlier_fraction=frac, residual_window=32,
                         meta_dtype=meta)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((1, 2 * heads, 128), jnp.bfloat16)
  fn = lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, in_place_codes=inplace,
                                              explicit_barriers=True,
                                              merged_barriers=True)
  text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("bits,phase", [(2, 8), (2, 4), (2, 3), (3, 5), (3, 2), (4, 4), (4, 1), (8, 2)])
def test_read_plan_places_every_slot_inside_the_mantissa(bits, phase):
  """in_place_codes: after the plan's rotations (cumulative within a phase, reset when a
  phase reloads the words) each slot's codes sit at a position it reads them from, inside
  the mantissa and with a multiplier <= max(64, 2**bits); at 2 bits and one phase, three
  rotations serve eight slots (the rotate-per-slot form needs seven)."""
  cpw = 16 // bits
  plan = dm._read_plan(bits, cpw, phase)
  assert sorted(plan) == list(range(cpw))
  lo, hi = min(4, 10 - bits), 10 - bits
  for j0 in range(0, cpw, phase):
    rot = 0
    for j in range(j0, min(j0 + phase, cpw)):
      delta, pos = plan[j]
      rot = (rot + delta) % 32
      assert (bits * j - rot) % 32 == pos and lo <= pos <= hi
  if bits == 2 and phase == 8:
    assert sum(1 for d, _ in plan.values() if d) == 3


@pytest.mark.parametrize("bits,phase", [(2, 8), (2, 4), (3, 5), (4, 4), (8, 2)])
def test_in_place_dequantization_in_numpy(bits, phase):
  """The in-place arithmetic bit for bit: codes packed as kv_quant packs them (slot j at
  bits [bits * j, bits * (j + 1)) of each 16-bit half), the plan's rotations of the 32-bit
  register, the lop3 mask at the slot's position with 1.0 ORed in, then one fp16 fma with
  s2 = s * 2**(10 - pos) and z2 = z - s2 rounded to fp16: within the rounding of z2 (at most
  (s * 2**(10 - pos) + |z|) * 2**-11, i.e. 1/32 of a quantization step at 2**(10 - pos) = 64)
  and of the result of s * code + z."""
  import numpy as np
  rng = np.random.default_rng(bits)
  cpw, n = 16 // bits, 4096
  codes = rng.integers(0, 1 << bits, size=(cpw, 2, n)).astype(np.uint32)   # slot, half, pair
  halves = sum(codes[j] << (bits * j) for j in range(cpw))                  # [2, n] 16-bit words
  word = halves[0] | (halves[1] << 16)
  s = rng.uniform(0.01, 8.0, size=n).astype(np.float16)
  z = rng.uniform(-40.0, 40.0, size=n).astype(np.float16)
  plan = dm._read_plan(bits, cpw, phase)
  for j0 in range(0, cpw, phase):
    w = word.copy()
    for j in range(j0, min(j0 + phase, cpw)):
      delta, pos = plan[j]
      w = ((w >> delta) | (w << (32 - delta))) & 0xFFFFFFFF if delta else w
      mask = ((1 << bits) - 1) << pos
      t = (w & (mask | (mask << 16))) | 0x3C003C00
      m = np.float16(2.0 ** (10 - pos))
      s2 = (s * m).astype(np.float16)                                      # exact: a power of two
      z2 = (z.astype(np.float64) - s2).astype(np.float16)
      for half in (0, 1):
        v = ((t >> (16 * half)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        x = (v * s2 + z2.astype(np.float64)).astype(np.float16).astype(np.float64)   # one fma
        want = s.astype(np.float64) * codes[j, half] + z
        tol = (float(m) * s.astype(np.float64) + np.abs(z) + np.abs(want)) * 2.0 ** -11 + 1e-6
        assert np.all(np.abs(x - want) <= tol), (j, half, np.max(np.abs(x - want) / tol))


@pytest.mark.parametrize("backend,hopper,interpret,frac,batch,tokens,want", [
    ("auto", False, True, 0.02, 1, 32768, "triton"),       # CPU: interpret mode is Triton's
    ("auto", True, False, 0.02, 1, 65536, "mosaic"),       # Hopper, supported
    ("auto", True, False, 0.02, 8, 4096, "mosaic"),        # small caches too (faster since session 9)
    ("auto", True, False, 0.02, 1, 256, "mosaic"),
    ("auto", True, False, 0.15, 1, 65536, "triton"),       # layout the Mosaic kernel does not take
    ("auto", False, False, 0.02, 1, 65536, "triton"),      # other GPUs
    ("triton", True, False, 0.02, 1, 32768, "triton"),
    ("mosaic", True, False, 0.02, 1, 256, "mosaic"),
])
def test_choose_backend(monkeypatch, backend, hopper, interpret, frac, batch, tokens, want):
  monkeypatch.setattr(dm, "is_hopper", lambda: hopper)
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=frac)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, batch, 2, 128, tokens))
  assert choose_backend(backend, kv, 4, interpret) == want


def test_mosaic_has_no_interpret_mode():
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
  kv = kq.empty_kv(cfg, 1, 2, 128, 256)
  with pytest.raises(ValueError, match="no interpret mode"):
    decode_attention(jnp.zeros((1, 8, 128), jnp.bfloat16), kv, backend="mosaic", interpret=True)


def test_is_hopper_is_false_on_cpu():
  assert jax.default_backend() != "cpu" or not dm.is_hopper()


@pytest.mark.parametrize("kw,match", [
    ({"stages": 2}, "split_fetch=False"),      # two tiles in flight need the whole-tile pipeline
    ({"warp_mma": True, "split_fetch": False}, "warp_mma needs"),   # tiles fetched by hand only
    ({"warp_mma": True, "staged_outliers": False}, "warp_mma needs"),   # outliers in its columns
])
def test_bad_options_are_clear_errors(kw, match):
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=0.1, **kw)).trace(q, kv)


def _mosaic_module_text(**kw):
  """The Mosaic GPU module of the kernel (B=2, 2 kv heads, 4k, 2-bit), as text."""
  from experiments.mosaic_module import mosaic_module_text
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02, residual_window=32)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
  return mosaic_module_text(lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, **kw),
                            q, kv)


def test_loop_descriptors_only_pass_descriptors_through_a_mov():
  """loop_descriptors: every wgmma's B descriptor goes through one side-effecting mov (so
  LLVM cannot hoist it out of the tile loop); nothing else in the module changes, and a
  kernel lowered afterwards without the option gets no movs (the wrapper is armed only for
  the MLIR context of the kernel that asked)."""
  mov = "mov.b64 $0, $1;"
  strip = lambda text: re.sub(r"%[\w]+", "", "\n".join(l for l in text.splitlines() if mov not in l))
  plain = _mosaic_module_text(loop_descriptors=False, warp_mma=False)
  moved = _mosaic_module_text(warp_mma=False)          # loop_descriptors' default (wgmma path)
  assert dm.LOOP_DESCRIPTORS and mov not in plain
  # per 8-slot tile: keys 8 slots x 2 K groups of 64 channels, values 8 slots x 2 row groups
  assert moved.count(mov) == 32
  assert strip(moved) == strip(plain)
  assert hasattr(dm.mgpu_wgmma.wgmma_m64, "moejax_original")      # installed, now a pass-through
  assert _mosaic_module_text(loop_descriptors=False, warp_mma=False) == plain


def test_loop_descriptors_stay_armed_for_their_kernel_context_only():
  """jax 0.11 expands wgmma in a dialect pass after the kernel body has lowered, so the movs
  must stay armed for that kernel's MLIR context past the body (on the GPU machine an
  arm-then-restore-at-body-end wrapper emitted no movs at all); another kernel's context
  is never armed, and a kernel without the option disarms."""
  from jaxlib.mlir import ir
  first, other = ir.Context(), ir.Context()
  with first:
    dm._descriptors_in_loop(True)
    assert dm._descriptors_armed()
  with other:
    assert not dm._descriptors_armed()
  with first:                         # later, e.g. in the dialect lowering pass
    assert dm._descriptors_armed()
  with other:
    dm._descriptors_in_loop(False)
  with first:
    assert not dm._descriptors_armed()


_COPY, _MMAS, _BARRIER = {"cp.async.bulk.tensor": "T"}, {"wgmma.mma_async": "W", "mma.sync.aligned": "W"}, \
    {"bar.sync": "B"}


def _op_runs(text, *markers):
  """The module's lines holding any of ``markers`` ({substring: letter} dicts) as letters in
  program order, runs counted: 'T9 W64 T4'."""
  kinds = {m: k for d in markers for m, k in d.items()}
  seq = [next(k for m, k in kinds.items() if m in l) for l in text.splitlines()
         if any(m in l for m in kinds)]
  return " ".join(f"{k}{len(list(g))}" for k, g in itertools.groupby(seq))


def _copies_and_mmas(text, barriers=False):
  """TMA copies (T), MMAs (W: wgmma or mma.sync) and, with ``barriers``, warpgroup
  barriers (B) in program order."""
  return _op_runs(text, _COPY, _MMAS, _BARRIER if barriers else {})


@pytest.mark.parametrize("warp_mma", [False, True])
def test_early_fetch_issues_each_half_before_its_mmas(warp_mma):
  """early_fetch: the next tile's key half (4 copies) is fetched before this tile's score
  MMAs and its value half before the output MMAs (the codes are in registers, metadata and
  outliers staged); without it, after them. Not where outliers are read raw (unstaged)."""
  # query, outlier query and the first tile's 8 copies; then per tile 8 slots x 8 K-steps
  # of score MMAs and 8 slots x 2 x 4 of output MMAs (wgmma), or 8 slots x 8 channel
  # blocks (mma.sync, one warp's 16 tokens each)
  kw = dict(warp_mma=warp_mma)
  assert _copies_and_mmas(_mosaic_module_text(early_fetch=False, **kw)) == "T9 W64 T4 W64 T4"
  assert _copies_and_mmas(_mosaic_module_text(early_fetch=True, **kw)) == "T13 W64 T4 W64"
  assert (_mosaic_module_text(early_fetch=True, staged_outliers=False, warp_mma=False)
          == _mosaic_module_text(early_fetch=False, staged_outliers=False, warp_mma=False))


def test_explicit_barriers_leave_only_the_kernels_own_commits():
  """explicit_barriers (warp_mma): Pallas inserts no barrier before each copy and around
  each shared-memory store; what is left are the kernel's commits: the prologue's, per tile
  the key metadata's and the key codes' (then the next key half is fetched), the value
  metadata's and the value codes' (then the value half), and the output's. With wgmma the
  option does nothing."""
  plain = _mosaic_module_text()
  explicit = _mosaic_module_text(explicit_barriers=True)
  assert _copies_and_mmas(explicit, barriers=True) == "T9 B3 T4 W64 B2 T4 W64 B7"
  assert plain.count("bar.sync") > 3 * explicit.count("bar.sync")
  assert _copies_and_mmas(explicit) == _copies_and_mmas(plain)
  assert (_mosaic_module_text(explicit_barriers=True, warp_mma=False)
          == _mosaic_module_text(warp_mma=False))


def test_merged_barriers_halve_the_barriers_of_a_tile():
  """merged_barriers (warp_mma, early fetches): per tile, one warpgroup barrier before the
  next key half is fetched and one before the next value half, instead of two each (the
  metadata's own commit and the fetch's); the MMAs and copies keep their order. Options
  it cannot apply to (wgmma, late fetches) leave the module unchanged."""
  plain, merged = _mosaic_module_text(), _mosaic_module_text(merged_barriers=True)
  assert merged.count("bar.sync") == plain.count("bar.sync") - 2
  assert (_copies_and_mmas(_mosaic_module_text(merged_barriers=True, explicit_barriers=True), barriers=True)
          == "T9 B2 T4 W64 B1 T4 W64 B7")
  assert _copies_and_mmas(merged) == _copies_and_mmas(plain) == "T13 W64 T4 W64"
  for kw in ({"warp_mma": False}, {"early_fetch": False}):
    assert _mosaic_module_text(merged_barriers=True, **kw) == _mosaic_module_text(**kw), kw


def test_warp_mma_is_the_default_where_the_options_allow_it():
  """Default (warp_mma=None): mma.sync per warp; options warp_mma cannot run with
  (unstaged outliers, the whole-tile pipeline) fall back to wgmma instead of failing;
  warp_mma=True with them is an error (test_bad_options_...)."""
  assert dm.WARP_MMA
  default = _mosaic_module_text()
  assert "mma.sync.aligned" in default and "wgmma.mma_async" not in default
  assert default == _mosaic_module_text(warp_mma=True)
  for kw in ({"staged_outliers": False}, {"split_fetch": False}):
    text = _mosaic_module_text(**kw)
    assert "wgmma.mma_async" in text and "mma.sync.aligned" not in text, kw


def test_tile_zero_is_in_flight_while_the_query_arrives():
  """split_fetch: the first tile's 8 copies are issued right after the query's, before the
  program waits for the query (the ablation late_tile0, timing only: after it)."""
  copies_and_waits = lambda text: _op_runs(text, _COPY, {"mbarrier.try_wait": "w"})
  assert copies_and_waits(_mosaic_module_text()).startswith("T9 w2 ")
  assert copies_and_waits(_mosaic_module_text(ablate=frozenset({"late_tile0"}))).startswith("T1 w1 T8 w1 ")


def test_default_call_is_two_kernels_and_nothing_else():
  """The default call (outliers in the MMA) is the Mosaic kernel and the Triton merge: the
  query operand (scale, channel order, padding) and the quantized token count are built
  in the kernel, so no XLA op around them launches a GPU kernel (each cost 1-2 us plus
  a gap on an H200: ~4 us of a 0.118 ms call at B=8, 32k)."""
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02, residual_window=32)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
  text = jax.jit(lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5)).trace(
      q, kv).lower(lowering_platforms=("cuda",)).as_text()
  ops = collections.Counter(re.findall(r"= (stablehlo\.[a-z_]+)", text))
  assert ops.pop("stablehlo.custom_call") == 2
  assert set(ops) <= {"stablehlo.reshape", "stablehlo.constant"}, ops


def test_raw_query_of_the_wrong_shape_is_a_clear_error():
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 128, 4096))
  qg = jax.ShapeDtypeStruct((1, 2, 4, 128), jnp.float32)
  bad = jax.ShapeDtypeStruct((1, 2, 2, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="raw_query must have qg's shape"):
    jax.jit(lambda qg, q, kv: dm.quantized_partials(qg, kv, heads_minor=True, raw_query=q,
                                                    raw_scale=0.1)).trace(qg, bad, kv)
  with pytest.raises(ValueError, match="raw_scale"):
    jax.jit(lambda qg, kv: dm.quantized_partials(qg, kv, heads_minor=True, raw_query=qg)).trace(qg, kv)


@pytest.mark.parametrize("heads,mmas", [(8, 128), (32, 256)])
def test_warp_mma_multiplies_per_warp_without_wgmma(heads, mmas):
  """warp_mma: a tile's scores and outputs are mma.sync (8 slots x 8 K-steps, 8 slots x 8
  channel blocks, per 8 padded query heads) and no wgmma; the value words are transposed
  in registers once per tile (32 blocks) and each slot's p once per 8 tokens (2 per 8 heads)."""
  from experiments.mosaic_module import mosaic_module_text
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02, residual_window=32)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, heads, 128), jnp.bfloat16)
  text = mosaic_module_text(
      lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, warp_mma=True), q, kv)
  assert text.count("mma.sync.aligned.m16n8k16") == mmas
  assert "wgmma.mma_async" not in text
  assert text.count("movmatrix.sync.aligned.m8n8.trans.b16") == 32 + 8 * 2 * (mmas // 128)
