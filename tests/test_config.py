import pytest

from moejax.config import ConfigError, is_moe_layer, load_config
from moejax.model.routing import capacity


def test_tiny_loads_and_overrides_apply():
  cfg = load_config("configs/tiny.yaml", ["moe.top_k=1", "train.steps=7", "data.files=a.txt,b.txt"])
  assert cfg.moe.top_k == 1 and cfg.train.steps == 7
  assert cfg.data.files == ("a.txt", "b.txt")


@pytest.mark.parametrize("path", ["configs/mixtral_8x7b.yaml", "configs/olmoe_1b_7b.yaml",
                                  "configs/qwen_moe.yaml", "configs/tiny.yaml"])
def test_shipped_configs_validate(path):
  load_config(path)


@pytest.mark.parametrize("override, message", [
    ("moe.topk=2", "did you mean 'top_k'"),
    ("modle.d_model=3", "did you mean 'model'"),
    ("moe.top_k=9", "top_k=9 exceeds moe.num_experts=8"),
    ("model.num_kv_heads=3", "multiple of model.num_kv_heads=3"),
    ("model.d_model=0", "model.d_model=0: must be positive"),
    ("moe.expert_impl=magic", "must be one of dense, ragged, blocked, gmm"),
    ("moe.routing=top_p moe.top_p=1.5", "moe.top_p=1.5"),
    ("kv_cache.bits=5", "kv_cache.bits=5"),
    ("kv_cache.outlier_fraction=1.0", "outlier_fraction"),
    ("kv_cache.residual_window=40", "multiple of kv_cache.group_size=32"),
    ("kv_cache.group_size=24", "power of two"),
    ("kv_cache.layer_bits=4,5,4,4", "layer_bits.1.=5"),
    ("model.head_dim=33", "head_dim=33 must be even"),
    ("train.steps=abc", "expected an integer"),
    ("mesh.expert=3", "mesh.expert=3 does not divide moe.num_experts=8"),
    ("mesh.exchange=nccl", "mesh.exchange='nccl': must be one of auto, ragged, padded"),
    ("inference.expert_bits=3", "inference.expert_bits=3: must be one of 16 (float), 8 or 4"),
    ("inference.expert_bits=8 inference.expert_group_size=-1", "expert_group_size=-1: must be >= 0"),
    ("inference.expert_bits=4", "expert_group_size=128 must divide model.d_model/2=64"),
    ("inference.expert_bits=8 inference.expert_group_size=64 moe.expert_hidden=96",
     "expert_group_size=64 must divide moe.expert_hidden=96"),
    ("inference.expert_bits=4 inference.expert_group_size=0 moe.expert_hidden=191",
     "moe.expert_hidden=191 must be even"),
])
def test_bad_settings_name_the_problem(override, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    load_config("configs/tiny.yaml", override.split())


def test_quantized_expert_settings_that_fit_validate():
  cfg = load_config("configs/tiny.yaml", ["inference.expert_bits=4", "inference.expert_group_size=32"])
  assert (cfg.inference.expert_bits, cfg.inference.expert_group_size) == (4, 32)
  assert load_config("configs/tiny.yaml", ["inference.expert_group_size=7"])   # 16 bits: unused
  load_config("configs/mixtral_8x7b.yaml", ["inference.expert_bits=4"])       # group 128


def test_missing_file_is_a_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="config file not found"):
    load_config(tmp_path / "nope.yaml")


def test_moe_layer_placement_and_capacity():
  cfg = load_config(None, ["moe.first_dense_layers=1", "moe.moe_every=2", "model.num_layers=6"])
  assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, True, False, True]
  assert capacity(100, 2, 8, 1.0) == 25
  assert capacity(100, 2, 8, 0.0) == 100  # dropless


def test_ep_exchange_is_a_config_field_not_an_environment_variable(monkeypatch):
  from moejax.parallel import expert_parallel, resolve_exchange
  assert load_config("configs/tiny.yaml").mesh.exchange == "auto"
  assert load_config("configs/tiny.yaml", ["mesh.exchange=padded"]).mesh.exchange == "padded"
  monkeypatch.setenv("MOEJAX_EP_EXCHANGE", "ragged")   # no longer read
  assert resolve_exchange("auto") == "padded"          # CPU: no ragged all-to-all
  assert resolve_exchange("ragged") == "ragged"
  with pytest.raises(ValueError, match="unknown exchange 'nccl'"):
    resolve_exchange("nccl")
  assert expert_parallel(None, "ragged") is None       # one device: the plain layer


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
  from moejax import cli
  bad = tmp_path / "bad.yaml"
  bad.write_text("model:\n  d_model: 64\n  num_layers: [1\ntrain: {}\n")
  with pytest.raises(ConfigError, match=rf"^{bad}:4:6: invalid YAML: while parsing a flow "
                                        "sequence expected ',' or ']'"):
    load_config(bad)
  assert cli.main(["train", str(bad)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and str(bad) in err and "<unicode string>" not in err
  with pytest.raises(ConfigError, match=r"override 'train.steps=\[1': the value is not valid"):
    load_config(None, ["train.steps=[1"])
