"""inference.offload (issue 36): the config section's validation, the byte budget's slots, the
checkpoint comparison ignoring it, and `moejax generate` with offload on a tiny trained run:
the same text as the in-memory engine, and the offload statistics on stderr."""
import contextlib
import io
import re

import pytest

import _tiny_run as tiny_run

from moejax import cli
from moejax import inference
from moejax.checkpoint import config_mismatches
from moejax.config import ConfigError, load_config
from moejax.inference.load import decode_layout
from moejax.inference.offload import OffloadModel, expert_bytes_of
from moejax.inference.offload_engine import offload_slots
from moejax.state import build_model, split_model

SMALL = tiny_run.small(layers=4, steps=4, max_seq_len=64)   # layer 0 dense, 3 x 4 experts
EXPERT_BYTES = 3 * 32 * 32 * 4                                # d_model x expert_hidden, fp32
OFF = "inference.offload."


def _cfg(*overrides):
  return load_config("configs/tiny.yaml", SMALL + list(overrides))


# ------------------------------------------------------------- validation ---

@pytest.mark.parametrize("overrides, match", [
    ([OFF + "hbm_slots=4"], r"unknown config key 'inference.offload.hbm_slots' \(did you mean "
                            r"'hbm_expert_slots'\?\)"),
    ([OFF + "policy=fifo"], "inference.offload.policy='fifo': must be one of lru, lfu, "
                            "predictive"),
    ([OFF + "hbm_expert_slots=4", OFF + "hbm_budget_bytes=1e6"],
     r"set one of hbm_expert_slots \(4\) and hbm_budget_bytes \(1000000\), not both"),
    ([OFF + "hbm_expert_slots=-1"], "hbm_expert_slots=-1: must be >= 0"),
    ([OFF + "hbm_expert_slots=13"], r"more than the 12 experts \(3 MoE layers x 4\)"),
    ([OFF + "hbm_expert_slots=two"], "inference.offload.hbm_expert_slots: expected an integer"),
    ([OFF + "policy=predictive", OFF + "lookahead=4"], r"lookahead=4: must be in \[1, 3\]"),
    ([OFF + "prefetch_width=5"], "prefetch_width=5 exceeds moe.num_experts=4"),
    ([OFF + "predictor=learned"], "only policy predictive prefetches"),
    ([OFF + "predictor=oracle"], "predictor='oracle': must be one of gate, learned"),
    ([OFF + "host_memory=device"], "must be one of auto, pinned_host, unpinned_host, numpy"),
    ([OFF + "transfer=in_jit", OFF + "host_memory=numpy"], "transfer=in_jit reads a host "
                                                           "memory kind"),
    ([OFF + "hbm_expert_slots=2", "moe.first_dense_layers=4"], "no MoE layer"),
])
def test_bad_offload_settings_are_named(overrides, match):
  with pytest.raises(ConfigError, match=match):
    _cfg(*overrides)


def test_offload_is_off_by_default_and_on_with_either_size():
  assert not _cfg().inference.offload.enabled
  assert _cfg(OFF + "hbm_expert_slots=3").inference.offload.enabled
  assert _cfg(OFF + "hbm_budget_bytes=1e6").inference.offload.hbm_budget_bytes == 10 ** 6
  assert offload_slots(_cfg()) is None and offload_slots(_cfg(OFF + "hbm_expert_slots=3")) == 3


def test_budget_bytes_convert_to_whole_slots():
  assert expert_bytes_of(_cfg()) == EXPERT_BYTES
  budget = lambda b: offload_slots(_cfg(OFF + f"hbm_budget_bytes={b}"))
  assert budget(3 * EXPERT_BYTES + EXPERT_BYTES // 2) == 3
  assert budget(EXPERT_BYTES) == 1
  assert budget(10 ** 9) == 12                                 # a ceiling: every expert
  with pytest.raises(ConfigError, match=r"hbm_budget_bytes=12,287 holds no expert: one expert "
                                        r"\(d_model 32 x expert_hidden 32, float32\) is "
                                        r"12,288 bytes"):
    budget(EXPERT_BYTES - 1)


@pytest.mark.parametrize("overrides", [
    (), ("model.dtype=bfloat16",),                             # decode layout: bf16 experts
    ("inference.expert_bits=8", "inference.expert_group_size=16"),
    ("inference.expert_bits=4", "inference.expert_group_size=8"),
], ids=["fp32", "bf16-compute", "int8", "int4"])
def test_expert_bytes_from_shapes_match_the_offload_model(overrides):
  cfg = _cfg(*overrides)
  om = OffloadModel.from_split(cfg, *decode_layout(*split_model(build_model(cfg, 0))))
  assert expert_bytes_of(cfg) == om.expert_bytes


def test_checkpoints_ignore_the_offload_section():
  cfg = _cfg(OFF + "hbm_expert_slots=4", OFF + "policy=predictive")
  saved = _cfg().to_dict()
  assert config_mismatches(saved, cfg) == []
  old = {**saved, "inference": {k: v for k, v in saved["inference"].items() if k != "offload"}}
  assert config_mismatches(old, cfg) == []                     # written before the section


# ---------------------------------------------------------- moejax generate ---

GREEDY, SAMPLED = ("--temperature", "0"), ("--temperature", "1", "--top-k", "0")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return tiny_run.make_runs(tmp_path_factory.mktemp("offload"), SMALL) / "run"


def _generate(run, *args) -> tuple[str, str]:
  """`moejax generate` (one prompt: one set of shapes to compile) -> (stdout, stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(["generate", str(run), *args, "--prompt", "to be or", "--max-new-tokens",
                     "10", "--seed", "3"])
  assert code == 0, err.getvalue()
  return out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plain(run):
  """The in-memory engine's text, greedy and sampled."""
  return {s: _generate(run, *s)[0] for s in (GREEDY, SAMPLED)}


def _offload_line(err: str) -> str:
  return next(x for x in err.splitlines() if x.startswith("[expert offload"))


# 2 slots everywhere (each layer runs in passes; the programs on the pool compile once);
# predictive: test_generate_with_the_learned_predictor (the gate: test_offload.py).
@pytest.mark.parametrize("sampling, setting", [
    (GREEDY, [OFF + "hbm_expert_slots=2"]),
    (SAMPLED, [OFF + f"hbm_budget_bytes={2 * EXPERT_BYTES + 100}", OFF + "policy=lfu"]),
], ids=["greedy-lru-slots", "sampled-lfu-budget"])
def test_generate_with_offload_gives_the_same_text(run, plain, sampling, setting):
  out, err = _generate(run, *setting, *sampling)
  assert out == plain[sampling] and len(set(plain[SAMPLED])) > 6   # sampled: not degenerate
  assert "[kv cache (bf16)" in err
  line = _offload_line(err)
  assert "2 of 12 experts in HBM, 12,288 bytes each" in line
  assert "decode hit rate" in line and "bytes host->device per token" in line
  assert "prefetched" not in line


def test_generate_with_the_learned_predictor(run, plain, tmp_path, capsys):
  run = tiny_run.private_copy(run.parent, tmp_path)
  args = [OFF + "hbm_expert_slots=2", OFF + "policy=predictive", OFF + "predictor=learned",
          OFF + "lookahead=2", *GREEDY]
  assert cli.main(["generate", str(run), *args, "--prompt", "to"]) == 2   # not fit yet
  assert f"moejax train-predictor {run} --lookahead 1 2" in capsys.readouterr().err
  assert cli.main(["train-predictor", str(run), "--lookahead", "1", "2", "--tokens", "64"]) == 0
  out, err = _generate(run, *args)
  assert out == plain[GREEDY]
  assert int(re.search(r"(\d+) prefetched", _offload_line(err)).group(1)) > 0


def test_bad_offload_budget_is_refused_before_loading(run, capsys, monkeypatch):
  def no_loading(*_):
    raise AssertionError("the checkpoint was read")
  monkeypatch.setattr(inference, "load_trained", no_loading)
  assert cli.main(["generate", str(run), OFF + "hbm_budget_bytes=1000", "--prompt", "to"]) == 2
  err = capsys.readouterr().err
  assert "hbm_budget_bytes=1,000 holds no expert" in err and "12,288 bytes" in err
  assert cli.main(["generate", str(run), OFF + "hbm_expert_slots=2", OFF + "policy=predictive",
                   OFF + "predictor=learned", "--prompt", "to"]) == 2
  assert "no learned predictor" in capsys.readouterr().err


def test_offloaded_experts_are_restored_into_host_memory(run):
  """generate with offload restores the routed experts straight into pinned host memory
  (a model whose experts exceed HBM loads); the other weights stay on the device."""
  import jax
  from moejax.inference.load import is_expert_path, load_trained
  from moejax.inference.offload import host_placement
  tm = load_trained(run, expert_sharding=host_placement("pinned_host"))
  kinds = {True: set(), False: set()}
  for p, x in jax.tree_util.tree_leaves_with_path(tm.params):
    kinds[is_expert_path(p)].add(x.sharding.memory_kind)
  assert kinds == {True: {"pinned_host"}, False: {"device"}}
  # The decode layout leaves host-resident experts as stored (no eager cast to the device).
  _, params, _ = decode_layout(tm.graphdef, tm.params, tm.buffers)
  assert {x.sharding.memory_kind for p, x in jax.tree_util.tree_leaves_with_path(params)
          if is_expert_path(p)} == {"pinned_host"}
