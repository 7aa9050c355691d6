"""The README's flag table is `naiad serve --help`'s: regenerate it with `python tools/readme_flags.py`."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_readme_flag_table_matches_the_parser():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "readme_flags.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_serve_flag_is_in_the_readme():
    sys.path.insert(0, str(ROOT / "tools"))
    import readme_flags

    readme = (ROOT / "README.md").read_text()
    for action in readme_flags.serve_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}`" in readme, option
