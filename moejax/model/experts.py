"""Expert SwiGLU computation, one signature for every `expert_impl`.

    y_TD = expert_ffn(impl, x_TD, expert_TK, weight_TK, keep_TK, w_gate_EDF, w_up_EDF,
                      w_down_EFD, capacity=C)

Each (token, slot) with keep=True contributes weight * SwiGLU_e(x) for its expert e;
dropped slots contribute nothing. The impls differ only in how they group tokens:
  dense  : one-hot dispatch into [E, C, D] capacity buffers, batched einsum, combine.
  ragged : sort assignments by expert, jax.lax.ragged_dot over contiguous groups.
  blocked: the same sort, each group padded to whole blocks of rows, then one batched
           matmul over blocks with each block's expert weights gathered: pure jnp, cheap on
           CPU where ragged_dot computes every expert for every row (measured ~9x slower).
  gmm    : the same sort, the Pallas grouped matmul from pallas_kernels (reads only the
           weights of experts that received tokens).
`quantized_expert_ffn` is the same with int8 / int4 weights, gate and up fused.

Shape letters beyond the project's legend (moejax/__init__.py): M rows = the T*K
(token, slot) assignments sorted by expert; I / O in / out features of a grouped matmul.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import QuantizedExpertWeights, dequantize_expert_weights

from moejax.model.routing import position_in_expert

EXPERT_IMPLS = ("dense", "ragged", "blocked", "gmm")
BLOCK_ROWS = 128  # row block of the `blocked` impl


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


def dense_experts(x_TD, expert_TK, weight_TK, keep_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                  capacity: int):
  E = w_gate_EDF.shape[0]
  pos_TK = position_in_expert(expert_TK, keep_TK, E)
  keep_TK = keep_TK & (pos_TK < capacity)
  # dispatch_TEC[t, e, c] = 1 when slot of token t sits at position c of expert e.
  dispatch_TKEC = (jax.nn.one_hot(expert_TK, E, dtype=x_TD.dtype)[..., None]
                   * jax.nn.one_hot(pos_TK, capacity, dtype=x_TD.dtype)[:, :, None, :]
                   * keep_TK[..., None, None].astype(x_TD.dtype))
  dispatch_TEC = dispatch_TKEC.sum(axis=1)
  combine_TEC = (dispatch_TKEC * weight_TK[..., None, None].astype(x_TD.dtype)).sum(axis=1)
  x_ECD = jnp.einsum("tec,td->ecd", dispatch_TEC, x_TD)
  h_ECF = _swiglu(jnp.einsum("ecd,edf->ecf", x_ECD, w_gate_EDF),
                  jnp.einsum("ecd,edf->ecf", x_ECD, w_up_EDF))
  y_ECD = jnp.einsum("ecf,efd->ecd", h_ECF, w_down_EFD)
  return jnp.einsum("tec,ecd->td", combine_TEC, y_ECD)


def _sort_by_expert(expert_TK, keep_TK, num_experts):
  """Flattened assignments sorted by expert, dropped ones last (expert id E) -> (order_M:
  the assignment at each sorted row, rank_M: the sorted row of each assignment, group
  sizes)."""
  eid = jnp.where(keep_TK, expert_TK, num_experts).reshape(-1)
  order_M = jnp.argsort(eid, stable=True).astype(jnp.int32)
  rank_M = jnp.zeros_like(order_M).at[order_M].set(
      jnp.arange(order_M.shape[0], dtype=jnp.int32), unique_indices=True)
  group_sizes_E = jnp.bincount(eid, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order_M, rank_M, group_sizes_E


# The K copies of each token gathered into sorted order: XLA would transpose the gather into
# a scatter-add over T (atomics, K rows per token); the sort is a permutation of the T*K
# assignments, so the gradient is the gather by its inverse and a sum over K.

@jax.custom_vjp
def _dispatch(x_TD, order_M, rank_M):
  """x_MD: row m is the token of sorted assignment m (each token K times)."""
  return x_TD[order_M // (order_M.shape[0] // x_TD.shape[0])]


def _dispatch_fwd(x_TD, order_M, rank_M):
  return _dispatch(x_TD, order_M, rank_M), (rank_M, x_TD.shape[0])


def _dispatch_bwd(res, g_MD):
  rank_M, T = res
  return g_MD[rank_M].reshape(T, -1, g_MD.shape[-1]).sum(1), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _grouped_experts(hidden, x_TD, expert_TK, weight_TK, keep_TK, w_down_EFD, matmul):
  """hidden(x_MD, group_sizes_E) -> h_MF, the SwiGLU activations of the sorted rows."""
  T, K = expert_TK.shape
  E = w_down_EFD.shape[0]
  order_M, rank_M, group_sizes_E = _sort_by_expert(expert_TK, keep_TK, E)
  x_MD = _dispatch(x_TD, order_M, rank_M)                        # M = T*K sorted rows
  y_MD = matmul(hidden(x_MD, group_sizes_E), w_down_EFD, group_sizes_E)
  # Rows past sum(group_sizes) are dropped assignments: their weight is 0 below, and the
  # where() also discards whatever the matmul left there. The scatter-add sums each token's
  # rows in ascending expert order (what expert offload reproduces pass by pass); its
  # transpose is a gather.
  w_M = weight_TK.reshape(-1)[order_M]
  valid_M = jnp.arange(T * K) < group_sizes_E.sum()
  y_MD = jnp.where(valid_M[:, None], y_MD * w_M[:, None].astype(y_MD.dtype), 0)
  return jnp.zeros_like(x_TD).at[order_M // K].add(y_MD.astype(x_TD.dtype))


def _separate_gate_up(matmul, w_gate_EDF, w_up_EDF):
  return lambda x_MD, sizes_E: _swiglu(matmul(x_MD, w_gate_EDF, sizes_E),
                                       matmul(x_MD, w_up_EDF, sizes_E))


def _fused_gate_up(matmul, w_gate_EDF, w_up_EDF):
  """Gate and up as one grouped matmul of twice the width: x read once, one kernel forward,
  one data-gradient and one weight-gradient kernel backward. The concatenation copies every
  expert's gate and up weights: free only where it fuses into a cast that copies them anyway
  (float32 parameters, 16-bit compute: training); at decode it would copy all E experts per
  step to run the few routed ones."""
  return _gate_up_hidden(matmul, jnp.concatenate([w_gate_EDF, w_up_EDF], axis=2))


def _gate_up_hidden(matmul, w_gate_up):
  """SwiGLU of one grouped matmul over gate|up weights ([E, D, 2F], gate first)."""
  def hidden(x_MD, sizes_E):
    gate_MF, up_MF = jnp.split(matmul(x_MD, w_gate_up, sizes_E), 2, axis=1)
    return _swiglu(gate_MF, up_MF)
  return hidden


def _ragged_matmul(x_MI, w_EIO, group_sizes_E):
  return jax.lax.ragged_dot(x_MI, w_EIO, group_sizes_E)


def _blocked_matmul(x_MI, w_EIO, group_sizes_E, block: int = BLOCK_ROWS):
  """Grouped matmul as a batched matmul over J row blocks of W rows each; rows past
  sum(sizes) give 0."""
  M, I = x_MI.shape
  E, _, O = w_EIO.shape
  W = min(block, max(8, M))
  J = -(-M // W) + E                                   # static bound on padded blocks
  ends = jnp.cumsum(group_sizes_E)
  padded = -(-group_sizes_E // W) * W
  padded_ends = jnp.cumsum(padded)
  rows = jnp.arange(M)
  group_M = jnp.searchsorted(ends, rows, side="right")   # E for rows past the last group
  g = jnp.minimum(group_M, E - 1)
  dest_M = (padded_ends[g] - padded[g]) + rows - (ends[g] - group_sizes_E[g])
  dest_M = jnp.where(group_M < E, dest_M, J * W)       # out of range: dropped
  x_pad = jnp.zeros((J * W, I), x_MI.dtype).at[dest_M].set(x_MI, mode="drop")
  expert_J = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(J) * W, side="right"), E - 1)
  y_JWO = jnp.einsum("jwi,jio->jwo", x_pad.reshape(J, W, I), w_EIO[expert_J])
  return y_JWO.reshape(J * W, O).at[dest_M].get(mode="fill", fill_value=0)


def _gmm_matmul(x_MI, w_EIO, group_sizes_E):
  return pallas_kernels.gmm(x_MI, w_EIO, group_sizes_E)


_MATMULS = {"ragged": _ragged_matmul, "blocked": _blocked_matmul, "gmm": _gmm_matmul}


def expert_ffn(impl: str, x_TD, expert_TK, weight_TK, keep_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
               *, capacity: int, fuse_gate_up: bool = False):
  """Weighted sum over each token's kept experts of SwiGLU_e(x): [T, D]. fuse_gate_up (gmm
  only): gate and up as one grouped matmul (_fused_gate_up)."""
  if impl == "dense":
    return dense_experts(x_TD, expert_TK, weight_TK, keep_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                         capacity=capacity)
  if impl in _MATMULS:
    matmul = _MATMULS[impl]
    gate_up = _fused_gate_up if impl == "gmm" and fuse_gate_up else _separate_gate_up
    return _grouped_experts(gate_up(matmul, w_gate_EDF, w_up_EDF), x_TD, expert_TK,
                            weight_TK, keep_TK, w_down_EFD, matmul)
  raise ValueError(f"unknown expert_impl {impl!r}; choose one of {', '.join(EXPERT_IMPLS)}")


def quantized_expert_ffn(impl: str, x_TD, expert_TK, weight_TK, keep_TK,
                         w_gate_up: QuantizedExpertWeights, w_down: QuantizedExpertWeights, *,
                         capacity: int):
  """expert_ffn with int8 / int4 weights: w_gate_up is gate and up fused, [E, D, 2F] (gate in
  the first F columns), w_down [E, F, D]. `gmm` hands the codes to the kernel, which
  dequantizes them as it reads them: one weight read per routed expert for gate and up
  together. The other impls dequantize whole matrices first (in x's dtype)."""
  if impl == "gmm":
    return _grouped_experts(_gate_up_hidden(_gmm_matmul, w_gate_up), x_TD, expert_TK,
                            weight_TK, keep_TK, w_down, _gmm_matmul)
  w_gate_up_ED2F = dequantize_expert_weights(w_gate_up, x_TD.dtype)
  w_gate_EDF, w_up_EDF = jnp.split(w_gate_up_ED2F, 2, axis=2)
  return expert_ffn(impl, x_TD, expert_TK, weight_TK, keep_TK, w_gate_EDF, w_up_EDF,
                    dequantize_expert_weights(w_down, x_TD.dtype), capacity=capacity)
