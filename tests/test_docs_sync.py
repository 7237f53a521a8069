"""The reference pages and the code in step (issue 51 item 6): every config key is in docs/config.md and
every key there exists; every CLI command and option is in docs/cli.md and every command there exists."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE, CLI_PAGE = ROOT / "docs" / "config.md", ROOT / "docs" / "cli.md"


def config_keys() -> set[str]:
    """Every dotted key of a run config (a list of dataclasses, link.groups, counts as its fields)."""
    from engine.config.schema import RunConfig

    def walk(cls: type, prefix: str) -> set[str]:
        keys: set[str] = set()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name.rstrip("_")  # batch.global_ is `batch.global` in YAML
            inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                keys |= walk(tp, key + ".")
            elif inner:
                keys |= walk(inner[0], key + ".")
            else:
                keys.add(key)
        return keys

    return walk(RunConfig, "")


def documented_keys(text: str) -> set[str]:
    """The keys the config table's first column names: "`cluster.sbatch` / `setup`" is two keys."""
    keys: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([A-Za-z_][\w.]*)`", line.split("|")[1])
        section = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        keys |= {names[0]} | {n if "." in n else section + n for n in names[1:]}
    return keys


def cli_commands() -> dict[str, set[str]]:
    """Each command of `workbench` with its options, each by all its forms ('-o/--output', '--check/--no-check';
    --help left out), and the app's own options under ''."""
    import typer

    from workbench import cli

    cli._register()
    group = typer.main.get_command(cli.app)

    def names(params) -> set[str]:
        return {"/".join((*p.opts, *p.secondary_opts)) for p in params
                if any(o.startswith("-") for o in p.opts) and "--help" not in p.opts}

    return {"": names(group.params), **{name: names(c.params) for name, c in group.commands.items()}}


def documented_commands(text: str) -> dict[str, str]:
    """The CLI page's text about each command: its table rows (`workbench NAME ...`)."""
    rows: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\| `workbench (?:--[\w-]+ \S+ )*([a-z]+)\b", line)
        if m:
            rows[m.group(1)] = rows.get(m.group(1), "") + line
    return rows


def missing_options(commands: dict[str, set[str]], text: str) -> dict[str, set[str]]:
    """Options named nowhere in their command's rows (a flag pair counts when either form is named)."""
    rows = {**documented_commands(text), "": text}

    def named(option: str, where: str) -> bool:
        return any(re.search(r"(?<![\w-])" + re.escape(form) + r"(?![\w-])", where) for form in option.split("/"))

    out = {name: {o for o in opts if not named(o, rows.get(name, ""))} for name, opts in commands.items()}
    return {k: v for k, v in out.items() if v}


def test_every_config_key_is_documented_and_every_documented_key_exists():
    keys, documented = config_keys(), documented_keys(CONFIG_PAGE.read_text())
    assert sorted(keys - documented) == [], "keys without a row in docs/config.md"
    assert sorted(documented - keys) == [], "rows of docs/config.md naming no config key"


def test_the_key_check_fails_for_a_key_added_without_docs():
    """Planted: a key the page does not name is reported, and so is a row naming no key."""
    documented = documented_keys(CONFIG_PAGE.read_text())
    assert (config_keys() | {"train.new_knob"}) - documented == {"train.new_knob"}
    assert documented_keys("| `train.steps` / `gone` | 1 | x |") == {"train.steps", "train.gone"}


def test_every_cli_command_and_option_is_documented_and_every_documented_command_exists():
    commands, text = cli_commands(), CLI_PAGE.read_text()
    rows = documented_commands(text)
    assert sorted(set(commands) - {""} - set(rows)) == [], "commands without a row in docs/cli.md"
    assert sorted(set(rows) - set(commands)) == [], "rows of docs/cli.md naming no command"
    assert missing_options(commands, text) == {}, "options the command's row does not name"


def test_the_cli_check_fails_for_an_option_added_without_docs():
    commands = cli_commands()
    planted = {**commands, "run": commands["run"] | {"--new-flag"}}
    assert missing_options(planted, CLI_PAGE.read_text()) == {"run": {"--new-flag"}}
