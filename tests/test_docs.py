"""The README documents every worker setting, under the environment name and flag users type."""

from __future__ import annotations

from pathlib import Path

from worker.config import Settings

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_setting_is_in_the_readme() -> None:
    missing = [
        name
        for name in Settings.model_fields
        if f"`LLMQ_{name.upper()}`" not in README or f"`--{name.replace('_', '-')}`" not in README
    ]
    assert not missing, f"settings missing from the README: {missing}"


def test_readme_opens_with_the_two_commands() -> None:
    assert "make run" in README.split("##")[0] and "make test" in README.split("##")[0]


def test_every_request_bound_is_in_the_readme() -> None:
    """The README's table of request fields states the same maxima as `client.protocol.BOUNDS`."""
    from client.protocol import BOUNDS

    rows = [line.strip() for line in README.splitlines() if line.strip().startswith("| `")]
    for bound in BOUNDS:
        name = bound.field.removeprefix("params.")
        row = next((r for r in rows if f"`{name}`" in r.split("|")[1]), None)
        assert row is not None, f"no README row for {bound.field}"
        if isinstance(bound.maximum, int) and bound.maximum < 2**62:
            assert str(bound.maximum) in row, f"{bound.field}: README row does not say {bound.maximum}"
