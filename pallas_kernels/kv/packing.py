"""Sub-byte packing of unsigned integer codes into uint32 (or uint16) words.

Layout (every function in this module, and the quantized KV cache, uses it):

* ``word_bits=32`` (default): bit widths 2, 4 and 8 put ``32 // bits`` codes
  (16, 8, 4) in one uint32 word; bit width 3 puts 10 codes in a word, bits 30
  and 31 unused (always zero).
* ``word_bits=16``: uint16 words holding 8, 5, 4, 2 codes (3-bit: bit 15
  unused). The KV cache uses these: two 16-bit words of neighbouring channels
  fill one 32-bit register, which the decode kernel turns into two fp16 values
  with three instructions.
* ``codes_per_word(bits, word_bits)`` gives the count.
* **Lowest bits first**: slot ``j`` of a word holds bits ``[j*bits, (j+1)*bits)``.
* The **packed axis** is chosen by the caller (``axis``). Along it, codes are
  grouped in *pack blocks* of ``P = stride * codes_per_word(bits)`` elements,
  which become ``stride`` consecutive words. Inside a pack block, element ``r``
  goes to word ``r % stride``, slot ``r // stride``::

      element i  ->  word (i // P) * stride + (i % P) % stride,
                     slot (i % P) // stride

  ``stride=1`` is the usual contiguous layout (codes ``4w .. 4w+3`` of an 8-bit
  array in word ``w``). The KV cache packs along the token axis with
  ``stride=64`` in uint16 words: each of the ``codes_per_word`` slots of a 64-word
  tile then holds 64 *consecutive* tokens, so a kernel that loads a ``[64, D]`` tile
  of words gets whole ``[64, D]`` tiles of codes with a rotate and a mask per slot
  (no reshapes, no gathers; a layout a TPU or a GPU tensor core reads as it is).
* The length of the packed axis must be a multiple of ``P``; there is no silent
  padding (``padded_length`` tells what to pad to).

``pack``/``unpack`` choose an ``implementation``: ``"triton"`` (a Pallas kernel:
compiled on GPU, interpreted on CPU; the default there) or ``"xla"`` (``pack_jnp`` /
``unpack_jnp``, plain ``jnp`` that XLA fuses into the quantizer; the default on TPU).
``pallas_kernels.kv.reference`` holds the ground truth the tests compare both against.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported, dispatch, resolve_interpret

SUPPORTED_BITS = (2, 3, 4, 8)
WORD_BITS = (16, 32)
_CODES_PER_WORD = {32: {2: 16, 3: 10, 4: 8, 8: 4}, 16: {2: 8, 3: 5, 4: 4, 8: 2}}
_WORD_DTYPE = {16: jnp.uint16, 32: jnp.uint32}


def check_bits(bits) -> int:
  """Returns ``bits`` as an int, or raises ValueError for unsupported widths."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
  return int(bits)


def check_word_bits(word_bits) -> int:
  if isinstance(word_bits, bool) or word_bits not in WORD_BITS:
    raise ValueError(f"word_bits must be one of {WORD_BITS}, got {word_bits!r}")
  return int(word_bits)


def word_dtype(word_bits: int = 32):
  """jnp.uint32 or jnp.uint16."""
  return _WORD_DTYPE[check_word_bits(word_bits)]


def codes_per_word(bits: int, word_bits: int = 32) -> int:
  """Codes held by one word: uint32 16/10/8/4, uint16 8/5/4/2 (2/3/4/8-bit)."""
  return _CODES_PER_WORD[check_word_bits(word_bits)][check_bits(bits)]


def pack_block(bits: int, stride: int = 1, word_bits: int = 32) -> int:
  """Elements of the packed axis that make one group of ``stride`` words."""
  _check_stride(stride)
  return stride * codes_per_word(bits, word_bits)


def padded_length(n: int, bits: int, stride: int = 1, word_bits: int = 32) -> int:
  """Smallest length >= n that the layout can hold (a multiple of ``pack_block``)."""
  p = pack_block(bits, stride, word_bits)
  return -(-int(n) // p) * p


def _check_stride(stride) -> int:
  if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
    raise ValueError(f"stride must be a positive int, got {stride!r}")
  return int(stride)


def _check_axis_len(n: int, bits: int, stride: int, what: str, word_bits: int = 32) -> None:
  p = pack_block(bits, stride, word_bits)
  if n % p:
    raise ValueError(
        f"{what} has length {n} along the packed axis; {bits}-bit codes with "
        f"stride {stride} need a multiple of {p} ({stride} words x "
        f"{codes_per_word(bits, word_bits)} codes). Pad it to "
        f"{padded_length(n, bits, stride, word_bits)} (see packing.padded_length).")


def _check_words(words, word_bits):
  if words.dtype != word_dtype(word_bits):
    raise ValueError(f"words must be {jnp.dtype(word_dtype(word_bits)).name} for "
                     f"word_bits={word_bits}, got {words.dtype}")


def check_codes_range(codes, bits: int) -> None:
  """Raises ValueError if concrete ``codes`` fall outside ``[0, 2**bits)``.

  Traced values (inside ``jit``) cannot be checked; ``pack`` then keeps only the
  low ``bits`` bits of each code.
  """
  if isinstance(codes, jax.core.Tracer):
    return
  a = np.asarray(codes)
  if a.size == 0:
    return
  if not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"codes must be integers, got dtype {a.dtype}")
  lo, hi = a.min(), a.max()
  if lo < 0 or hi >= (1 << bits):
    raise ValueError(
        f"codes out of range for {bits}-bit packing: min {lo}, max {hi}, "
        f"allowed [0, {(1 << bits) - 1}]")


# --- plain jnp (XLA) versions ----------------------------------------------------


def pack_jnp(codes: jax.Array, bits: int, axis: int = -1, stride: int = 1,
             word_bits: int = 32) -> jax.Array:
  """``codes[..., n, ...]`` (any int dtype) -> ``uint{word_bits}[..., n // cpw, ...]``."""
  bits = check_bits(bits)
  stride = _check_stride(stride)
  axis = axis % codes.ndim
  n = codes.shape[axis]
  _check_axis_len(n, bits, stride, "codes", word_bits)
  cpw = codes_per_word(bits, word_bits)
  x = jnp.moveaxis(codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1), axis, -1)
  x = x.reshape(*x.shape[:-1], n // (cpw * stride), cpw, stride)
  shifts = (jnp.arange(cpw, dtype=jnp.uint32) * bits)[:, None]
  words = _or_reduce(x << shifts, -2)
  words = words.reshape(*x.shape[:-3], n // cpw).astype(word_dtype(word_bits))
  return jnp.moveaxis(words, -1, axis)


def _or_reduce(x, axis):
  return jax.lax.reduce(x, jnp.uint32(0), jax.lax.bitwise_or, (axis % x.ndim,))


def unpack_jnp(words: jax.Array, bits: int, axis: int = -1, stride: int = 1,
               dtype=jnp.uint8, word_bits: int = 32) -> jax.Array:
  """Inverse of ``pack_jnp``: ``uint{word_bits}[..., nw, ...]`` -> ``dtype[..., nw * cpw, ...]``."""
  bits = check_bits(bits)
  stride = _check_stride(stride)
  _check_words(words, word_bits)
  axis = axis % words.ndim
  nw = words.shape[axis]
  if nw % stride:
    raise ValueError(f"words has length {nw} along the packed axis, not a multiple of stride {stride}")
  cpw = codes_per_word(bits, word_bits)
  x = jnp.moveaxis(words.astype(jnp.uint32), axis, -1)
  x = x.reshape(*x.shape[:-1], nw // stride, 1, stride)
  shifts = (jnp.arange(cpw, dtype=jnp.uint32) * bits)[:, None]
  codes = (x >> shifts) & jnp.uint32((1 << bits) - 1)
  codes = codes.reshape(*x.shape[:-3], nw * cpw).astype(dtype)
  return jnp.moveaxis(codes, -1, axis)


# --- Pallas kernels ----------------------------------------------------------------

_ROWS = 16    # words per program along the packed axis
_COLS = 128   # elements per program across it


def _source_rows(w, bits, stride, j, word_bits):
  """Element index (along the packed axis) held by slot ``j`` of word ``w``."""
  p = stride * codes_per_word(bits, word_bits)
  return (w // stride) * p + j * stride + w % stride


def _pack_kernel(c_ref, o_ref, *, bits, stride, nw, post, word_bits):
  i, k = pl.program_id(1), pl.program_id(2)
  w = i * _ROWS + jnp.arange(_ROWS, dtype=jnp.int32)[:, None]
  col = k * _COLS + jnp.arange(_COLS, dtype=jnp.int32)[None, :]
  # Rows/columns past the array are masked off (never read or written); in
  # interpret mode their indices must stay out of range rather than be clamped,
  # or a masked-off duplicate would overwrite a real element.
  ok = (w < nw) & (col < post)
  acc = jnp.zeros((_ROWS, _COLS), jnp.uint32)
  for j in range(codes_per_word(bits, word_bits)):
    c = pltriton.load(c_ref.at[_source_rows(w, bits, stride, j, word_bits), col], mask=ok, other=0)
    acc = acc | ((c & jnp.uint32((1 << bits) - 1)) << jnp.uint32(j * bits))
  pltriton.store(o_ref.at[w, col], acc.astype(o_ref.dtype), mask=ok)


def _unpack_kernel(w_ref, o_ref, *, bits, stride, nw, post, word_bits):
  i, k = pl.program_id(1), pl.program_id(2)
  w = i * _ROWS + jnp.arange(_ROWS, dtype=jnp.int32)[:, None]
  col = k * _COLS + jnp.arange(_COLS, dtype=jnp.int32)[None, :]
  ok = (w < nw) & (col < post)
  words = pltriton.load(w_ref.at[w, col], mask=ok, other=0).astype(jnp.uint32)
  for j in range(codes_per_word(bits, word_bits)):
    c = (words >> jnp.uint32(j * bits)) & jnp.uint32((1 << bits) - 1)
    pltriton.store(o_ref.at[_source_rows(w, bits, stride, j, word_bits), col], c, mask=ok)


def _as_3d(x, axis):
  axis = axis % x.ndim
  pre = int(np.prod(x.shape[:axis], dtype=np.int64))
  post = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
  return x.reshape(pre, x.shape[axis], post), axis


@functools.partial(jax.jit, static_argnames=("bits", "axis", "stride", "word_bits", "interpret"))
def _pack_call(codes, *, bits, axis, stride, word_bits, interpret):
  x, axis = _as_3d(codes.astype(jnp.uint32), axis)
  pre, n, post = x.shape
  nw = n // codes_per_word(bits, word_bits)
  kernel = functools.partial(_pack_kernel, bits=bits, stride=stride, nw=nw, post=post,
                             word_bits=word_bits)
  out = pl.pallas_call(
      kernel,
      grid=(pre, pl.cdiv(nw, _ROWS), pl.cdiv(post, _COLS)),
      in_specs=[pl.BlockSpec((None, n, post), lambda a, i, k: (a, 0, 0))],
      out_specs=pl.BlockSpec((None, nw, post), lambda a, i, k: (a, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((pre, nw, post), word_dtype(word_bits)),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="pack_subbyte",
  )(x)
  shape = list(codes.shape)
  shape[axis] = nw
  return out.reshape(shape)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "stride", "dtype", "word_bits",
                                             "interpret"))
def _unpack_call(words, *, bits, axis, stride, dtype, word_bits, interpret):
  x, axis = _as_3d(words, axis)
  pre, nw, post = x.shape
  n = nw * codes_per_word(bits, word_bits)
  kernel = functools.partial(_unpack_kernel, bits=bits, stride=stride, nw=nw, post=post,
                             word_bits=word_bits)
  out = pl.pallas_call(
      kernel,
      grid=(pre, pl.cdiv(nw, _ROWS), pl.cdiv(post, _COLS)),
      in_specs=[pl.BlockSpec((None, nw, post), lambda a, i, k: (a, 0, 0))],
      out_specs=pl.BlockSpec((None, n, post), lambda a, i, k: (a, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((pre, n, post), jnp.uint32),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="unpack_subbyte",
  )(x)
  shape = list(words.shape)
  shape[axis] = n
  return out.reshape(shape).astype(dtype)


def pack(codes: jax.Array, bits: int, axis: int = -1, stride: int = 1, *,
         word_bits: int = 32, implementation: str | tuple[str, ...] | None = None,
         interpret: bool | None = None) -> jax.Array:
  """Packs unsigned ``bits``-bit codes into words along ``axis`` (Pallas kernel).

  Args:
    codes: integer array ``[..., n, ...]`` with values in ``[0, 2**bits)``; ``n``
      (the length along ``axis``) a multiple of ``stride * codes_per_word(bits)``.
    bits: 2, 3, 4 or 8.
    axis: the packed axis.
    stride: words per pack block (see the module docstring for the layout).
    word_bits: 32 (uint32 words) or 16 (uint16 words).
    implementation: ``None`` (by device), ``"triton"``, ``"xla"`` or an ordered tuple.
    interpret: ``None`` = compiled on GPU, interpreted on CPU (``"triton"`` only).
  Returns:
    ``uint{word_bits}[..., n // codes_per_word(bits, word_bits), ...]``.
  """
  bits = check_bits(bits)
  stride = _check_stride(stride)
  word_bits = check_word_bits(word_bits)
  if codes.ndim == 0:
    raise ValueError("codes must have at least one dimension")
  _check_axis_len(codes.shape[axis], bits, stride, "codes", word_bits)
  check_codes_range(codes, bits)
  if codes.size == 0:
    shape = list(codes.shape)
    shape[axis] //= codes_per_word(bits, word_bits)
    return jnp.zeros(shape, word_dtype(word_bits))
  interpret = resolve_interpret(interpret)
  impls = {
      "triton": lambda c, config: _pack_call(c, bits=bits, axis=axis % codes.ndim, stride=stride,
                                             word_bits=word_bits, interpret=_triton_ok(interpret)),
      "xla": lambda c, config: pack_jnp(c, bits, axis, stride, word_bits=word_bits),
  }
  return dispatch("pack", impls, implementation, _default_order, None, {}, jnp.asarray(codes))


def unpack(words: jax.Array, bits: int, axis: int = -1, stride: int = 1, *,
           dtype=jnp.uint8, word_bits: int = 32,
           implementation: str | tuple[str, ...] | None = None,
           interpret: bool | None = None) -> jax.Array:
  """Inverse of ``pack``: ``uint{word_bits}[..., nw, ...]`` -> ``dtype[..., nw*cpw, ...]``."""
  bits = check_bits(bits)
  stride = _check_stride(stride)
  word_bits = check_word_bits(word_bits)
  words = jnp.asarray(words)
  _check_words(words, word_bits)
  if words.ndim == 0:
    raise ValueError("words must have at least one dimension")
  if words.shape[axis] % stride:
    raise ValueError(f"words has length {words.shape[axis]} along the packed axis, "
                     f"not a multiple of stride {stride}")
  if words.size == 0:
    shape = list(words.shape)
    shape[axis] *= codes_per_word(bits, word_bits)
    return jnp.zeros(shape, dtype)
  interpret = resolve_interpret(interpret)
  impls = {
      "triton": lambda w, config: _unpack_call(w, bits=bits, axis=axis % words.ndim, stride=stride,
                                               dtype=jnp.dtype(dtype), word_bits=word_bits,
                                               interpret=_triton_ok(interpret)),
      "xla": lambda w, config: unpack_jnp(w, bits, axis, stride, dtype=dtype, word_bits=word_bits),
  }
  return dispatch("unpack", impls, implementation, _default_order, None, {}, words)


def _default_order():
  return ("xla",) if impl_lib.platform() == "tpu" else ("triton",)


def _triton_ok(interpret: bool) -> bool:
  """The Triton kernel runs compiled on a GPU or interpreted anywhere."""
  if not interpret and impl_lib.platform() != "gpu":
    raise Unsupported(f"the Triton packing kernel compiles for GPUs only (device: {impl_lib.platform()})")
  return interpret
