"""The `sluice` command."""


def main() -> None:
    raise SystemExit("sluice: not built yet")
