"""Command-line parsing: key=value overrides before or after the options."""
import pytest

from moejax.cli import parse


def test_overrides_after_options_are_kept_in_order():
  args = parse(["bench-decode", "configs/tiny.yaml", "moe.top_k=1", "--layers", "2",
                "model.dtype=float32"])
  assert args.overrides == ["moe.top_k=1", "model.dtype=float32"]
  assert args.layers == 2


def test_unknown_flag_is_still_refused(capsys):
  with pytest.raises(SystemExit):
    parse(["bench-decode", "configs/tiny.yaml", "--no-such-flag"])
  assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
