"""The error every part's command line raises for bad usage; `fleetheal.cli` prints it and exits 2."""


class UsageError(Exception):
    """Bad command-line usage: printed as `fleetheal: error: ...`, exit 2."""
