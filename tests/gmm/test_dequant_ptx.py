"""The inline PTX that turns int8 / int4 codes into bf16 in the compiled gmm kernel
(pallas_kernels/gmm/triton.py), checked on the CPU: a small emulator of the few PTX
instructions it uses runs each block on words covering every byte value, and the compiled
form is lowered for CUDA. tests/gmm/test_gmm_gpu.py runs the real thing on a GPU."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _implementation
from pallas_kernels.gmm import triton


def _bf16_pair(reg):
  return np.array([reg & 0xFFFF, reg >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(
      np.float64)


def _to_bf16_pair(values):
  u = np.asarray(values, np.float64).astype(ml_dtypes.bfloat16).view(np.uint16)
  return int(u[0]) | int(u[1]) << 16


def emulate(asm: str, word: int) -> list[float]:
  """Runs a block whose input is $2 and whose outputs are the bf16 pairs $0, $1."""
  reg = {"$2": word}
  val = lambda x: reg[x] if x in reg else int(x, 0)
  for line in asm.strip("{}\n").split(";"):
    line = line.strip()
    if not line or line.startswith(".reg"):
      continue
    op, rest = line.split(None, 1)
    dst, *srcs = [a.strip() for a in rest.split(",")]
    v = [val(a) for a in srcs]
    if op == "mov.b32":
      r = v[0]
    elif op == "xor.b32":
      r = v[0] ^ v[1]
    elif op == "shr.b32":
      r = v[0] >> v[1]
    elif op == "prmt.b32":  # selector nibble i picks byte i of d from the 8 bytes of (a, b)
      src = [(v[0] >> 8 * i) & 0xFF for i in range(4)] + [(v[1] >> 8 * i) & 0xFF for i in range(4)]
      r = sum(src[(v[2] >> 4 * i) & 7] << 8 * i for i in range(4))
    elif op == "lop3.b32":
      assert v[3] == 0xEA, "only (a & b) | c is emulated"
      r = (v[0] & v[1]) | v[2]
    elif op == "fma.rn.bf16x2":  # exact a*b+c, one rounding (the values here are exact)
      r = _to_bf16_pair(_bf16_pair(v[0]) * _bf16_pair(v[1]) + _bf16_pair(v[2]))
    else:
      raise AssertionError(f"instruction {op} not emulated")
    reg[dst] = r & 0xFFFFFFFF
  return list(_bf16_pair(reg["$0"])) + list(_bf16_pair(reg["$1"]))


WORDS = [b | ((b * 7 + 3) & 255) << 8 | ((b * 13 + 5) & 255) << 16 | (255 - b) << 24
         for b in range(256)]


def _bytes(word):
  return [(word >> 8 * i) & 0xFF for i in range(4)]


def test_int8_block_gives_the_signed_codes_exactly():
  for word in WORDS:
    assert emulate(triton._INT8_ASM, word) == [b - 256 if b >= 128 else b for b in _bytes(word)]


def test_int4_blocks_give_both_nibbles_minus_8_exactly():
  for word in WORDS:
    assert emulate(triton._INT4_LO_ASM, word) == [(b & 0xF) - 8 for b in _bytes(word)]
    assert emulate(triton._INT4_HI_ASM, word) == [(b >> 4) - 8 for b in _bytes(word)]


@pytest.mark.parametrize("bits", (8, 4))
def test_compiled_kernel_lowers_for_cuda(monkeypatch, bits):
  monkeypatch.setattr(_implementation, "platform", lambda: "gpu")
  w = jax.random.normal(jax.random.key(0), (8, 256, 128))
  q = pk.quantize_expert_weights(w, bits=bits, group_size=64)
  f = jax.jit(lambda x, q, gs: pk.gmm(x, q, gs, implementation="triton", interpret=False))
  lowered = f.trace(jnp.ones((4, 256), jnp.bfloat16), q, jnp.array([1, 0, 2, 0, 0, 1, 0, 0]),
                    ).lower(lowering_platforms=("cuda",))
  assert "triton_kernel_call" in lowered.as_text() or "__gpu$xla.gpu.triton" in lowered.as_text()
