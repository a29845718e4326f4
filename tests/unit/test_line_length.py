"""No source line in kdsweep/ is longer than 120 characters (characters, not bytes: ``…`` and ``−`` count once)."""

from pathlib import Path

MAX_LINE = 120


def test_no_kdsweep_line_is_longer_than_120_characters():
    package = Path(__file__).parents[2] / "kdsweep"
    long = [
        f"{path.relative_to(package.parent)}:{number} ({len(line)} characters)"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"{len(long)} line(s) over {MAX_LINE} characters:\n" + "\n".join(long)
