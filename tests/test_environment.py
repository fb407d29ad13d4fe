"""The project's environment keeps the packages its users' tools rely on intact.

``urllib3-future`` (pulled in by ``niquests``) installs itself into ``urllib3``'s own package
directory: ``import urllib3`` then gives the replacement while pip still lists urllib3, and
tools built on ``requests`` break (schemathesis' CLI among them). No dependency of the
project may bring it in.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import urllib3


def test_urllib3_is_urllib3_itself():
    assert urllib3.__version__ == importlib.metadata.version("urllib3")
    for replacement in ("urllib3-future", "niquests"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(replacement)
