"""The code repository a model card cites: ``release.repository``, else this checkout's git
remote ``origin`` where it is a public web address (a fresh clone's is where it came from).

A remote URL can carry a token (``https://user:token@host/...``): only a plain ``https://``
address with no user part is taken (an ``git@host:owner/repo`` one becomes ``https://host/owner/repo``),
anything else names no repository rather than leak or garble one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# https://host/path: no user part, no query, no whitespace or markdown/HTML metacharacters
WEB_ADDRESS = re.compile(r"https://[A-Za-z0-9.-]+(?::\d{1,5})?(?:/[A-Za-z0-9._~%+-]+)+/?")
_SCP_STYLE = re.compile(r"git@([A-Za-z0-9.-]+):([A-Za-z0-9._~/-]+)")


def web_address(value: object) -> str | None:
    """``value`` if it is a plain public https address (see WEB_ADDRESS), else None."""
    return value if isinstance(value, str) and WEB_ADDRESS.fullmatch(value) and ".." not in value else None


def code_repository(configured: str | None, checkout: Path | None = None) -> str | None:
    """``configured`` (release.repository), else the checkout's origin as a web address, else None."""
    if configured:
        return configured
    try:
        remote = subprocess.run(
            ["git", "config", "--get", "remote.origin.url"], cwd=checkout or Path.cwd(), capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    scp = _SCP_STYLE.fullmatch(remote)
    if scp:
        remote = f"https://{scp.group(1)}/{scp.group(2)}"
    remote = remote.removesuffix(".git")
    return web_address(remote)
