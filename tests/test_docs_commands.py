"""Every ``minifaas ...`` command quoted in README.md and docs/*.md parses with the real argument parser.

The commands are not run (some take hours); each is parsed by its subcommand's
own parser, as ``minifaas`` would parse it, so a renamed or removed flag, a
wrong choice or a usage sketch that is not a command fails here. The annotated
file tree (docs/FILES.md) is checked against the files it describes, and the
guide's TOML example is loaded as ``minifaas serve --config`` loads it.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from minifaas.commands.main import COMMANDS, command_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"(?:^|[\s(])minifaas +([a-z][^\n;|&#`]*)")
_LOOP = re.compile(r"\bfor (\w+) in ([^;\n]+);")


def code_of(markdown: str) -> list[str]:
    """The code in a markdown text: fenced blocks, indented blocks and inline spans."""
    text = markdown.replace("\\\n", " ")  # shell line continuations
    fenced = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    indented = [line for line in prose.splitlines() if line.startswith("    ")]
    inline = _INLINE.findall("\n".join(line for line in prose.splitlines() if not line.startswith("    ")))
    return fenced + indented + inline


def marked_blocks(markdown: str, marker: str) -> list[str]:
    """The fenced blocks that come right after the HTML comment ``<!-- marker -->``."""
    return re.findall(rf"^<!-- {re.escape(marker)} -->\n```[^\n]*\n(.*?)^```", markdown, re.S | re.M)


def commands_in(markdown: str) -> list[list[str]]:
    """Each quoted ``minifaas`` command as argv (subcommand first); loop variables take their first value."""
    loop_values = {name: values.split()[0] for name, values in _LOOP.findall(markdown)}
    found = []
    for code in code_of(markdown):
        for match in _COMMAND.finditer(code):
            line = re.sub(r"\$(\w+)", lambda m: loop_values.get(m.group(1), m.group(0)), match.group(1))
            found.append(shlex.split(line))
    return found


def _cases() -> list[tuple[str, list[str]]]:
    return [(path.name, argv) for path in DOCS for argv in commands_in(path.read_text())]


CASES = _cases()


def test_the_docs_quote_commands() -> None:
    files = {name for name, _ in CASES}
    assert {"README.md", "GUIDE.md", "RESULTS.md", "STUDIES.md"} <= files
    quoted = {argv[0] for _, argv in CASES}
    assert set(COMMANDS) <= quoted, f"no doc has an example of {sorted(set(COMMANDS) - quoted)}"
    guide_tour = (ROOT / "docs" / "GUIDE.md").read_text().split("\n## Tour\n", 1)[1].split("\n## ", 1)[0]
    tour = {argv[0] for argv in commands_in(guide_tour)}
    assert set(COMMANDS) <= tour, f"the guide's tour has no example of {sorted(set(COMMANDS) - tour)}"


@pytest.mark.parametrize(("doc", "argv"), CASES, ids=[f"{name}: {' '.join(argv)}"[:90] for name, argv in CASES])
def test_command_parses(doc: str, argv: list[str]) -> None:
    name, args = argv[0], argv[1:]
    assert name in COMMANDS, f"{doc} quotes an unknown subcommand: minifaas {' '.join(argv)}"
    assert not any("$" in a for a in args), f"{doc}: a shell variable with no loop value: {args}"
    assert "--help" not in args and "-h" not in args
    try:
        command_parser(name).parse_args(args)
    except SystemExit as e:  # argparse's usage error
        pytest.fail(f"{doc}: `minifaas {' '.join(argv)}` does not parse (exit {e.code})")


def test_extraction() -> None:
    text = (
        "Run `minifaas plan --case paper` or\n\n"
        "    for g in 10 25; do minifaas plan --link-gbps $g --json; done\n\n"
        "```bash\nminifaas sim --case paper \\\n  --load 0.8  # a comment\n```\n"
        "The `minifaas` object; see minifaas/commands/main.py and python -m minifaas.commands.worker.\n"
    )
    assert commands_in(text) == [
        ["sim", "--case", "paper", "--load", "0.8"],
        ["plan", "--link-gbps", "10", "--json"],
        ["plan", "--case", "paper"],
    ]


def test_file_tree_lists_every_file() -> None:
    tree = (ROOT / "docs" / "FILES.md").read_text()
    listed = {line.split()[0] for line in tree.splitlines() if line.startswith("    ")}
    present = {
        str(path.relative_to(ROOT))
        for folder in ("minifaas", "benchmarks", "examples", "docs")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert sorted(present - listed) == [], "files missing from docs/FILES.md"
    assert sorted(p for p in listed - present if not p.endswith("/")) == [], "docs/FILES.md lists files not there"


def test_the_guide_config_example_loads(tmp_path: Path) -> None:
    from minifaas.commands.serve import config_from_args  # the gateway's imports, for this test alone

    [example] = marked_blocks((ROOT / "docs" / "GUIDE.md").read_text(), "config-example")
    path = tmp_path / "serve.toml"
    path.write_text(example)
    config = config_from_args(command_parser("serve").parse_args(["--config", str(path)]))
    for table, settings in tomllib.loads(example).items():
        part = config if table == "serve" else getattr(config, table)
        assert {k: getattr(part, k) for k in settings} == settings, f"[{table}] did not take effect"
    flagged = config_from_args(command_parser("serve").parse_args(["--config", str(path), "--threshold", "7"]))
    assert (flagged.threshold, flagged.pd) == (7, config.pd), "a flag overrides the file, and only what it names"


def test_marked_blocks() -> None:
    text = "<!-- run-me -->\n```bash\nminifaas plan\n```\n\n```bash\nminifaas sim\n```\n"
    assert marked_blocks(text, "run-me") == ["minifaas plan\n"]
    assert marked_blocks(text, "other") == []


def test_a_bad_flag_fails_to_parse() -> None:
    with pytest.raises(SystemExit):
        command_parser("plan").parse_args(["--no-such-flag"])
