"""The positionals of the commands that read a config: an optional YAML file, then key=value overrides."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser, example: str) -> None:
    """`example`: an override of this command's keys, for its help."""
    p.add_argument("config", nargs="?", help="optional YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=f"config overrides, e.g. {example}")


def split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional containing '=' is an override, not a config file."""
    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    return config, overrides


def with_flags(overrides: list[str], flags: dict[str, str | None]) -> list[str]:
    """`overrides` with each flag given (`--out DIR` as `out=DIR`); a flag whose key an override sets too is
    refused (one of them was dropped silently)."""
    from parity.config import ConfigError

    given = {item.split("=", 1)[0].strip() for item in overrides}
    for key, value in flags.items():
        if value is None:
            continue
        if key in given:
            raise ConfigError(f"--{key} and {key}=: give one")
        overrides = [*overrides, f"{key}={value}"]
    return overrides
