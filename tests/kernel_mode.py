"""How kernel tests run: in Pallas interpret mode (CI, CPU) unless FLINT_PALLAS_COMPILED=1, which runs the same cases
compiled on a GPU (the device scripts set it)."""
import os

INTERPRET = os.environ.get("FLINT_PALLAS_COMPILED", "") != "1"
