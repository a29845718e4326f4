"""``python -m kdsweep [overrides]``: one KD job (or ``-m`` for a sweep)."""

from kdsweep.app import main

if __name__ == "__main__":
    main()
