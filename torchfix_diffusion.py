"""The ``torchfix`` and ``torchfix-diffusion`` commands, and ``python -m torchfix_diffusion``: an entry that
works whichever package answers ``import torchfix``.

Meta's TorchFix linter (``pip install torchfix``) installs the same ``torchfix`` import package and the same
``torchfix`` console script as this project (``torchfix-diffusion``). Installed in either order, one shadows
or overwrites the other: ``import torchfix`` finds the linter, or the ``torchfix`` command is the linter's
(which answers ``torchfix doctor`` with nothing, exit 0). This module has a name of its own, so it is always
ours: before handing the command to ``torchfix.cli`` it checks who answers ``import torchfix`` and who owns
the ``torchfix`` command, and where it is not this project, it says so and gives the two commands that fix it.

    torchfix-diffusion doctor           (also: python -m torchfix_diffusion doctor)

A top-level module, not part of the ``torchfix`` package (whose files the linter overwrites).

>>> from torchfix_diffusion import DISTRIBUTION
>>> DISTRIBUTION
'torchfix-diffusion'
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata

__all__ = ["DISTRIBUTION", "Clash", "clash", "main"]

DISTRIBUTION = "torchfix-diffusion"
_OURS = "torchfix_diffusion"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@dataclass
class Clash:
    """Who answers ``import torchfix`` and the ``torchfix`` command, when another distribution is in the way."""

    answers_import: str  # where ``import torchfix`` leads ("" where nothing answers)
    ours_answers: bool  # this project's torchfix (torchfix.cli with our distribution name) answers the import
    others: list[str] = field(default_factory=list)  # other distributions that install the torchfix package
    command_owner: str = ""  # the distribution whose ``torchfix`` console script is installed
    source: str = DISTRIBUTION  # what to reinstall this project from (a path for a local or editable install)

    @property
    def found(self) -> bool:
        return bool(self.others) or not self.ours_answers or _canonical(self.command_owner or DISTRIBUTION) != DISTRIBUTION

    def fixes(self) -> list[str]:
        """The two commands: remove the other distribution, then put this project's files back (removing the
        other one also removes files of the shared ``torchfix`` folder that both wrote)."""
        others = self.others or ([self.command_owner] if self.command_owner else ["torchfix"])
        reinstall = f"pip install --force-reinstall --no-deps {self.source}"
        return [f"pip uninstall -y {' '.join(others)}", reinstall]

    def message(self) -> str:
        """What is in the way and the two commands that fix it."""
        lines = [f"torchfix-diffusion: the name `torchfix` is shared with another distribution ({', '.join(self.others) or 'unknown'})."]
        if not self.ours_answers:
            where = self.answers_import or "nothing"
            lines.append(f"  `import torchfix` finds {where}, which is not torchfix-diffusion.")
        if self.command_owner and _canonical(self.command_owner) != DISTRIBUTION:
            lines.append(f"  the `torchfix` command is {self.command_owner}'s (Meta's TorchFix linter is `pip install torchfix`).")
        lines.append("Fix (two commands):")
        lines.extend(f"  {c}" for c in self.fixes())
        lines.append("Until then, torchfix-diffusion's commands answer as `torchfix-diffusion ...` or `python -m torchfix_diffusion ...`.")
        return "\n".join(lines)


def _source() -> str:
    """Where this project was installed from (``direct_url.json``): ``-e PATH`` for an editable install, ``PATH``
    for a local directory, else the distribution name."""
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        text = None
    if not text:
        return DISTRIBUTION
    info = json.loads(text)
    url = info.get("url", "")
    if not url.startswith("file://"):
        return url or DISTRIBUTION
    path = url[len("file://") :]
    return f"-e {path}" if info.get("dir_info", {}).get("editable") else path


def clash() -> Clash:
    """Look, without importing ``torchfix``: which file answers ``import torchfix``, whether it is ours
    (its ``cli.py`` names our distribution), which other distributions install a ``torchfix`` package, and
    whose ``torchfix`` console script is installed.

    >>> isinstance(clash().ours_answers, bool)
    True
    """
    spec = importlib.util.find_spec("torchfix")
    answers, ours = "", False
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        answers = spec.origin if spec.origin not in (None, "namespace") else ", ".join(locations)
        for location in locations:
            cli = os.path.join(location, "cli.py")
            if os.path.isfile(cli):
                with open(cli, encoding="utf-8", errors="replace") as f:
                    if f'DISTRIBUTION = "{DISTRIBUTION}"' in f.read():
                        ours = True
                        break
    others = sorted({d for d in metadata.packages_distributions().get("torchfix", []) if _canonical(d) != DISTRIBUTION})
    owner = ""
    for ep in metadata.entry_points(group="console_scripts", name="torchfix"):
        dist = getattr(ep, "dist", None)
        owner = dist.metadata["Name"] if dist is not None else owner
        if _canonical(owner) != DISTRIBUTION:
            break
    return Clash(answers, ours, others, owner, _source())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchfix`` command where this project answers ``import torchfix``; where another package does,
    say so and how to fix it (exit 2). ``doctor`` prints what is in the way first, then this project's report."""
    found = clash()
    if not found.ours_answers:
        print(found.message(), file=sys.stderr)
        return 2
    from torchfix.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
