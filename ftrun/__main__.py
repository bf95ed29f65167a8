"""`python -m ftrun`: the same entry point as the `ftrun` console script."""

from ftrun.cli.main import console

if __name__ == "__main__":
    console()
