"""pallas_kernels.kv.packing: the Triton kernels (interpret mode) and the jnp versions vs the
loop-by-loop reference, the bit layout itself, implementation selection and errors."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels
from pallas_kernels import _implementation
from pallas_kernels.kv import packing, reference

BITS = (2, 3, 4, 8)


@st.composite
def packing_case(draw):
  bits = draw(st.sampled_from(BITS))
  stride = draw(st.sampled_from((1, 2, 16, 32)))
  word_bits = draw(st.sampled_from((16, 32)))
  ndim = draw(st.integers(1, 3))
  axis = draw(st.integers(0, ndim - 1))
  shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
  shape[axis] = packing.pack_block(bits, stride, word_bits) * draw(st.integers(1, 3))
  seed = draw(st.integers(0, 2**31 - 1))
  codes = np.random.default_rng(seed).integers(0, 1 << bits, size=shape).astype(np.uint8)
  return bits, stride, axis, codes, word_bits


def _round_trip(bits, stride, axis, codes, word_bits, implementation="triton"):
  kw = dict(axis=axis, stride=stride, word_bits=word_bits, implementation=implementation)
  words = packing.pack(codes, bits, interpret=True, **kw)
  ref = reference.pack(codes, bits, axis=axis, stride=stride, word_bits=word_bits)
  assert words.dtype == packing.word_dtype(word_bits) == ref.dtype
  np.testing.assert_array_equal(np.asarray(words), np.asarray(ref))
  back = packing.unpack(words, bits, interpret=True, **kw)
  np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("word_bits", (16, 32))
@pytest.mark.parametrize("bits", BITS)
def test_triton_pack_unpack_every_width(bits, word_bits):
  rng = np.random.default_rng(bits)
  n = packing.pack_block(bits, 16, word_bits) * 2
  _round_trip(bits, 16, 1, rng.integers(0, 1 << bits, size=(3, n, 5)).astype(np.uint8), word_bits)


@settings(max_examples=5, deadline=None)
@given(packing_case())
def test_triton_pack_unpack_round_trip(case):
  _round_trip(*case)


@settings(max_examples=8, deadline=None)
@given(packing_case())
def test_jnp_pack_unpack_matches_reference(case):
  bits, stride, axis, codes, wb = case
  words = packing.pack_jnp(codes, bits, axis=axis, stride=stride, word_bits=wb)
  np.testing.assert_array_equal(
      np.asarray(words), np.asarray(reference.pack(codes, bits, axis=axis, stride=stride, word_bits=wb)))
  np.testing.assert_array_equal(
      np.asarray(packing.unpack_jnp(words, bits, axis=axis, stride=stride, word_bits=wb)), codes)
  np.testing.assert_array_equal(
      np.asarray(reference.unpack(words, bits, axis=axis, stride=stride, word_bits=wb)), codes)


@pytest.mark.parametrize("bits", BITS)
def test_xla_implementation_matches_reference(bits):
  rng = np.random.default_rng(10 + bits)
  codes = rng.integers(0, 1 << bits, size=(2, packing.pack_block(bits, 64, 16) * 2, 3)).astype(np.uint8)
  _round_trip(bits, 64, 1, codes, 16, implementation="xla")


def test_layout_lowest_bits_first_and_3bit_spare_bits():
  # contiguous layout: code i of the axis in word i // cpw, bits [(i % cpw) * bits, ...)
  codes = np.arange(16, dtype=np.uint8) % 4
  w = int(np.asarray(packing.pack_jnp(codes, 2))[0])
  assert [(w >> (2 * j)) & 3 for j in range(16)] == list(codes)
  c3 = np.full((20,), 7, np.uint8)
  w3 = np.asarray(packing.pack(c3, 3, interpret=True))
  assert w3.shape == (2,) and all(int(x) == (1 << 30) - 1 for x in w3)   # bits 30, 31 unused
  # stride 16: slot j of word-row r holds element 16 * j + r of the pack block
  c = np.random.default_rng(0).integers(0, 4, size=(256,)).astype(np.uint8)
  w = np.asarray(packing.pack_jnp(c, 2, stride=16))
  for r in range(16):
    for j in range(16):
      assert (int(w[r]) >> (2 * j)) & 3 == c[16 * j + r]


def test_codes_per_word_and_bits_per_code():
  assert {b: packing.codes_per_word(b) for b in BITS} == {2: 16, 3: 10, 4: 8, 8: 4}
  assert {b: packing.codes_per_word(b, 16) for b in BITS} == {2: 8, 3: 5, 4: 4, 8: 2}
  assert pallas_kernels.codes_per_word is packing.codes_per_word


def test_16bit_words_layout():
  # 3-bit in uint16: 5 codes per word, bit 15 unused; stride 32
  w = np.asarray(packing.pack(np.full((10,), 7, np.uint8), 3, word_bits=16, interpret=True))
  assert w.dtype == np.uint16 and w.shape == (2,) and all(int(x) == (1 << 15) - 1 for x in w)
  c = np.random.default_rng(1).integers(0, 4, size=(256,)).astype(np.uint8)
  w = np.asarray(packing.pack_jnp(c, 2, stride=32, word_bits=16))
  assert w.shape == (32,)
  for r in range(32):
    for j in range(8):
      assert (int(w[r]) >> (2 * j)) & 3 == c[32 * j + r]


def test_empty_arrays_keep_their_shape():
  w = packing.pack(np.zeros((0, 32), np.uint8), 2, axis=1, interpret=True)
  assert w.shape == (0, 2) and w.dtype == jnp.uint32
  assert packing.unpack(w, 2, axis=1, interpret=True).shape == (0, 32)


def test_implementation_selection(monkeypatch):
  codes = np.random.default_rng(2).integers(0, 4, size=(4, 32)).astype(np.uint8)
  want = np.asarray(reference.pack(codes, 2, axis=1))
  # compiled Triton needs a GPU: Unsupported on this CPU; a list falls back to the next
  with pytest.raises(pallas_kernels.Unsupported, match="compiles for GPUs only"):
    packing.pack(codes, 2, axis=1, implementation="triton", interpret=False)
  got = packing.pack(codes, 2, axis=1, implementation=("triton", "xla"), interpret=False)
  np.testing.assert_array_equal(np.asarray(got), want)
  with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
    packing.pack(codes, 2, axis=1, implementation="cuda")
  # default: triton (interpreted on CPU), xla on a TPU
  assert packing._default_order() == ("triton",)
  monkeypatch.setattr(_implementation, "platform", lambda: "tpu")
  assert packing._default_order() == ("xla",)
  np.testing.assert_array_equal(np.asarray(packing.pack(codes, 2, axis=1)), want)


def test_errors():
  with pytest.raises(ValueError, match="bits must be one of"):
    packing.pack(np.zeros(16, np.uint8), 5)
  with pytest.raises(ValueError, match="bits must be one of"):
    packing.codes_per_word(1)
  with pytest.raises(ValueError, match="out of range"):
    packing.pack(np.full(16, 4, np.uint8), 2, interpret=True)
  with pytest.raises(ValueError, match="out of range"):
    packing.pack(np.full(8, -1, np.int32), 4, interpret=True)
  with pytest.raises(ValueError, match="multiple of 10.*Pad it to 20"):
    packing.pack(np.zeros(12, np.uint8), 3, interpret=True)
  with pytest.raises(ValueError, match="multiple of 256"):
    packing.pack_jnp(jnp.zeros((2, 128), jnp.uint8), 2, axis=1, stride=16)
  with pytest.raises(ValueError, match="uint32"):
    packing.unpack(np.zeros(4, np.int32), 2)
  with pytest.raises(ValueError, match="uint16 for word_bits=16"):
    packing.unpack_jnp(jnp.zeros(4, jnp.uint32), 2, word_bits=16)
  with pytest.raises(ValueError, match="word_bits must be one of"):
    packing.codes_per_word(2, 8)
  with pytest.raises(ValueError, match="stride"):
    packing.pack(np.zeros(16, np.uint8), 2, stride=0)
  with pytest.raises(ValueError, match="not a multiple of stride 4"):
    packing.unpack(np.zeros(6, np.uint32), 2, stride=4)
  assert packing.padded_length(12, 3) == 20
  assert packing.padded_length(300, 2, stride=16) == 512
