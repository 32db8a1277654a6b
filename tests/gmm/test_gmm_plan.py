"""pallas_kernels.gmm.plan: the work-tile table and the implementations' Config classes."""
from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.gmm.plan import (
    TpuConfig, TritonConfig, default_tiling, make_tile_metadata, num_work_tiles)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    extra=st.integers(0, 20), bm=st.sampled_from([8, 16, 64]), visit_empty=st.booleans())
def test_work_tiles_cover_every_row_once(sizes, extra, bm, visit_empty):
  m = sum(sizes) + extra
  hypothesis.assume(m > 0)
  e = len(sizes)
  meta = jax.tree.map(np.asarray, make_tile_metadata(
      jnp.asarray(sizes, jnp.int32), m, bm, visit_empty))
  assert meta.group_W.shape[0] == num_work_tiles(m, bm, e, visit_empty)
  assert np.all((meta.mtile_W >= 0) & (meta.mtile_W * bm < m))
  if visit_empty:  # every real group has a work tile, in group order
    assert set(range(e)) <= set(meta.group_W.tolist())
    assert np.all(np.diff(meta.group_W) >= 0)
  owner = np.full(m, -1)
  ends = np.cumsum(sizes)
  for g, mt, lo, hi in zip(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W):
    if lo >= hi:
      continue
    assert mt * bm <= lo and hi <= (mt + 1) * bm  # rows inside the row tile
    assert np.all(owner[lo:hi] == -1)  # no row twice
    owner[lo:hi] = g
  want = np.searchsorted(ends, np.arange(m), side="right")  # E for the tail
  assert np.array_equal(owner, want)
  used = {g for g, lo, hi in zip(meta.group_W, meta.lo_W, meta.hi_W) if lo < hi}
  assert all(sizes[g] > 0 for g in used if g < e)  # empty groups own no tiles


def test_old_names_are_the_triton_config():
  assert pk.GmmTiling is TritonConfig
  assert pk.default_tiling is default_tiling


@pytest.mark.parametrize("m,i,o,e,op", [
    (3, 4096, 14336, 8, "gmm"), (32, 4096, 14336, 8, "gmm"), (1000, 512, 512, 8, "gmm"),
    (16384, 4096, 14336, 8, "gmm"), (32768, 2048, 1024, 64, "tgmm")])
def test_default_tiling_sets_every_field(m, i, o, e, op):
  t = default_tiling(m, i, o, e, op=op)
  assert all(getattr(t, f.name) is not None for f in dataclasses.fields(t))
  assert TritonConfig().resolve(m, i, o, e, op=op) == t
  assert t.resolve(1, 1, 1, 1) is t  # a full config is used as it is


def test_resolve_keeps_the_fields_that_are_set():
  base = default_tiling(3, 4096, 14336, 8)
  t = TritonConfig(split_k=2, expert_major=False).resolve(3, 4096, 14336, 8)
  assert t == dataclasses.replace(base, split_k=2, expert_major=False)


def test_configs_are_frozen_hashable_dataclasses():
  t = TritonConfig(bm=16, bk=16, bn=16)
  assert dataclasses.replace(t, split_k=2).split_k == 2
  assert hash(t) == hash(TritonConfig(16, 16, 16))
  with pytest.raises(dataclasses.FrozenInstanceError):
    t.bm = 32  # type: ignore[misc]
  assert hash(TpuConfig()) == hash(TpuConfig(128, 128, 128))


@pytest.mark.parametrize("make,match", [
    (lambda: TritonConfig(bm=24), "bm must be a positive power of two"),
    (lambda: TritonConfig(split_k=0), "split_k"),
    (lambda: TritonConfig(num_warps=0), "num_warps"),
    (lambda: TritonConfig(expert_major=1), "expert_major"),
    (lambda: TpuConfig(bm=12), "bm must be a positive multiple of 8"),
    (lambda: TpuConfig(bk=64), "bk must be a positive multiple of 128"),
])
def test_bad_config_raises(make, match):
  with pytest.raises(ValueError, match=match):
    make()
