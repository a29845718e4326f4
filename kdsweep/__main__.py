"""``python -m kdsweep [overrides]``: one KD job (``-m`` for a sweep); ``status`` / ``resume`` for sweeps."""

from kdsweep.cli import main

if __name__ == "__main__":
    main()
