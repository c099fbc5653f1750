"""Fixtures shared by the service's test modules: the block API's server (tests/service/test_block_api_*.py;
a module that needs another server defines its own ``server``, which overrides this one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from chunkattn_server.service.auth import token_digest
from tests.helpers.blockapi import POOL, QUOTA_BLOCKS, TENANTS, TOKENS
from tests.helpers.server_process import SMALL, ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tenants, each with its token; "quota" may hold QUOTA_BLOCKS pool blocks."""
    spec: dict[str, dict[str, Any]] = {name: {"tokens_sha256": [token_digest(TOKENS[name])]} for name in TENANTS}
    spec["quota"]["max_kv_blocks"] = QUOTA_BLOCKS
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    path.write_text(json.dumps({"tenants": spec}))
    path.chmod(0o600)
    with ServerProcess(*SMALL, "--num-blocks", str(POOL), "--idle-timeout-s", "0", "--auth-tokens", str(path)) as s:
        yield s
