"""Timing on the device: medians of back-to-back calls, and the copy ceiling measured in
the same process (the reference every achieved TB/s is stated against)."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, args, *, reps: int = 10, min_rep_s: float = 0.02) -> float:
  """Median seconds per call after warm-up: each rep runs enough calls back to back to
  last ~min_rep_s, then syncs once (the device never waits for the host in between)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t0, 1e-6)
  iters = max(1, min(200, int(min_rep_s / one)))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def copy_bandwidth(nbytes: int, *, reps: int = 10) -> float:
  """Device copy rate in bytes/s (read + write) of an f32 `x + 1` over `nbytes`, as a loop
  of 20 barrier-separated copies inside one jit (no dispatch gaps between them)."""
  loops = 20
  x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)

  @jax.jit
  def looped(x):
    return jax.lax.fori_loop(0, loops, lambda i, y: jax.lax.optimization_barrier(y + 1), x)

  return 2 * x.nbytes / (median_seconds(looped, (x,), reps=reps) / loops)


def step_seconds(t_few: float, t_many: float, few: int, many: int) -> tuple[float, bool]:
  """Seconds per decode step from the loop timed at two step counts, and whether the slope
  was resolved. Where timing noise exceeds the (many - few) steps' cost, the slope comes out
  <= 0; the whole call per step, t_many / many, is then reported instead: an upper bound, as
  it still holds the loop's fixed costs."""
  slope = (t_many - t_few) / (many - few)
  if slope > 0:
    return slope, True
  return t_many / many, False
