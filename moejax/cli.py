"""Command line: moejax train | eval | generate | calibrate | eval-ppl | quantize | import |
bench-decode | train-predictor | eval-prefetch  (see `moejax -h`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moejax.checkpoint import CheckpointMismatchError
from moejax.config import ConfigError


def _cmd_train(args) -> int:
  from moejax.config import load_config
  from moejax.train import train
  cfg = load_config(args.config, args.overrides)
  summary = train(cfg)
  print(json.dumps({k: v for k, v in summary.items() if k != "plots"}, indent=2))
  print("plots:", *summary["plots"], sep="\n  ")
  return 0


def _cmd_eval(args) -> int:
  import jax
  from moejax.evaluate import evaluate
  from moejax.inference.load import load_trained
  from moejax.run_io import load_data
  from moejax.state import make_eval_step
  tm = load_trained(args.run_dir, args.overrides)
  data = load_data(tm.cfg, Path(args.run_dir))
  d = tm.cfg.data
  result = evaluate(jax.jit(make_eval_step(tm.cfg, tm.graphdef)), tm.params, tm.buffers, data,
                    d.batch_size, d.seq_len, args.max_batches)
  print(json.dumps({"step": tm.step, **result}, indent=2))
  return 0


def _cmd_generate(args) -> int:
  import numpy as np
  from moejax.checkpoint import load_run_config
  from moejax.config import with_overrides
  from moejax.inference import (Engine, OffloadEngine, SamplingConfig, cache_nbytes,
                                dense_caches, end_token_ids, load_trained)
  from moejax.inference.offload_engine import check_offload, offload_host_sharding
  from moejax.kv_eval import KVSetting, load_calibration, quantized_cache_factory
  if args.kv_bits not in (2, 3, 4, 8, 16):
    raise ValueError(f"--kv-bits {args.kv_bits}: must be one of 2, 3, 4, 8, 16")
  sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)  # bad values: before loading
  run_dir = Path(args.run_dir)
  offload = False
  if (run_dir / "checkpoints").is_dir():   # else load_trained says what is missing
    cfg = with_overrides(load_run_config(run_dir), args.overrides)
    # inference.offload's budget (against one expert's size) and predictor file: before loading
    offload = check_offload(cfg, run_dir) is not None
  # Offloaded experts are restored straight into host memory: they need not fit in HBM.
  tm = load_trained(run_dir, args.overrides,
                    expert_sharding=offload_host_sharding(cfg) if offload else None)
  factory = dense_caches
  if args.kv_bits != 16:
    factory = quantized_cache_factory(KVSetting(args.kv_bits, args.kv_outliers),
                                      load_calibration(run_dir))
  engine = (OffloadEngine.from_trained(tm, factory, run_dir=run_dir) if offload
            else Engine.from_trained(tm, factory))
  ids = tm.tokenizer.encode(args.prompt)
  (new_ids,), caches = engine.generate(
      [ids], args.max_new_tokens, sampling=sampling, stop_tokens=end_token_ids(tm.tokenizer),
      seed=args.seed)
  print(tm.tokenizer.decode(np.concatenate([ids, np.asarray(new_ids, np.int32)])))
  kind = "bf16" if args.kv_bits == 16 else f"{args.kv_bits}-bit + {args.kv_outliers:.0%} fp16 channels"
  capacity = len(ids) + args.max_new_tokens
  print(f"\n[kv cache ({kind}), {capacity} tokens capacity: {cache_nbytes(caches):,} bytes]",
        file=sys.stderr)
  if offload:
    print(engine.stats_line(), file=sys.stderr)
  return 0


def _cmd_calibrate(args) -> int:
  from moejax.inference.load import load_trained
  from moejax.kv_eval import calibrate, save_calibration
  from moejax.run_io import load_data
  tm = load_trained(args.run_dir, args.overrides)
  ranks = calibrate(tm, load_data(tm.cfg, Path(args.run_dir)), args.batches)
  print(f"outlier-channel ranking saved to {save_calibration(Path(args.run_dir), ranks, tm.step)}")
  return 0


def _cmd_eval_ppl(args) -> int:
  from moejax.kv_eval import format_table, run_sweep, settings_from
  for b in args.kv:
    if b not in (2, 3, 4, 8, 16):
      raise ValueError(f"--kv {b}: bits must be among 2, 3, 4, 8, 16")
  for f in args.outliers:
    if not 0 <= f < 1:
      raise ValueError(f"--outliers {f}: outlier fraction must be in [0, 1)")
  rows, paths = run_sweep(Path(args.run_dir), settings_from(args.kv, args.outliers),
                          max_batches=args.max_batches, overrides=args.overrides)
  print(format_table(rows))
  print(f"\neach setting scored on {rows[0]['val_tokens']:,} validation tokens "
        f"({rows[0]['val_batches']} batches)")
  print(f"\n{paths['json']}\n{paths['plot']}")
  return 0


def _cmd_quantize(args) -> int:
  from moejax.inference.quantize import quantize_run
  summary = quantize_run(args.run_dir, args.out_dir, args.expert_bits, args.group_size)
  print(json.dumps(summary, indent=2))
  return 0


def _cmd_import(args) -> int:
  from moejax.convert.hf import import_model
  summary = import_model(args.src, args.out_dir, dtype=args.dtype, expert_bits=args.expert_bits,
                         group_size=args.group_size)
  print(json.dumps(summary, indent=2))
  return 0


def _cmd_bench_decode(args) -> int:
  from moejax.inference import bench_decode
  result = bench_decode.run_cli(args.config_or_run, args.overrides, batches=args.batch,
                                contexts=args.context, expert_bits=args.expert_bits,
                                kv_bits=args.kv_bits, layers=args.layers,
                                peer_layers=args.peer_layers, steps=args.steps,
                                prompt=args.prompt, smoke=args.smoke, out=args.out)
  return 0 if all("error" not in r for r in result["rows"]) else 1


def _int_list(text: str) -> list[int]:
  """argparse type: comma-separated positive integers, e.g. 1,8,64."""
  try:
    values = [int(v) for v in text.split(",") if v]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
  return values


def _int_at_least(low: int):
  """argparse type: an integer >= low, else a one-line error naming the range."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"{value}: must be >= {low}")
    return value
  return parse


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="moejax", description="Mixture-of-Experts LMs in JAX/Pallas")
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="train from a YAML config (resumes if checkpoints exist)")
  t.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
  t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=100")
  t.set_defaults(fn=_cmd_train)

  e = sub.add_parser("eval", help="validation loss / perplexity / bits per byte of a run")
  e.add_argument("run_dir", help="the train.out_dir of a run")
  e.add_argument("overrides", nargs="*", help="e.g. moe.expert_impl=dense")
  e.add_argument("--max-batches", type=_int_at_least(1), default=None,
                 help="batches spread over the split (default: the whole split)")
  e.set_defaults(fn=_cmd_eval)

  g = sub.add_parser("generate", help="sample text from a run with a KV cache")
  g.add_argument("run_dir")
  g.add_argument("overrides", nargs="*", help="e.g. kv_cache.group_size=16, "
                                               "inference.offload.hbm_expert_slots=8 (experts "
                                               "in host memory, 8 in HBM)")
  g.add_argument("--prompt", required=True)
  g.add_argument("--max-new-tokens", type=_int_at_least(1), default=200)
  g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  g.add_argument("--top-k", type=_int_at_least(0), default=40, help="0: no top-k cut")
  g.add_argument("--top-p", type=float, default=1.0,
                 help="nucleus: sample from the most likely tokens holding this much "
                      "probability (1: no cut)")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--kv-bits", type=int, default=16, help="16 (bf16) or 2/3/4/8 (quantized cache)")
  g.add_argument("--kv-outliers", type=float, default=0.0,
                 help="fraction of channels per kv-head kept in 16 bits")
  g.set_defaults(fn=_cmd_generate)

  c = sub.add_parser("calibrate", help="pick each layer/kv-head's KV outlier channels")
  c.add_argument("run_dir")
  c.add_argument("overrides", nargs="*")
  c.add_argument("--batches", type=_int_at_least(1), default=4)
  c.set_defaults(fn=_cmd_calibrate)

  q = sub.add_parser("eval-ppl", help="perplexity and memory under KV-cache quantization")
  q.add_argument("run_dir")
  q.add_argument("overrides", nargs="*", help="e.g. kv_cache.residual_window=64")
  q.add_argument("--kv", type=int, nargs="+", default=[16, 4, 3, 2])
  q.add_argument("--outliers", type=float, nargs="+", default=[0.0, 0.01, 0.15])
  q.add_argument("--max-batches", type=_int_at_least(1), default=8)
  q.set_defaults(fn=_cmd_eval_ppl)

  z = sub.add_parser("quantize", help="a new run directory with int8 / int4 expert weights "
                                      "(for eval and generate)")
  z.add_argument("run_dir", help="a trained run (its latest checkpoint)")
  z.add_argument("out_dir", help="the quantized run to write: new or empty")
  z.add_argument("--expert-bits", type=int, required=True, help="8 or 4")
  z.add_argument("--group-size", type=int, default=128,
                 help="rows of the contraction dim per scale; 0: one scale per output channel")
  z.set_defaults(fn=_cmd_quantize)

  i = sub.add_parser("import", help="a Hugging Face model folder or .gguf file as a run "
                                    "directory (for eval, generate, ...)")
  i.add_argument("src", help="an HF folder (config.json, *.safetensors, tokenizer.json) or "
                             "a .gguf file")
  i.add_argument("out_dir", help="the run to write: new or empty")
  i.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="parameter and compute dtype of the run")
  i.add_argument("--expert-bits", type=int, choices=(16, 8, 4), default=16,
                 help="8 | 4: quantize the routed experts as `moejax quantize` does")
  i.add_argument("--group-size", type=int, default=128,
                 help="with --expert-bits 8|4: rows per scale; 0: one per output channel")
  i.set_defaults(fn=_cmd_import)

  d = sub.add_parser("bench-decode", help="decode speed (ms/token, TB/s) of a config's shape "
                                          "or a run, against the plain XLA path")
  d.add_argument("config_or_run", help="a YAML config (random weights) or a run directory")
  d.add_argument("overrides", nargs="*", help="e.g. kv_cache.outlier_fraction=0.02")
  d.add_argument("--batch", type=_int_list, default=[1])
  d.add_argument("--context", type=_int_list, default=[4096])
  d.add_argument("--expert-bits", type=_int_list, default=None,
                 help="16,8,4 (default: the config's inference.expert_bits)")
  d.add_argument("--kv-bits", type=_int_list, default=[16, 2])
  d.add_argument("--layers", type=_int_at_least(1), default=None,
                 help="override model.num_layers (default: the config's)")
  d.add_argument("--peer-layers", type=_int_at_least(0), default=None,
                 help="layers of the XLA peer (bf16 weights may not fit whole); 0: no peer")
  d.add_argument("--steps", type=_int_list, default=[8, 40],
                 help="two decode-loop lengths; ms/token is the slope between them")
  d.add_argument("--prompt", type=_int_at_least(1), default=128, help="prompt tokens for TTFT")
  d.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
  d.add_argument("--out", default="bench_decode.json", help="JSON results")
  d.set_defaults(fn=_cmd_bench_decode)
  _add_prefetch_commands(sub)
  _add_elastic_routing_command(sub)
  return p


# ------------------------------------------- expert prefetch (issue 36) ---

def _cmd_train_predictor(args) -> int:
  from moejax.inference.eval_prefetch import train_predictor_run
  meta, path = train_predictor_run(args.run_dir, args.lookahead, args.tokens, args.ridge,
                                   args.overrides)
  print(f"learned prefetch predictor (step {meta['step']}, lookahead "
        f"{' '.join(map(str, meta['lookahead']))}, {meta['train_tokens']:,} training tokens) "
        f"saved to {path}")
  return 0


def _cmd_eval_prefetch(args) -> int:
  from moejax.inference.eval_prefetch import eval_prefetch_run, format_table
  result, paths = eval_prefetch_run(args.run_dir, args.lookahead, args.tokens, args.overrides)
  print(format_table(result["rows"]))
  print(f"\nrecall of the used experts when the top m are fetched, step {result['step']}, "
        f"{result['val_tokens']:,} held-out tokens (k={result['top_k']}, "
        f"E={result['num_experts']}; predictor trained on {result['train_tokens']:,})")
  print(f"\n{paths['json']}\n{paths['plot']}")
  return 0


def _add_prefetch_commands(sub) -> None:
  from moejax.inference.eval_prefetch import DEFAULT_TOKENS
  from moejax.inference.prefetch import DEFAULT_RIDGE
  look = dict(type=int, nargs="+", default=None,
              help="layers ahead to predict (default: those of 1 2 3 the model has)")
  tp = sub.add_parser("train-predictor", help="fit the learned expert-prefetch predictor on "
                                              "training text (RUN_DIR/predictor.npz)")
  tp.add_argument("run_dir")
  tp.add_argument("overrides", nargs="*")
  tp.add_argument("--lookahead", **look)
  tp.add_argument("--tokens", type=_int_at_least(1), default=DEFAULT_TOKENS,
                  help="training tokens to trace")
  tp.add_argument("--ridge", type=float, default=DEFAULT_RIDGE)
  tp.set_defaults(fn=_cmd_train_predictor)
  ev = sub.add_parser("eval-prefetch", help="recall of expert-prefetch predictors on held-out "
                                            "text (prefetch.json, prefetch.png)")
  ev.add_argument("run_dir")
  ev.add_argument("overrides", nargs="*")
  ev.add_argument("--lookahead", **look)
  ev.add_argument("--tokens", type=_int_at_least(1), default=DEFAULT_TOKENS,
                  help="held-out tokens to trace (and training tokens, if no predictor yet)")
  ev.set_defaults(fn=_cmd_eval_prefetch)


# ----------------------------------------- elastic routing (issue 36) ---

def _cmd_eval_routing(args) -> int:
  from moejax.inference.elastic import format_table, run_sweep, summary_line
  result, path = run_sweep(args.run_dir, top_p=args.top_p, entropy=args.entropy,
                           max_k=args.max_k, min_k=args.min_k, batches=args.batches,
                           time_decode=args.time, overrides=args.overrides)
  print(format_table(result["rows"]))
  print(f"\n{summary_line(result)}\n\n{path}")
  return 0


def _add_elastic_routing_command(sub) -> None:
  from moejax.inference.elastic import DEFAULT_ENTROPY, DEFAULT_TOP_P
  r = sub.add_parser("eval-routing", help="perplexity and experts per token of a top-k run "
                                          "decoded with top-p / entropy routing "
                                          "(RUN_DIR/routing_sweep.json)")
  r.add_argument("run_dir")
  r.add_argument("overrides", nargs="*", help="e.g. moe.expert_impl=gmm")
  r.add_argument("--top-p", type=float, nargs="*", default=list(DEFAULT_TOP_P),
                 help="cumulative router probabilities (none: no top-p rows)")
  r.add_argument("--entropy", type=float, nargs="*", default=list(DEFAULT_ENTROPY),
                 help="normalized router entropy thresholds in [0, 1) (none: no entropy rows)")
  r.add_argument("--max-k", type=_int_at_least(1), default=None,
                 help="experts per token at most (default: the trained top_k)")
  r.add_argument("--min-k", type=_int_at_least(1), default=1,
                 help="entropy routing: experts of a confident token")
  r.add_argument("--batches", type=_int_at_least(1), default=8,
                 help="validation batches per setting, spread over the split")
  r.add_argument("--time", action="store_true",
                 help="also time greedy decode (batch 1): ms/token, experts read per layer")
  r.set_defaults(fn=_cmd_eval_routing)


def guarded(command: str, fn, *args) -> int:
  """fn(*args) with the errors a user can fix turned into one line on stderr and exit 2."""
  try:
    return fn(*args)
  except (ConfigError, CheckpointMismatchError, FileNotFoundError, ValueError) as err:
    print(f"{command}: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
  except RuntimeError as err:  # e.g. NonFiniteLossError
    print(f"{command}: {err}", file=sys.stderr)
    return 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line; `key=value` overrides may also come after the options (argparse
  alone takes positionals only before them once the first ones are consumed)."""
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  late = [a for a in rest if "=" in a and not a.startswith("-")]
  if late and isinstance(getattr(args, "overrides", None), list):
    args.overrides += late
    rest = [a for a in rest if a not in late]
  if rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse(argv)
  return guarded(f"moejax {args.command}", args.fn, args)


if __name__ == "__main__":
  sys.exit(main())
