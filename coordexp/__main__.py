"""`python -m coordexp ...` is the `coordexp` console script."""

from coordexp.cli.app import main

if __name__ == "__main__":
    main()
