"""PNG plots of a run: loss curves and the expert-load heatmap."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_losses(train: list[tuple[int, float]], val: list[tuple[int, float]], path: Path) -> Path:
  fig, ax = plt.subplots(figsize=(6, 4))
  if train:
    ax.plot(*zip(*train), label="train (LM loss)")
  if val:
    ax.plot(*zip(*val), "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_expert_load(load_LE: np.ndarray, layers: list[int], path: Path) -> Path:
  """load_LE: share of routed assignments per (MoE layer, expert); rows sum to 1."""
  load_LE = np.asarray(load_LE)
  fig, ax = plt.subplots(figsize=(1.2 + 0.45 * load_LE.shape[1], 1.2 + 0.45 * load_LE.shape[0]))
  im = ax.imshow(load_LE, cmap="viridis", aspect="auto")
  ax.set_xlabel("expert")
  ax.set_ylabel("layer")
  ax.set_yticks(range(len(layers)), [str(l) for l in layers])
  ax.set_title(f"expert load (uniform = {1 / load_LE.shape[1]:.3f})")
  fig.colorbar(im, ax=ax, fraction=0.05)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
