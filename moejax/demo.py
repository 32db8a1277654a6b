"""`make demo`: train configs/tiny.yaml on the built-in corpus, evaluate it, sample from it,
and sweep KV-cache quantization settings. Prints tables; plots go to the run directory."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moejax.config import load_config


def _table(rows: list[list[str]], header: list[str]) -> str:
  widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
  line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  from moejax.cli import guarded
  return guarded("demo", _demo, args)


def _demo(args) -> int:
  cfg = load_config(args.config, args.overrides)
  run_dir = Path(cfg.train.out_dir)

  from moejax.train import train
  t0 = time.perf_counter()
  summary = train(cfg)
  print(f"\n{summary['step']} steps ({time.perf_counter() - t0:.0f} s this run; "
        f"{summary['params']:,} parameters, {summary['active_params']:,} active per token)\n")
  # .get: a summary.json written by an older moejax may lack some of these.
  fmt = lambda key, spec: "n/a" if summary.get(key) is None else format(summary[key], spec)
  print(_table([[summary["step"], fmt("train_loss", ".4f"), fmt("val_loss", ".4f"),
                 fmt("val_ppl", ".3f"), fmt("val_bpb", ".4f"), fmt("val_tokens", ",")]],
               ["step", "train loss", "val loss", "val ppl", "val bits/byte", "val tokens"]))

  from moejax.inference import Engine, SamplingConfig, cache_nbytes, load_trained
  tm = load_trained(run_dir)
  prompt = "ROMEO:\n"
  ids = list(tm.tokenizer.encode(prompt))
  (new_ids,), caches = Engine.from_trained(tm).generate(
      [ids], 160, sampling=SamplingConfig(temperature=0.8, top_k=40))
  print(f"\nsample (bf16 KV cache, {cache_nbytes(caches):,} bytes):\n"
        f"{tm.tokenizer.decode(ids + new_ids)}\n")

  from moejax.kv_eval import demo_sweep
  demo_sweep(run_dir)
  print("plots:", *summary["plots"], sep="\n  ")
  return 0


if __name__ == "__main__":
  sys.exit(main())
