"""Boolean environment variables, read the same way by both frontends.

``1`` / ``true`` / ``yes`` / ``on`` mean on, ``0`` / ``false`` / ``no`` / ``off`` mean off (any
case, spaces around ignored); unset or empty means "not given". Anything else is a `LaunchError`
that names the variable and the values it takes, so a typo never silently picks a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from smp.errors import LaunchError

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, meaning: str = "", env: Mapping[str, str] | None = None) -> bool | None:
    """The value of the boolean environment variable ``name``, or None when it is unset or empty.

    Args:
        name: the variable.
        meaning: what ``name=1`` and ``name=0`` do, for the error message (e.g. ``"1 turns X off"``).
        env: the environment (default ``os.environ``).

    Raises:
        LaunchError: a value that is neither on nor off.

    Example:
        >>> env_flag("SMP_X", env={"SMP_X": " Yes "}), env_flag("SMP_X", env={"SMP_X": "off"}), env_flag("SMP_X", env={})
        (True, False, None)
    """
    raw = (os.environ if env is None else env).get(name, "")
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    if value:
        raise LaunchError(f"{name}={raw!r} is not understood. Fix: {name}=1 or {name}=0 "
                          f"(also true/false, yes/no, on/off){'; ' + meaning if meaning else ''}, or leave it unset")
    return None
