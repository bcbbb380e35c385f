"""``python -m entrenar``: the ``entrenar`` command (see `entrenar.cli`)."""

from entrenar.cli import main

if __name__ == "__main__":
    main()
