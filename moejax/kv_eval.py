"""Perplexity under KV-cache quantization, outlier-channel calibration, cache memory.

Every setting is evaluated the way generation sees it: at each position the keys and values
of earlier tokens come from the quantized cache (quantized groups, full-precision window and
sinks) through `TeacherForcedQuantKV`; tests/test_kv_eval.py checks that this equals a
token-by-token decode through the real `QuantizedKVCache` and its Pallas attention kernel.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from moejax.config import Config
from moejax.data import TokenDataset, spread_val_batches, train_batch, val_batches
from moejax.inference.load import TrainedModel
from moejax.model.kv_cache import (OutlierStats, QuantizedKVCache, TeacherForcedQuantKV,
                                   kv_quant_config)
from pallas_kernels.kv import quant as pk

CALIBRATION_FILE = "kv_outliers.npz"
CONTEXTS = (4096, 32768, 131072)


@dataclasses.dataclass(frozen=True)
class KVSetting:
  bits: int               # 16 = bf16 cache
  outlier_fraction: float

  @property
  def label(self) -> str:
    if self.bits == 16:
      return "bf16"
    return f"{self.bits}-bit" + (f" +{self.outlier_fraction:.0%} fp16 ch" if self.outlier_fraction else "")


# ------------------------------------------------------------ calibration ---

def calibrate(tm: TrainedModel, data: TokenDataset, num_batches: int = 4) -> dict[str, np.ndarray]:
  """Ranks each (layer, kv-head)'s key and value channels by max |x| over training text.

  Returns {"k_rank_LKD", "v_rank_LKD"}: channel indices, largest magnitude first.
  """
  m = tm.cfg.model
  d = tm.cfg.data
  graphdef = tm.graphdef

  @jax.jit
  def stats(params, buffers, tokens, caches):
    model = nnx.merge(graphdef, params, buffers)
    return model(tokens, None, caches)[2]

  caches = [OutlierStats.create(m.num_kv_heads, m.head_dim) for _ in range(m.num_layers)]
  for i in range(num_batches):
    inputs, _ = train_batch(data.train, d.batch_size, d.seq_len, seed=12345, step=i)
    caches = stats(tm.params, tm.buffers, inputs, caches)
  kmax = np.stack([np.asarray(c.kmax_KD) for c in caches])
  vmax = np.stack([np.asarray(c.vmax_KD) for c in caches])
  return {"k_rank_LKD": np.argsort(-kmax, axis=-1).astype(np.int32),
          "v_rank_LKD": np.argsort(-vmax, axis=-1).astype(np.int32)}


def save_calibration(run_dir: Path, ranks: dict[str, np.ndarray], step: int) -> Path:
  path = Path(run_dir) / CALIBRATION_FILE
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, step=step, **ranks)
  tmp.replace(path)
  return path


def load_calibration(run_dir: Path) -> dict[str, np.ndarray] | None:
  path = Path(run_dir) / CALIBRATION_FILE
  if not path.is_file():
    return None
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def outlier_indices(rank_KD: np.ndarray, n_out: int) -> jax.Array:
  """The n_out largest-magnitude channels per kv-head, ascending: int32 [Hkv, n_out]."""
  return jnp.sort(jnp.asarray(rank_KD[:, :n_out], jnp.int32), axis=-1)


# ---------------------------------------------------------- cache factories ---

def layer_bits(cfg: Config, bits: int) -> list[int]:
  return list(cfg.kv_cache.layer_bits) or [bits] * cfg.model.num_layers


def _layer_outliers(ranks, layer: int, qcfg, head_dim: int):
  n = qcfg.num_outliers(head_dim)
  return (outlier_indices(ranks["k_rank_LKD"][layer], n),
          outlier_indices(ranks["v_rank_LKD"][layer], n))


def teacher_forced_caches(cfg: Config, setting: KVSetting, ranks, batch: int):
  """One TeacherForcedQuantKV per layer (None for bf16 layers: plain attention)."""
  m = cfg.model
  out = []
  for layer, bits in enumerate(layer_bits(cfg, setting.bits)):
    if bits == 16:
      out.append(_PlainAttention())
      continue
    qcfg = kv_quant_config(cfg.kv_cache, bits, setting.outlier_fraction)
    if ranks is None:
      raise ValueError("quantized evaluation needs calibrated outlier channels: run "
                       "`moejax calibrate RUN_DIR` first")
    k_idx, v_idx = _layer_outliers(ranks, layer, qcfg, m.head_dim)
    out.append(TeacherForcedQuantKV(jnp.broadcast_to(k_idx, (batch,) + k_idx.shape),
                                    jnp.broadcast_to(v_idx, (batch,) + v_idx.shape), qcfg))
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _PlainAttention:
  """A bf16 layer inside a teacher-forced pass: keys/values rounded to bf16 as a cache holds them."""

  def extend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT):
    from moejax.model.attention import causal_mask, gqa_attention
    bf = lambda x: x.astype(jnp.bfloat16).astype(q_BTHD.dtype)
    return gqa_attention(q_BTHD, bf(k_BTKD), bf(v_BTKD), causal_mask(q_BTHD.shape[1])), self


def quantized_cache_factory(setting: KVSetting, ranks):
  """For the generation Engine: per-layer QuantizedKVCache (bf16 DenseKVCache for 16-bit layers)."""
  from moejax.model.kv_cache import DenseKVCache

  def factory(cfg: Config, batch: int, capacity: int) -> list:
    m = cfg.model
    caches = []
    for layer, bits in enumerate(layer_bits(cfg, setting.bits)):
      if bits == 16:
        caches.append(DenseKVCache.create(batch, capacity, m.num_kv_heads, m.head_dim))
        continue
      qcfg = kv_quant_config(cfg.kv_cache, bits, setting.outlier_fraction)
      idx = (None, None) if ranks is None else _layer_outliers(ranks, layer, qcfg, m.head_dim)
      caches.append(QuantizedKVCache.create(qcfg, batch, capacity, m.num_kv_heads, m.head_dim,
                                            *idx))
    return caches

  return factory


# --------------------------------------------------------- memory accounting ---

def cache_bytes(cfg: Config, setting: KVSetting, context: int, batch: int = 1) -> int:
  """Exact bytes of the model's whole KV cache (all layers) with capacity `context`."""
  m = cfg.model
  total = 0
  for bits in layer_bits(cfg, setting.bits):
    if bits == 16:
      total += 2 * batch * context * m.num_kv_heads * m.head_dim * 2 + 4
      continue
    qcfg = kv_quant_config(cfg.kv_cache, bits, setting.outlier_fraction)
    shape = jax.eval_shape(lambda: pk.empty_kv(qcfg, batch, m.num_kv_heads, m.head_dim, context))
    total += shape.nbytes
  return total


def effective_bits(cfg: Config, setting: KVSetting, context: int = 4096) -> float:
  m = cfg.model
  elements = 2 * context * m.num_kv_heads * m.head_dim * m.num_layers
  return 8.0 * cache_bytes(cfg, setting, context) / elements


# -------------------------------------------------------------- evaluation ---

def eval_ppl(tm: TrainedModel, data: TokenDataset, settings: list[KVSetting], ranks, *,
             max_batches: int | None = 8, seq_len: int | None = None, batch_size: int | None = None,
             quiet: bool = False) -> list[dict]:
  """Validation perplexity for each KV setting, plus its memory figures.

  ranks: calibrated outlier-channel ranking (see `calibrate`); needed for quantized settings.
  """
  cfg = tm.cfg
  T = seq_len or cfg.data.seq_len
  B = batch_size or cfg.data.batch_size
  graphdef = tm.graphdef

  @jax.jit
  def nll(params, buffers, inputs, targets, caches):
    model = nnx.merge(graphdef, params, buffers)
    logits, _, _ = model(inputs, None, caches)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()

  batches = list(val_batches(data.val, B, T, drop_remainder=True) if max_batches is None
                 else spread_val_batches(data.val, B, T, max_batches))
  if not batches:
    raise ValueError(f"validation split too small for one batch of {B}x{T} tokens")
  n_tokens = sum(t.size for _, t in batches)
  n_bytes = sum(data.tokenizer.byte_count(t) for _, t in batches)
  rows = []
  bar = tqdm(total=len(settings) * len(batches), desc="kv sweep", disable=quiet, dynamic_ncols=True)
  for setting in settings:
    caches = teacher_forced_caches(cfg, setting, ranks, B)
    total = 0.0
    for inputs, targets in batches:
      total += float(nll(tm.params, tm.buffers, inputs, targets, caches))
      bar.update(1)
    loss = total / n_tokens
    row = {"setting": setting.label, "bits": setting.bits,
           "outlier_fraction": setting.outlier_fraction,
           "effective_bits": effective_bits(cfg, setting, 4096),
           "kv_bytes_per_token": cache_bytes(cfg, setting, 4096) / 4096,
           **{f"kv_bytes_{c // 1024}k": cache_bytes(cfg, setting, c) for c in CONTEXTS},
           "val_loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpb": total / math.log(2) / n_bytes,
           "val_tokens": n_tokens, "val_batches": len(batches)}
    rows.append(row)
  bar.close()
  base = next((r["ppl"] for r in rows if r["bits"] == 16), None)
  for r in rows:   # None (JSON null) without a bf16 row to compare with
    r["delta_ppl_pct"] = 100.0 * (r["ppl"] / base - 1.0) if base else None
  return rows


def format_table(rows: list[dict]) -> str:
  def mib(b):
    return f"{b / 2**20:,.1f}"
  header = ["setting", "eff bits", "B/token", "KV@4k MiB", "KV@32k MiB", "KV@128k MiB", "ppl",
            "Δppl %", "bits/byte"]
  body = [[r["setting"], f"{r['effective_bits']:.2f}", f"{r['kv_bytes_per_token']:,.0f}",
           mib(r["kv_bytes_4k"]), mib(r["kv_bytes_32k"]), mib(r["kv_bytes_128k"]),
           f"{r['ppl']:.4f}",
           "n/a" if r["delta_ppl_pct"] is None else f"{r['delta_ppl_pct']:+.2f}",
           f"{r['bpb']:.4f}"] for r in rows]
  widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]
  fmt = lambda x: "  ".join(c.rjust(w) for c, w in zip(x, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(x) for x in body])


def plot_ppl_vs_bits(rows: list[dict], path: Path) -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in rows:
    ax.scatter(r["effective_bits"], r["ppl"], color="C0" if r["outlier_fraction"] else "C1")
    ax.annotate(r["setting"], (r["effective_bits"], r["ppl"]), fontsize=7,
                xytext=(3, 3), textcoords="offset points")
  ax.set_xlabel("effective bits per KV element (4k context, metadata included)")
  ax.set_ylabel("validation perplexity")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def settings_from(bits: list[int], outliers: list[float]) -> list[KVSetting]:
  """bf16 once, then every (bits, outlier fraction) pair."""
  out = [KVSetting(16, 0.0)] if 16 in bits else []
  out += [KVSetting(b, f) for b in bits if b != 16 for f in outliers]
  return out


def sweep_name(settings: list[KVSetting], max_batches: int | None) -> str:
  """File stem naming a sweep's settings, so sweeps of different settings never overwrite
  each other: e.g. kv_sweep_kv16-4-2_out0-0.15_b8."""
  bits = dict.fromkeys(s.bits for s in settings)
  fracs = dict.fromkeys(s.outlier_fraction for s in settings if s.bits != 16) or {0.0: None}
  return (f"kv_sweep_kv{'-'.join(map(str, bits))}_out{'-'.join(f'{f:g}' for f in fracs)}"
          f"_b{'all' if max_batches is None else max_batches}")


def run_sweep(run_dir: Path, settings: list[KVSetting], *, max_batches: int | None,
              quiet: bool = False, overrides: list[str] | None = None
              ) -> tuple[list[dict], dict[str, str]]:
  """Loads the run, calibrates if needed, sweeps, writes JSON + PNG named after the
  settings next to the checkpoints (both only once the sweep has succeeded)."""
  from moejax.atomic import write_atomic
  from moejax.inference.load import load_trained
  from moejax.run_io import load_data
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches={max_batches}: must be >= 1 (None: the whole split)")
  run_dir = Path(run_dir)
  tm = load_trained(run_dir, overrides)
  data = load_data(tm.cfg, run_dir)
  ranks = load_calibration(run_dir)
  if ranks is None:
    ranks = calibrate(tm, data)
    save_calibration(run_dir, ranks, tm.step)
  rows = eval_ppl(tm, data, settings, ranks, max_batches=max_batches, quiet=quiet)
  stem = sweep_name(settings, max_batches)
  if overrides:   # settings the run was not trained with: say so in the name
    stem += "_" + "_".join(o.replace("/", "-").replace("=", "-") for o in overrides)
  json_path = run_dir / f"{stem}.json"
  write_atomic(json_path, json.dumps({"step": tm.step, "overrides": list(overrides or []),
                                      "rows": rows}, indent=2, allow_nan=False))
  png = plot_ppl_vs_bits(rows, run_dir / f".{stem}.tmp.png").replace(run_dir / f"{stem}.png")
  return rows, {"json": str(json_path), "plot": str(png)}


def demo_sweep(run_dir: Path) -> None:
  rows, paths = run_sweep(run_dir, settings_from([16, 4, 3, 2], [0.0, 0.15]), max_batches=4)
  print(f"\nKV-cache quantization (perplexity through the quantized cache, "
        f"{rows[0]['val_tokens']:,} validation tokens):")
  print(format_table(rows))
  print(f"\n{paths['json']}\n{paths['plot']}")
