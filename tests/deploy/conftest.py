from __future__ import annotations

import pytest

from tests.deploy import tools


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return tools.require("helm")


@pytest.fixture(scope="session")
def hadolint_bin() -> str:
    return tools.require("hadolint")
