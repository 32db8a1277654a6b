"""`moejax bench-decode`: decode speed of a model shape, one process, one table.

For every (expert bits, KV bits, batch, context) the model is built in its final precision
(random weights, quantized layer by layer: moejax.model.moe), its caches filled with random
keys and values up to the context, and timed:
  ms per token   the slope of the on-device decode loop's time over its step count (two
                 step counts: the loop's fixed costs, copying the caches in, cancel);
  TTFT           a prefill of `prompt` tokens into empty caches, to the first sampled token;
  compile        lowering + compiling the decode loop;
  bytes a step   routed experts actually touched (counted from the router over the timed
                 steps), the other weights, the KV cache up to the context; and the achieved
                 TB/s against a device copy measured in the same run.
The peer, in the same run, is the plain XLA path a MaxText-on-GPU user gets: `lax.ragged_dot`
experts, 16-bit weights and a bf16 KV cache (`peer_layers` layers, where the whole model
does not fit).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.atomic import write_atomic
from moejax.checkpoint import load_run_config
from moejax.config import Config, is_moe_layer, load_config, with_overrides
from moejax.model.moe import FLOAT_EXPERT_NAMES, QUANTIZED_EXPERT_NAMES
from moejax.model.kv_cache import DenseKVCache, QuantizedKVCache, kv_quant_config
from moejax.inference.load import decode_layout
from moejax.inference.timing import copy_bandwidth, median_seconds, step_seconds
from moejax.state import build_model, split_model
from pallas_kernels.kv import quant as kvq


@dataclasses.dataclass(frozen=True)
class Case:
  expert_bits: int
  kv_bits: int
  batch: int
  context: int
  expert_impl: str
  layers: int
  label: str


def case_config(cfg: Config, case: Case) -> Config:
  return with_overrides(cfg, [f"inference.expert_bits={case.expert_bits}",
                              f"kv_cache.bits={case.kv_bits}",
                              f"moe.expert_impl={case.expert_impl}",
                              f"model.num_layers={case.layers}",
                              f"model.max_seq_len={max(cfg.model.max_seq_len, case.context + 512)}"])


def random_caches(cfg: Config, batch: int, context: int, capacity: int, key) -> list:
  """One cache per layer holding `context` random tokens (never zeros: the kernels' time
  must not depend on easy data); quantized caches pick their outliers from that prefill."""
  m = cfg.model
  shape = (batch, m.num_kv_heads, context, m.head_dim)
  if cfg.kv_cache.bits != 16:
    qcfg = kv_quant_config(cfg.kv_cache)
    quantize = jax.jit(lambda kk, vk: kvq.quantize_kv(
        jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(vk, shape, jnp.bfloat16),
        qcfg, max_len=capacity))
  caches = []
  for layer in range(m.num_layers):
    k_key, v_key = jax.random.split(jax.random.fold_in(key, layer))
    if cfg.kv_cache.bits == 16:
      cache = DenseKVCache.create(batch, capacity, m.num_kv_heads, m.head_dim, jnp.bfloat16)
      fill = lambda k: jnp.swapaxes(jax.random.normal(k, shape, jnp.bfloat16), 1, 2)
      caches.append(DenseKVCache(cache.k_BSKD.at[:, :context].set(fill(k_key)),
                                 cache.v_BSKD.at[:, :context].set(fill(v_key)),
                                 jnp.int32(context)))
    else:
      caches.append(QuantizedKVCache(quantize(k_key, v_key), outliers_from_prefill=True))
  return caches


def kv_bytes_read(cfg: Config, batch: int, context: int) -> int:
  """Bytes of the caches a decode step at `context` reads (all layers)."""
  m = cfg.model
  elems = 2 * batch * m.num_kv_heads * context * m.head_dim
  if cfg.kv_cache.bits == 16:
    bits = 16.0
  else:
    bits = kvq.kv_bits_per_element(kv_quant_config(cfg.kv_cache), m.head_dim, context)["total"]
  return int(elems * bits / 8) * m.num_layers


EXPERT_NAMES = frozenset(FLOAT_EXPERT_NAMES + QUANTIZED_EXPERT_NAMES)  # routed experts


def weight_bytes(params) -> tuple[int, int, int]:
  """(bytes of one expert summed over the MoE layers, other weights read per step,
  vocab rows: the embedding, read B rows per step) from the parameter arrays."""
  flat = nnx.to_flat_state(params)
  per_expert = other = embed = 0
  for path, var in flat:
    value = var.get_value()
    name, nbytes = str(path[-1]), value.nbytes
    if name in EXPERT_NAMES:
      per_expert += nbytes // value.shape[0]
    elif name == "embed_VD":
      embed += nbytes
    else:
      other += nbytes
  return per_expert, other, embed


def _decode_program(graphdef):
  """(params, buffers, caches, feed_B, pos, n) -> tokens after n greedy decode steps, and
  the experts each MoE layer touched summed over the steps (the loop stays on device)."""

  def run(params, buffers, caches, feed_B, pos, n):
    model = nnx.merge(graphdef, params, buffers)
    B = feed_B.shape[0]

    def step(i, carry):
      feed_B, caches, touched = carry
      logits, stats, caches = model(feed_B[:, None], jnp.full((B, 1), pos + i, jnp.int32),
                                    caches)
      used = (jnp.stack([(s["load_E"] > 0).sum() for s in stats]).astype(jnp.int32) if stats
              else jnp.zeros((0,), jnp.int32))
      return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), caches, touched + used

    init = jnp.zeros((len(model.moe_layers),), jnp.int32)
    feed_B, _, touched = jax.lax.fori_loop(0, n, step, (feed_B, caches, init))
    return feed_B, touched

  return jax.jit(run)


def _prefill_program(graphdef, cfg: Config, capacity: int):
  def run(params, buffers, prompt_BP):
    model = nnx.merge(graphdef, params, buffers)
    B, P = prompt_BP.shape
    m = cfg.model
    if cfg.kv_cache.bits == 16:
      caches = [DenseKVCache.create(B, capacity, m.num_kv_heads, m.head_dim, jnp.bfloat16)
                for _ in range(m.num_layers)]
    else:
      qcfg = kv_quant_config(cfg.kv_cache)
      caches = [QuantizedKVCache.create(qcfg, B, capacity, m.num_kv_heads, m.head_dim)
                for _ in range(m.num_layers)]
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, _, caches = model(prompt_BP, pos, caches)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), caches

  return jax.jit(run)


def bench_case(base: Config, case: Case, *, steps: tuple[int, int], prompt: int, reps: int,
               copy_Bps: float, seed: int = 0) -> dict[str, Any]:
  cfg = case_config(base, case)
  model = build_model(cfg, seed)
  graphdef, params, buffers = split_model(model)
  if case.label != PEER_LABEL:   # the peer keeps the plain layout (three q/k/v matmuls)
    graphdef, params, buffers = decode_layout(graphdef, params, buffers)
  del model
  key = jax.random.key(seed)
  capacity = case.context + steps[1] + 1
  caches = random_caches(cfg, case.batch, case.context, capacity, key)
  feed_B = jax.random.randint(jax.random.fold_in(key, 1), (case.batch,), 0,
                              cfg.model.vocab_size, jnp.int32)
  program = _decode_program(graphdef)
  pos = jnp.int32(case.context)
  t0 = time.perf_counter()
  compiled = program.lower(params, buffers, caches, feed_B, pos, jnp.int32(1)).compile()
  compile_s = time.perf_counter() - t0
  few, many = steps
  t_few = median_seconds(compiled, (params, buffers, caches, feed_B, pos, jnp.int32(few)),
                         reps=reps)
  t_many = median_seconds(compiled, (params, buffers, caches, feed_B, pos, jnp.int32(many)),
                          reps=reps)
  step_s, slope_resolved = step_seconds(t_few, t_many, few, many)
  _, touched_L = compiled(params, buffers, caches, feed_B, pos, jnp.int32(many))
  experts_touched = float(np.asarray(touched_L).sum()) / many   # per step, all MoE layers
  del caches

  prompt_BP = jax.random.randint(jax.random.fold_in(key, 2), (case.batch, prompt), 0,
                                 cfg.model.vocab_size, jnp.int32)
  prefill = _prefill_program(graphdef, cfg, prompt + 1)
  ttft_s = median_seconds(prefill, (params, buffers, prompt_BP), reps=max(3, reps // 2))

  per_expert, other, embed = weight_bytes(params)
  moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.model.num_layers))
  expert_bytes = experts_touched * per_expert / max(moe_layers, 1)
  kv_bytes = kv_bytes_read(cfg, case.batch, case.context)
  embed_rows = case.batch * embed // cfg.model.vocab_size
  total = expert_bytes + other + embed_rows + kv_bytes
  return dict(label=case.label, expert_bits=case.expert_bits, kv_bits=case.kv_bits,
              batch=case.batch, context=case.context, layers=case.layers,
              expert_impl=case.expert_impl, ms_per_token=step_s * 1e3,
              ms_per_token_is_upper_bound=not slope_resolved,
              tokens_per_s=case.batch / step_s, ttft_ms=ttft_s * 1e3, prompt=prompt,
              compile_s=compile_s, experts_touched_per_layer=experts_touched / max(moe_layers, 1),
              expert_MB=expert_bytes / 1e6, other_weights_MB=(other + embed_rows) / 1e6,
              kv_MB=kv_bytes / 1e6, TBps=total / step_s / 1e12,
              frac_of_copy=total / step_s / copy_Bps, floor_ms=total / copy_Bps * 1e3)


PEER_LABEL = "XLA peer (ragged_dot, bf16 KV)"


def cases(cfg: Config, *, batches, contexts, expert_bits, kv_bits, layers: int | None,
          peer_layers: int | None) -> list[Case]:
  L = layers or cfg.model.num_layers
  out = []
  for b in batches:
    for s in contexts:
      for eb in expert_bits:
        for kb in kv_bits:
          out.append(Case(eb, kb, b, s, "gmm", L, f"moejax int{eb}" if eb < 16 else "moejax"))
      if peer_layers != 0:
        pl = peer_layers or L
        if pl != L:   # ours at the peer's depth too: the per-layer ratio is measured, not scaled
          for eb in expert_bits:
            for kb in kv_bits:
              out.append(Case(eb, kb, b, s, "gmm", pl,
                              f"moejax int{eb}" if eb < 16 else "moejax"))
        out.append(Case(16, 16, b, s, "ragged", pl, PEER_LABEL))
  return out


def run(cfg: Config, *, batches, contexts, expert_bits, kv_bits, layers=None, peer_layers=None,
        steps=(8, 40), prompt=128, reps=10, copy_bytes=2 << 30, print_row=print,
        on_row=lambda result: None) -> dict:
  """Every case in one process; on_row(result) after each row (e.g. save what is done)."""
  dev = jax.devices()[0]
  copy_Bps = copy_bandwidth(copy_bytes, reps=reps)
  result = dict(date=time.strftime("%Y-%m-%d"), device=getattr(dev, "device_kind", str(dev)),
                jax=jax.__version__, copy_TBps=copy_Bps / 1e12, rows=[])
  print_row(f"device {result['device']}, jax {jax.__version__}, copy {copy_Bps / 1e12:.2f} TB/s")
  for case in cases(cfg, batches=batches, contexts=contexts, expert_bits=expert_bits,
                    kv_bits=kv_bits, layers=layers, peer_layers=peer_layers):
    try:
      row = bench_case(cfg, case, steps=steps, prompt=prompt, reps=reps, copy_Bps=copy_Bps)
    except Exception as e:  # noqa: BLE001  (one case failing, e.g. out of memory, is a row)
      row = dict(dataclasses.asdict(case), error=f"{type(e).__name__}: {str(e)[:200]}")
    result["rows"].append(row)
    print_row(format_row(row))
    on_row(result)
  return result


HEADER = (f"{'path':32s} {'exp':>4s} {'kv':>3s} {'B':>3s} {'context':>7s} {'L':>3s} "
          f"{'ms/tok':>8s} {'tok/s':>8s} {'TTFT ms':>8s} {'compile s':>9s} {'exp/L':>5s} "
          f"{'MB/step':>8s} {'TB/s':>5s} {'%copy':>5s}")


def format_row(r: dict) -> str:
  head = (f"{r['label']:32s} {r['expert_bits']:4d} {r['kv_bits']:3d} {r['batch']:3d} "
          f"{r['context']:7d} {r['layers']:3d} ")
  if "error" in r:
    return head + "ERROR " + r["error"]
  mb = r["expert_MB"] + r["other_weights_MB"] + r["kv_MB"]
  line = head + (f"{r['ms_per_token']:8.3f} {r['tokens_per_s']:8.0f} {r['ttft_ms']:8.1f} "
                 f"{r['compile_s']:9.1f} {r['experts_touched_per_layer']:5.2f} {mb:8.0f} "
                 f"{r['TBps']:5.2f} {100 * r['frac_of_copy']:5.0f}")
  if r.get("ms_per_token_is_upper_bound"):
    line += "  (ms/tok: upper bound, noise hid the slope; raise --steps)"
  return line


SMOKE_OVERRIDES = ("data.bpe_vocab_size=256", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1",
                   "model.head_dim=64", "model.vocab_size=256", "moe.num_experts=4",
                   "moe.expert_hidden=64", "moe.expert_impl=gmm", "inference.expert_group_size=16",
                   "kv_cache.group_size=16", "kv_cache.residual_window=16")


def run_cli(config_or_run: str, overrides, *, batches, contexts, expert_bits, kv_bits, layers,
            peer_layers, steps, prompt, smoke: bool, out: str) -> dict:
  """`moejax bench-decode`: the table on stdout, the rows as JSON in `out`."""
  path = Path(config_or_run)
  if path.is_dir():
    if not (path / "checkpoints").is_dir():
      raise FileNotFoundError(f"{path} is neither a YAML config nor a run directory")
    cfg = load_run_config(path)
  else:
    cfg = load_config(path)
  if len(steps) != 2 or steps[0] >= steps[1]:
    raise ValueError(f"--steps {steps}: give two increasing step counts, e.g. 8,40")
  if smoke:
    cfg = with_overrides(cfg, list(SMOKE_OVERRIDES))
    batches, contexts = batches[:2], [min(c, 96) for c in contexts[:1]]
    layers = min(layers or 2, 3)
    steps, prompt = (2, 8), min(prompt, 8)
  cfg = with_overrides(cfg, list(overrides))
  bits = expert_bits or [cfg.inference.expert_bits]
  for b in bits:
    if b not in (16, 8, 4):
      raise ValueError(f"--expert-bits {b}: choose 16, 8 or 4")
  for b in kv_bits:
    if b not in (16, 8, 4, 3, 2):
      raise ValueError(f"--kv-bits {b}: choose 16 (bf16) or 2, 3, 4, 8")
  print(HEADER)
  meta = dict(config=str(config_or_run), overrides=list(overrides))
  save = lambda result: write_atomic(Path(out), json.dumps({**result, **meta}, indent=1))
  result = run(cfg, batches=batches, contexts=contexts, expert_bits=bits, kv_bits=kv_bits,
               layers=layers, peer_layers=peer_layers, steps=tuple(steps), prompt=prompt,
               reps=2 if smoke else 10, copy_bytes=(1 << 20) if smoke else (2 << 30),
               on_row=save)
  print(f"\n{out}")
  return result
