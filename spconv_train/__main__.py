"""``python -m spconv_train ...`` (also what ``torchrun -m spconv_train`` runs on every rank)."""

from spconv_train.cli import main

if __name__ == "__main__":
    main()
