"""experiments/sass_histogram.py: finding the tile loop in an nvdisasm listing and counting it."""
from experiments.sass_histogram import histogram, loops

LISTING = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_5:
        /*0030*/                   LOP3.LUT R3, R3, 0x3000300, R0, 0xea, !PT ;
        /*0040*/                   HFMA2 R4, R3, R5, R6 ;
        /*0050*/                   SHF.R.W.U32 R3, R7, 0x1a, R7 ;
        /*0060*/                   LOP3.LUT R3, R3, 0x3000300, R0, 0xea, !PT ;
        /*0070*/                   HGMMA.64x8x16.F32 R112, R96, gdesc[UR32], RZ, !UPT ;
        /*0080*/               @P0 BRA `(.L_x_5) ;
        /*0090*/                   EXIT ;
.L_x_9:
        /*00a0*/                   NANOSLEEP 0x20 ;
        /*00b0*/                   BRA `(.L_x_0) ;
"""


def test_finds_the_tile_loop_and_not_the_wait_stub_after_exit():
  lines = LISTING.splitlines()
  found = loops(lines)
  assert len(found) == 1                    # the retry stub's jump back lies after EXIT
  lo, hi = found[0]
  assert lines[lo] == ".L_x_5:" and "@P0 BRA" in lines[hi]
  c = histogram(lines[lo:hi + 1])
  assert c == {"LOP3": 2, "HFMA2": 1, "SHF": 1, "HGMMA": 1, "BRA": 1}


def test_stall_cycles_reads_bits_41_to_44_of_each_high_word():
  from experiments.sass_histogram import stall_cycles
  high = lambda stall: f"{(stall << 41) | 0x7e0000:#018x}"
  listing = [
      f"        /*0030*/                   LOP3.LUT R3, R3, 0x3000300, R0, 0xea, !PT ;   /* 0x0300030003037812 */",
      f"                                                                               /* {high(2)} */",
      ".L_x_1:",
      f"        /*0040*/                   HFMA2 R4, R3, R5, R6 ;                        /* 0x0000000503047231 */",
      f"                                                                               /* {high(5)} */",
  ]
  assert stall_cycles(listing) == 7
  from experiments.sass_histogram import stalls_by_opcode
  assert stalls_by_opcode(listing + listing[:2]) == {"LOP3": 4, "HFMA2": 5}
