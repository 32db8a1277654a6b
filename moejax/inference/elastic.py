"""Elastic routing at decode (issue 36): a model trained with top-k routing, scored with
`moe.routing=top_p` or `entropy` instead (routing.py), so that confident tokens use fewer
experts. Per setting: held-out perplexity, experts per token (each MoE layer's
`experts_per_token` statistic), and optionally greedy-decode ms per token.

The baseline is the trained routing. Every setting reuses the trained parameters; only
the graphdef changes (the routing config is static in it), so the weights are restored
once and no setting needs a checkpoint of its own.

Weights under the elastic modes are the chosen experts' softmax probs, renormalized when
moe.renormalize is set: what a softmax_topk model was trained with. A topk_softmax model's
weights are the softmax of its chosen logits, which is its chosen probs renormalized, so
its elastic settings set moe.renormalize=true whatever its config says.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moejax.config import Config, is_moe_layer, with_overrides

SWEEP_FILE = "routing_sweep.json"
DEFAULT_TOP_P = (0.5, 0.7, 0.9)
DEFAULT_ENTROPY = (0.5, 0.7, 0.9)   # the tiny run's routers: median h 0.80-0.85, 5 % below 0.53
DECODE_STEPS = (8, 40)    # two greedy-decode loop lengths: ms/token is the slope between them
DECODE_PROMPT = 64


@dataclasses.dataclass(frozen=True)
class Setting:
  mode: str                  # "trained" (the baseline) | top_p | entropy
  threshold: float | None    # moe.top_p or moe.entropy_threshold; None for the baseline

  @property
  def label(self) -> str:
    return "trained" if self.threshold is None else f"{self.mode}={self.threshold:g}"


def check_thresholds(top_p: list[float], entropy: list[float]) -> None:
  """The flags' ranges (the config would say moe.top_p=..., not the flag)."""
  for p in top_p:
    if not 0.0 < p <= 1.0:
      raise ValueError(f"--top-p {p:g}: must be in (0, 1] (cumulative router probability)")
  for h in entropy:
    if not 0.0 <= h < 1.0:
      raise ValueError(f"--entropy {h:g}: must be in [0, 1) (normalized router entropy)")


def settings_from(top_p: list[float], entropy: list[float]) -> list[Setting]:
  """The baseline first, then each threshold once, in the order given."""
  return ([Setting("trained", None)] + [Setting("top_p", p) for p in dict.fromkeys(top_p)]
          + [Setting("entropy", h) for h in dict.fromkeys(entropy)])


def setting_overrides(trained: Config, s: Setting, max_k: int, min_k: int) -> list[str]:
  """The moe.* overrides that turn the trained routing into setting s."""
  if s.threshold is None:
    return []
  out = [f"moe.routing={s.mode}", f"moe.max_k={max_k}"]
  if s.mode == "top_p":
    out.append(f"moe.top_p={s.threshold!r}")
  else:
    out += [f"moe.entropy_threshold={s.threshold!r}", f"moe.min_k={min_k}"]
  if trained.moe.routing == "topk_softmax":   # its weights are renormalized probs (module doc)
    out.append("moe.renormalize=true")
  return out


def has_moe(cfg: Config) -> bool:
  return any(is_moe_layer(cfg, i) for i in range(cfg.model.num_layers))


# -------------------------------------------------------------- evaluation ---

def make_routing_eval_step(graphdef):
  """make_eval_step's (summed NLL, count), plus each MoE layer's experts per token."""
  def step(params, buffers, inputs_BT, targets_BT):
    model = nnx.merge(graphdef, params, buffers)
    logits, stats, _ = model(inputs_BT)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT)
    ept_L = jnp.stack([s["experts_per_token"] for s in stats])
    return nll.sum(), jnp.asarray(nll.size, jnp.float32), ept_L
  return jax.jit(step)


def score(cfg: Config, graphdef, params, buffers, data, max_batches: int | None) -> dict:
  """evaluate() of one routing setting, the experts per token recorded on the side (every
  batch has B x T tokens, so the mean over batches is the mean over tokens)."""
  from moejax.evaluate import evaluate
  step, ept = make_routing_eval_step(graphdef), []

  def eval_step(params, buffers, inputs_BT, targets_BT):
    nll, count, ept_L = step(params, buffers, inputs_BT, targets_BT)
    ept.append(ept_L)
    return nll, count

  d = cfg.data
  result = evaluate(eval_step, params, buffers, data, d.batch_size, d.seq_len, max_batches)
  ept_L = np.mean(np.stack(jax.device_get(ept)), axis=0)
  return {**result, "experts_per_token": float(ept_L.mean()),
          "experts_per_token_L": [float(x) for x in ept_L]}


def _decode_programs(cfg: Config, graphdef, batch: int, capacity: int):
  """(prefill, loop): prefill a prompt into bf16 caches; n greedy decode steps, returning
  how many distinct experts each step's MoE layers read (summed over steps and layers)."""
  from moejax.inference.generate import dense_caches

  @jax.jit
  def prefill(params, buffers, prompt_BP):
    model = nnx.merge(graphdef, params, buffers)
    B, P = prompt_BP.shape
    pos_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, _, caches = model(prompt_BP, pos_BP, dense_caches(cfg, batch, capacity))
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), caches

  @jax.jit
  def loop(params, buffers, caches, feed_B, pos, n):
    model = nnx.merge(graphdef, params, buffers)

    def step(i, carry):
      feed_B, caches, touched = carry
      logits, stats, caches = model(feed_B[:, None], jnp.full((batch, 1), pos + i, jnp.int32),
                                    caches)
      used = sum((s["load_E"] > 0).sum() for s in stats).astype(jnp.int32)
      return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), caches, touched + used

    feed_B, _, touched = jax.lax.fori_loop(0, n, step, (feed_B, caches, jnp.int32(0)))
    return feed_B, touched

  return prefill, loop


def experts_in_compute_dtype(cfg: Config, params):
  """params with the routed experts' weights in model.dtype, as a served model holds them.
  The MoE layer casts float experts to model.dtype at every call, and a cast reads all E
  experts, however few a decode step routes to."""
  from moejax.model.layers import dtype_of
  from moejax.model.moe import FLOAT_EXPERT_NAMES
  dtype = dtype_of(cfg.model.dtype)
  cast = lambda path, var: (var.replace(var.get_value().astype(dtype))
                            if str(path[-1]) in FLOAT_EXPERT_NAMES else var)
  return nnx.from_flat_state({path: cast(path, var) for path, var in nnx.to_flat_state(params)})


def decode_timing(cfg: Config, graphdef, params, buffers, prompt_BP: np.ndarray,
                  steps: tuple[int, int] = DECODE_STEPS, cast_experts: bool = True) -> dict:
  """Greedy decode after prefilling prompt_BP: ms per decode step (one token per sequence)
  as the slope between two loop lengths (compilation and prefill cancel), and the experts
  read per MoE layer per step (distinct over the batch: what the gmm streams).
  cast_experts: time with experts_in_compute_dtype(params)."""
  from moejax.inference.timing import median_seconds, step_seconds
  if cast_experts:
    params = experts_in_compute_dtype(cfg, params)
  B, P = prompt_BP.shape
  few, many = steps
  prefill, loop = _decode_programs(cfg, graphdef, B, P + many + 1)
  feed_B, caches = prefill(params, buffers, jnp.asarray(prompt_BP))
  pos = jnp.int32(P)
  t = [median_seconds(loop, (params, buffers, caches, feed_B, pos, jnp.int32(n)), reps=5)
       for n in (few, many)]
  _, touched = loop(params, buffers, caches, feed_B, pos, jnp.int32(many))
  moe_layers = len(nnx.merge(graphdef, params, buffers).moe_layers)
  step_s, slope_resolved = step_seconds(t[0], t[1], few, many)
  return {"ms_per_token": step_s * 1e3, "ms_per_token_is_upper_bound": not slope_resolved,
          "decode_experts_per_layer": float(touched) / (many * moe_layers)}


# ------------------------------------------------------------------- sweep ---

def run_sweep(run_dir: str | Path, *, top_p: list[float], entropy: list[float],
              max_k: int | None = None, min_k: int = 1, batches: int | None = 8,
              time_decode: bool = False, overrides: list[str] | None = None,
              quiet: bool = False) -> tuple[dict, Path]:
  """Scores the baseline and every threshold; writes RUN_DIR/routing_sweep.json (atomically,
  once all succeeded). Every refusal (no run, dense model, bad thresholds or max_k) comes
  before the weights are loaded. max_k None: the trained K (a top-k model never uses more
  experts than it was trained with)."""
  from moejax.atomic import write_atomic
  from moejax.checkpoint import load_run_config
  from moejax.inference.load import load_trained
  from moejax.model import routing
  from moejax.run_io import load_data
  from moejax.state import abstract_model
  check_thresholds(top_p, entropy)
  if batches is not None and batches < 1:
    raise ValueError(f"--batches {batches}: must be >= 1")
  run_dir = Path(run_dir)
  if not (run_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  base = with_overrides(load_run_config(run_dir), overrides or [])
  if not has_moe(base):
    raise ValueError(f"{run_dir}: the model has no MoE layer, so there is no routing to vary")
  max_k = routing.slots_per_token(base.moe) if max_k is None else max_k
  settings = settings_from(top_p, entropy)
  cfgs = [with_overrides(base, setting_overrides(base, s, max_k, min_k)) for s in settings]

  tm = load_trained(run_dir, overrides)
  data = load_data(tm.cfg, run_dir)
  prompt = min(DECODE_PROMPT, tm.cfg.model.max_seq_len - DECODE_STEPS[1] - 1)
  prompt_BP = np.asarray(data.val[:prompt], np.int32)[None]   # batch 1
  rows = []
  for s, cfg in zip(settings, cfgs):
    graphdef = tm.graphdef if s.threshold is None else abstract_model(cfg)[0]
    row = {"setting": s.label, "mode": s.mode, "threshold": s.threshold,
           "routing": cfg.moe.routing, "overrides": setting_overrides(base, s, max_k, min_k),
           **score(cfg, graphdef, tm.params, tm.buffers, data, batches)}
    row["ppl"], row["bpb"] = row.pop("val_ppl"), row.pop("val_bpb")
    if time_decode:
      row.update(decode_timing(cfg, graphdef, tm.params, tm.buffers, prompt_BP))
    rows.append(row)
    if not quiet:
      print(f"  {s.label}: ppl {row['ppl']:.4f}, {row['experts_per_token']:.3f} experts/token",
            flush=True)
  base_ppl = rows[0]["ppl"]
  for r in rows:
    r["delta_ppl_pct"] = 100.0 * (r["ppl"] / base_ppl - 1.0)
  m = tm.cfg.moe
  result = {"step": tm.step, "overrides": list(overrides or []),
            "trained": {"routing": m.routing, "top_k": m.top_k, "renormalize": m.renormalize,
                        "num_experts": m.num_experts},
            "moe_layers": [i for i in range(tm.cfg.model.num_layers)
                           if is_moe_layer(tm.cfg, i)],
            "max_k": max_k, "min_k": min_k, "val_tokens": rows[0]["val_tokens"],
            "val_batches": batches, "timed": time_decode, "rows": rows}
  path = run_dir / SWEEP_FILE
  write_atomic(path, json.dumps(result, indent=2, allow_nan=False))
  return result, path


def format_table(rows: list[dict]) -> str:
  timed = any("ms_per_token" in r for r in rows)
  header = ["mode", "threshold", "experts/token", "ppl", "Δppl %"]
  header += ["ms/token", "decode experts/layer"] if timed else []
  body = []
  for r in rows:
    line = [r["mode"], "-" if r["threshold"] is None else f"{r['threshold']:g}",
            f"{r['experts_per_token']:.3f}", f"{r['ppl']:.4f}", f"{r['delta_ppl_pct']:+.2f}"]
    if timed:
      bound = "≤" if r.get("ms_per_token_is_upper_bound") else ""   # noise hid the slope
      line += [f"{bound}{r['ms_per_token']:.3f}", f"{r['decode_experts_per_layer']:.2f}"]
    body.append(line)
  widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]
  fmt = lambda x: "  ".join(c.rjust(w) for c, w in zip(x, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(x) for x in body])


def summary_line(result: dict) -> str:
  t = result["trained"]
  return (f"step {result['step']}, trained {t['routing']} k={t['top_k']} of E={t['num_experts']}"
          f" (renormalize {str(t['renormalize']).lower()}); elastic settings use at most "
          f"max_k={result['max_k']} (entropy: at least min_k={result['min_k']}); "
          f"{result['val_tokens']:,} held-out tokens per setting")
