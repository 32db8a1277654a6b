import os

# Tests run on the CPU; keep XLA from grabbing every core of a small CI machine twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
