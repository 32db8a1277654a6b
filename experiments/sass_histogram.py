"""Instruction histogram of a Mosaic GPU kernel's main loop, from its PTX, on any machine.

The device machine dumps PTX (``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR``; SASS dumps
need ``nvdisasm``, which it lacks). This script assembles the PTX with ``ptxas`` and
disassembles it with ``nvdisasm`` (both from pip wheels, which run on a CPU machine:
``pip download --no-deps nvidia-cuda-nvcc nvidia-cuda-nvdisasm``, then unzip; CUDA 13
tools, as the PTX is ISA 9.0), prints the register report, and counts opcodes in the
loop between the label a backward branch returns to and that branch (the longest such
loop by default: the tile loop of the decode kernel), and the loop's static schedule: the
sum of the stall counts ptxas wrote into the control words (bits 41-44 of each
instruction's second 64-bit word), the fewest cycles one warp needs per iteration before
any wait on memory, MMAs or barriers.

Usage: python experiments/sass_histogram.py KERNEL.ptx --ptxas PATH --nvdisasm PATH
"""
import argparse
import collections
import re
import subprocess
import tempfile


def loops(sass_lines):
  """(label line, branch line) of every backward branch ``BRA `(.L_x_N)`` before the last
  EXIT (after it, ptxas places the retry stubs of barrier waits, which jump back far)."""
  labels = {l.strip().rstrip(":"): i for i, l in enumerate(sass_lines) if re.match(r"^\.L_x_\d+:", l)}
  end = max((i for i, l in enumerate(sass_lines) if re.search(r"\bEXIT\b", l)), default=len(sass_lines))
  found = []
  for i, l in enumerate(sass_lines[:end]):
    m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
    if m and labels.get(m.group(1), i + 1) < i:
      found.append((labels[m.group(1)], i))
  return found


def stall_cycles(hex_lines):
  """Sum of the stall counts of the instructions in an ``nvdisasm -hex`` listing slice: each
  instruction line ends in ``/* 0x<low word> */`` and the next line holds ``/* 0x<high
  word> */``, whose bits 41-44 are the stall count."""
  total, expect_high = 0, False
  for l in hex_lines:
    m = re.search(r"/\* (0x[0-9a-f]{16}) \*/\s*$", l)
    if not m:
      continue
    if expect_high:
      total += (int(m.group(1), 16) >> 41) & 0xF
    expect_high = re.match(r"\s*/\*[0-9a-f]{4,}\*/", l) is not None    # an instruction's line
  return total


def stalls_by_opcode(hex_lines):
  """Stall cycles (as ``stall_cycles``) summed per opcode: which instructions the static
  schedule waits on."""
  c, op = collections.Counter(), None
  for l in hex_lines:
    m = re.search(r"/\* (0x[0-9a-f]{16}) \*/\s*$", l)
    if not m:
      continue
    if op is not None:
      c[op] += (int(m.group(1), 16) >> 41) & 0xF
      op = None
      continue
    mo = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", l)
    op = mo.group(1) if mo else None
  return c


def histogram(lines):
  c = collections.Counter()
  for l in lines:
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", l)
    if m:
      c[m.group(1)] += 1
  return c


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("ptx")
  ap.add_argument("--ptxas", default="ptxas")
  ap.add_argument("--nvdisasm", default="nvdisasm")
  ap.add_argument("--arch", default="sm_90a")
  ap.add_argument("--loop", type=int, default=None,
                  help="which backward-branch loop, in listing order (default: the longest)")
  a = ap.parse_args()
  with tempfile.TemporaryDirectory() as d:
    cubin = f"{d}/k.cubin"
    rep = subprocess.run([a.ptxas, f"-arch={a.arch}", "-v", a.ptx, "-o", cubin],
                         capture_output=True, text=True, check=True)
    print(" ".join(l.strip() for l in rep.stderr.splitlines() if re.search(r"Used|spill", l)))
    sass = subprocess.run([a.nvdisasm, "-c", "-hex", cubin], capture_output=True, text=True,
                          check=True).stdout.splitlines()
  found = loops(sass)
  if not found:
    raise SystemExit("no backward branch in the listing")
  lo, hi = max(found, key=lambda x: x[1] - x[0]) if a.loop is None else found[a.loop]
  c = histogram(sass[lo:hi + 1])
  print(f"loop lines {lo}-{hi}: {sum(c.values())} instructions, "
        f"{stall_cycles(sass[lo:hi + 2])} stall cycles per warp (static schedule)")
  print("  " + ", ".join(f"{op} {n}" for op, n in c.most_common(40)))
  print("  stall cycles by opcode: " + ", ".join(
      f"{op} {n}" for op, n in stalls_by_opcode(sass[lo:hi + 2]).most_common(16)))


if __name__ == "__main__":
  main()
