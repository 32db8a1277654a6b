"""experiments/mosaic_module_sweep.py: the refactor check's comparison of two sweeps."""
import random
import string

from experiments.mosaic_module_sweep import OPTION_SETS, differing


def test_differing_names_changed_missing_and_added_combinations():
  rng = random.Random()
  keys = ["".join(rng.choices(string.ascii_letters, k=12)) for _ in range(20)]
  old = {k: "".join(rng.choices("0123456789abcdef", k=40)) for k in keys}
  assert differing(old, dict(old)) == []
  new = dict(old)
  changed, dropped = keys[3], keys[7]
  new[changed] = "ERR ValueError: now raises"
  del new[dropped]
  new["added"] = "0" * 40
  assert differing(old, new) == sorted([changed, dropped, "added"])


def test_option_sets_include_the_default_and_are_distinct():
  assert {} in OPTION_SETS
  assert len({tuple(sorted(kw.items())) for kw in OPTION_SETS}) == len(OPTION_SETS)
