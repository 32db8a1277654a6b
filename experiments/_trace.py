"""GPU kernel times from a jax.profiler trace, shared by the profile_* scripts."""
from __future__ import annotations

import os
import re

from jax.profiler import ProfileData


def gpu_kernels(xplane_path: str):
  """(name, hlo_op, long_name, start_ns, duration_ns) of every kernel on GPU 0's streams."""
  data = ProfileData.from_file(xplane_path)
  out = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for ev in line.events:
        stats = dict(ev.stats)
        out.append((ev.name, stats.get("hlo_op", ""), str(stats.get("long_name", ""))[:160],
                    ev.start_ns, ev.duration_ns))
  return out


def fusion_sources(hlo_text: str) -> dict[str, str]:
  """Kernel (instruction) name -> its jax op path and source line, from the optimized HLO's
  metadata: what a fusion called `loop_multiply_fusion` computes."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*?(?:fusion|custom-call)\(", line)
    if not m:
      continue
    op = re.search(r'op_name="([^"]*)"', line)
    src = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
    where = f"{os.path.basename(src.group(1))}:{src.group(2)}" if src else ""
    out[m.group(1)] = f"{op.group(1).split('/')[-1] if op else ''} {where}".strip()
  return out
