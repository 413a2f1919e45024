"""The objectives' config defaults are the ones docs/objectives.md documents: its table "Config keys and
defaults" read here, every key of every objective compared with its schema."""

import dataclasses
from pathlib import Path

from qarl_cli.config.algorithm import SCHEMAS


def _documented_defaults() -> dict[str, dict]:
    """The table "Config keys and defaults" of docs/objectives.md: {objective: {key: default}}."""
    text = (Path(__file__).parents[1] / "docs" / "objectives.md").read_text()
    lines = text.split("## Config keys and defaults", 1)[1].split("\n## ", 1)[0].splitlines()
    header = [c.strip() for c in lines[2].strip().strip("|").split("|")]
    assert header[2:] == ["tbpo", "gspo", "grpo", "dapo"], header

    def value(cell: str):
        cell = cell.strip().strip("`")
        if cell in ("true", "false"):
            return cell == "true"
        try:
            return float(cell)
        except ValueError:
            return cell

    table: dict[str, dict] = {name: {} for name in header[2:]}
    for line in lines:
        cells = line.strip().strip("|").split("|")
        if line.startswith("| `"):  # a config key (the ratio row, fixed by the name, is not one)
            for name, cell in zip(header[2:], cells[2:]):
                table[name][cells[0].strip().strip("`")] = value(cell)
    return table


def test_defaults_are_the_documented_ones():
    """Every schema default is the value docs/objectives.md gives it, and every key is in that table but
    entropy_coef (0, off, by default; documented in its schema, qarl_cli.config.algorithm)."""
    documented = _documented_defaults()
    assert set(documented) == set(SCHEMAS)
    for name, keys in documented.items():
        cfg = SCHEMAS[name]()
        fields = {f.name for f in dataclasses.fields(cfg)}
        assert set(keys) == fields - {"entropy_coef"}, name
        for key, want in keys.items():
            assert getattr(cfg, key) == want, (name, key, getattr(cfg, key), want)
        assert cfg.entropy_coef == 0.0
