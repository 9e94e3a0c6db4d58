"""Check, at the end of an image build, that what is installed is what the image pins.

The Dockerfile's last step runs ``python tools/check_image_pins.py``. It reads the constraints file
at ``$PIP_CONSTRAINT`` (the GPU flavour's written pins, or the CPU flavour's copy of
``constraints.txt``) and fails, naming each package, when

- a pinned distribution is installed at another version (a local label such as ``+cpu`` is
  ignored): the GPU base ships its own builds of torch and friends, which pip would otherwise keep;
- a distribution that ``megatron_gspo`` requires (its install requirements and the extra named by
  ``$MEGATRON_GSPO_EXTRAS``) or that torch requires is missing or outside the range required
  (the CPU flavour installs torch without its dependencies, which come with the project's);
- torch is not pinned, or not installed: every other pin is chosen to fit it.

Pins of packages the image does not install (``constraints.txt`` also pins the test tools) are
not an error. ``--distribution NAME`` (repeatable) checks the requirements of other installed
distributions instead of ``megatron_gspo``'s and torch's (for the tests of this check).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def canonical(name: str) -> str:
    """PEP 503 normalised name: ``Transformer_Engine`` -> ``transformer-engine``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (comments and blank lines skipped)."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, separator, version = text.partition("==")
        if not separator or not version.strip():
            raise SystemExit(f"{path}:{number}: expected NAME==VERSION, got {line.strip()!r}")
        pins[canonical(name.strip())] = version.strip()
    return pins


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def public(version: str) -> Version:
    """The version without its local label: ``2.13.0+cpu`` -> ``2.13.0``."""
    return Version(Version(version).public)


def problems(pins: dict[str, str], distributions: list[str], extras: set[str]) -> list[str]:
    found = []
    for name, pinned in sorted(pins.items()):
        version = installed_version(name)
        if version is not None and public(version) != public(pinned):
            found.append(f"{name}: pinned {pinned}, installed {version}")
    for distribution in distributions:
        found += unmet_requirements(distribution, extras)
    if "torch" not in pins:
        found.append("torch is not pinned in the constraints file")
    elif installed_version("torch") is None:
        found.append(f"torch: pinned {pins['torch']}, not installed")
    return found


def unmet_requirements(distribution: str, extras: set[str]) -> list[str]:
    """The requirements of an installed distribution (with ``extras``) that are not met."""
    found = []
    try:
        requires = metadata.requires(distribution)
    except metadata.PackageNotFoundError:
        return [f"{distribution} is not installed"]
    if requires is None:
        requires = []
    environments = [{"extra": extra} for extra in sorted(extras)] or [{"extra": ""}]
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and not any(
            requirement.marker.evaluate(environment) for environment in environments
        ):
            continue
        version = installed_version(requirement.name)
        if version is None:
            found.append(f"{requirement.name}: required by {distribution} ({text}), not installed")
        elif not requirement.specifier.contains(public(version), prereleases=True):
            found.append(
                f"{requirement.name}: {distribution} requires {requirement.specifier}, "
                f"installed {version}"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--constraints",
        type=Path,
        default=os.environ.get("PIP_CONSTRAINT"),
        help="the constraints file (default: $PIP_CONSTRAINT)",
    )
    parser.add_argument(
        "--distribution",
        action="append",
        help="whose requirements to check (repeatable; default: megatron_gspo and torch)",
    )
    parser.add_argument(
        "--extras",
        default=os.environ.get("MEGATRON_GSPO_EXTRAS", ""),
        help="comma-separated extras installed with it (default: $MEGATRON_GSPO_EXTRAS)",
    )
    arguments = parser.parse_args(argv)
    if arguments.constraints is None:
        parser.error("no constraints file: set PIP_CONSTRAINT or pass --constraints")
    if not arguments.constraints.is_file():
        parser.error(f"the constraints file {arguments.constraints} does not exist")
    pins = read_pins(arguments.constraints)
    extras = {extra.strip() for extra in arguments.extras.split(",") if extra.strip()}
    distributions = arguments.distribution or ["megatron_gspo", "torch"]
    found = problems(pins, distributions, extras)
    if found:
        print(
            f"installed packages disagree with {arguments.constraints}:\n  " + "\n  ".join(found),
            file=sys.stderr,
        )
        return 1
    print(
        f"the {len(pins)} pins of {arguments.constraints} hold for what is installed, and the "
        f"requirements of {', '.join(distributions)} are met"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
