"""Rewrite a dumped Mosaic GPU kernel's PTX to predict a variant's SASS before spending GPU time.

Feed the output to ``experiments/sass_histogram.py`` (ptxas + nvdisasm from pip wheels, on
any machine) and compare registers, spills, loop instructions and static stalls with the
unmodified PTX. Rewrites (``--rewrite``, in order):

* ``descriptors``: each wgmma's B descriptor rebuilt next to its MMA (``mov.b64`` from the
  descriptor of its 64-column group, then ``add.s64`` of the instruction's offset), as
  ``loop_descriptors=True`` makes LLVM emit it; in the dump, all 40 descriptors of a tile
  are computed once before the loop and held in registers.
* ``wide-meta``: the two 32-bit metadata loads (s2, z2) of register tiles k and k + 1 (four
  loads) as one ``ld.shared.v4.b32``, as ``interleave_meta=True`` did (removed; the addresses are
  left as they were: right for ptxas's register allocation and schedule, not for values).
  Checked against the device: on the dumped default kernel it predicts 255 registers and
  128 B spilled, which is what ptxas reported on the GPU for ``interleave_meta``.
* ``fold-keys`` / ``fold-all``: the dequantization's ``fma.rn.f16x2`` of the first 256 (the
  keys of an 8-slot tile) / all 512 turned into moves. WRONG VALUES: an upper bound of what
  folding the scales out of the loop could save (ptxas then drops the metadata loads).

Usage: python experiments/ptx_rewrite.py KERNEL.ptx OUT.ptx --rewrite descriptors [wide-meta]
"""
import argparse
import re

DESC_HI = 1 << 62          # descriptor constants: these bits are set in every one
_WGMMA = re.compile(r"(\{ \.reg \.pred p; setp\.ne\.b32 p, 1, 0; wgmma\.mma_async[^%]*"
                    r"\{[^}]*\}, \{[^}]*\}, )(%rd\d+)(, p, 1, 1, 0; \})")
_DEQUANT = re.compile(r"lop3\.b32 t, %r\d+, 0x[0-9a-f]+, 0x3c003c00, 0xea; "
                      r"fma\.rn\.f16x2 %r\d+, t, (%r\d+), (%r\d+);")
_FMA = re.compile(r"fma\.rn\.f16x2\s+(%r\d+), (%r\d+|t), (%r\d+), (%r\d+);")


def descriptor_defs(ptx):
  """{descriptor register: (base register, constant)} for ``or/add.s64 %rdX, %rdB, C``
  with ``%rdB`` a ``bfe.u64 ..., 4, 14`` (the encoded shared-memory address)."""
  bases = set(re.findall(r"bfe\.u64 \t(%rd\d+), %rd\d+, 4, 14;", ptx))
  defs = {}
  for m in re.finditer(r"(?:or\.b64|add\.s64) \t(%rd\d+), (%rd\d+), (\d+);", ptx):
    x, b, c = m.group(1), m.group(2), int(m.group(3))
    if b in bases and c >= DESC_HI:
      defs[x] = (b, c)
  return defs


def rebuild_descriptors(ptx):
  """Every wgmma's descriptor as ``mov`` of its 64-column group's first descriptor plus its
  offset, inside the MMA's asm block. Returns (ptx, number of MMAs rewritten)."""
  defs = descriptor_defs(ptx)
  group = lambda b, c: (b, ((c - DESC_HI) & 0xFFFFFFFF) // 64)
  first = {}
  for x, (b, c) in defs.items():
    key = group(b, c)
    if key not in first or c < defs[first[key]][1]:
      first[key] = x

  def sub(m):
    x = m.group(2)
    if x not in defs:
      return m.group(0)
    g = first[group(*defs[x])]
    off = defs[x][1] - defs[g][1]
    head = m.group(1).replace("{ .reg .pred p;", "{ .reg .pred p; .reg .b64 dsc; "
                              f"mov.b64 dsc, {g}; add.s64 dsc, dsc, {off};")
    return head + "dsc" + m.group(3)
  return _WGMMA.subn(sub, ptx)


def wide_meta_loads(ptx):
  """The (s2, z2) loads of consecutive register tiles, in the order the dequantization first
  uses them, merged pairwise into one v4 load at the earliest of the four. Returns (ptx,
  number of v4 loads)."""
  lines = ptx.split("\n")
  first_use, tiles = {}, []
  for i, line in enumerate(lines):
    m = _DEQUANT.search(line)
    if m and m.groups() not in first_use:
      first_use[m.groups()] = i
      tiles.append(m.groups())
  loads = {}
  for i, line in enumerate(lines):
    m = re.match(r"\s*ld\.shared\.b32 \t(%r\d+), \[([^\]]+)\];", line)
    if m:
      loads[m.group(1)] = (i, m.group(2))
  drop, n = set(), 0
  for (s0, z0), (s1, z1) in zip(tiles[0::2], tiles[1::2]):
    regs = [s0, s1, z0, z1]
    if not all(r in loads for r in regs):
      continue
    at = min(loads[r][0] for r in regs)
    if at > min(first_use[s0, z0], first_use[s1, z1]):
      continue
    lines[at] = f"\tld.shared.v4.b32 \t{{{', '.join(regs)}}}, [{loads[s0][1]}];"
    drop |= {loads[r][0] for r in regs} - {at}
    n += 1
  return "\n".join(l for i, l in enumerate(lines) if i not in drop), n


def fold_fmas(ptx, count):
  """The first ``count`` ``fma.rn.f16x2 d, t, s, z`` become ``mov.b32 d, t``."""
  lines = ptx.split("\n")
  done = 0
  for i, line in enumerate(lines):
    if done == count:
      break
    new, n = _FMA.subn(lambda m: f"mov.b32 {m.group(1)}, {m.group(2)};", line)
    if n:
      lines[i], done = new, done + n
  return "\n".join(lines), done


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("ptx")
  ap.add_argument("out")
  ap.add_argument("--rewrite", nargs="+", required=True,
                  choices=("descriptors", "wide-meta", "fold-keys", "fold-all"))
  a = ap.parse_args()
  ptx = open(a.ptx).read()
  for r in a.rewrite:
    if r == "descriptors":
      ptx, n = rebuild_descriptors(ptx)
    elif r == "wide-meta":
      ptx, n = wide_meta_loads(ptx)
    else:
      ptx, n = fold_fmas(ptx, 256 if r == "fold-keys" else 512)
    print(f"{r}: {n} rewritten")
  open(a.out, "w").write(ptx)


if __name__ == "__main__":
  main()
