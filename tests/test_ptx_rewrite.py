"""experiments/ptx_rewrite.py: the PTX rewrites that predict a variant's SASS offline."""
from experiments.ptx_rewrite import descriptor_defs, fold_fmas, rebuild_descriptors, wide_meta_loads

HI = 4611686293305294848          # 1 << 62 | 64 << 32, as in Mosaic's B descriptors
PTX = f"""\
\tbfe.u64 \t%rd64, %rd34, 4, 14;
\tor.b64 \t%rd99, %rd64, {HI};
\tadd.s64 \t%rd100, %rd64, {HI + 2};
\tadd.s64 \t%rd103, %rd64, {HI + 64};
\tadd.s64 \t%rd104, %rd64, {HI + 66};
\tadd.s64 \t%rd7, %rd64, 3072;
$L__loop:
\t{{ .reg .b32 t; lop3.b32 t, %r1, 0x00300030, 0x3c003c00, 0xea; fma.rn.f16x2 %r2, t, %r3, %r4; }}
\tfma.rn.f16x2 \t%r5, %r6, %r7, %r8;
\t{{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {{%r9,%r10,%r11,%r12}}, {{%r2,%r5,%r2,%r5}}, %rd100, p, 1, 1, 0; }}
\t{{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {{%r9,%r10,%r11,%r12}}, {{%r2,%r5,%r2,%r5}}, %rd104, p, 1, 1, 0; }}
"""


def test_descriptor_definitions_are_found():
  assert descriptor_defs(PTX) == {"%rd99": ("%rd64", HI), "%rd100": ("%rd64", HI + 2),
                                  "%rd103": ("%rd64", HI + 64), "%rd104": ("%rd64", HI + 66)}


def test_descriptors_rebuilt_from_their_64_column_group():
  out, n = rebuild_descriptors(PTX)
  assert n == 2
  assert "mov.b64 dsc, %rd99; add.s64 dsc, dsc, 2;" in out          # group 0: from %rd99
  assert "mov.b64 dsc, %rd103; add.s64 dsc, dsc, 2;" in out         # group 1: from %rd103
  assert ", dsc, p, 1, 1, 0; }" in out and "%rd100, p," not in out


def test_fold_turns_the_first_fmas_into_moves():
  out, n = fold_fmas(PTX, 1)
  assert n == 1 and "mov.b32 %r2, t;" in out and "fma.rn.f16x2 \t%r5" in out
  out, n = fold_fmas(PTX, 512)
  assert n == 2 and "fma.rn" not in out and "mov.b32 %r5, %r6;" in out


def test_wide_meta_merges_the_loads_of_two_register_tiles():
  ptx = """\
\tld.shared.b32 \t%r3, [%rd15+11264];
\tld.shared.b32 \t%r4, [%rd15+15360];
\tld.shared.b32 \t%r13, [%rd15+11280];
\tld.shared.b32 \t%r14, [%rd15+15376];
\t{ .reg .b32 t; lop3.b32 t, %r1, 0x00300030, 0x3c003c00, 0xea; fma.rn.f16x2 %r2, t, %r3, %r4; }
\t{ .reg .b32 t; lop3.b32 t, %r9, 0x00300030, 0x3c003c00, 0xea; fma.rn.f16x2 %r10, t, %r3, %r4; }
\t{ .reg .b32 t; lop3.b32 t, %r11, 0x00300030, 0x3c003c00, 0xea; fma.rn.f16x2 %r12, t, %r13, %r14; }
"""
  out, n = wide_meta_loads(ptx)
  assert n == 1
  assert out.splitlines()[0] == "\tld.shared.v4.b32 \t{%r3, %r13, %r4, %r14}, [%rd15+11264];"
  assert out.count("ld.shared") == 1
