"""Prefix-cache block hashes are SHA-256 chains: a crafted prompt cannot collide with another
request's prefix (a hit would hand it that request's KV)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

from engine.core.kv_cache_manager import ROOT_HASH, hash_block_tokens


def test_block_hash_is_a_sha256_chain() -> None:
    first = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert first == hashlib.sha256(bytes(32) + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert len(second) == 32
    # The same tokens under another prefix are another block.
    assert hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 9, 9, 9]), [5, 6, 7, 8]) != second
    # Fixed-width ids: no two token lists share an encoding.
    assert hash_block_tokens(ROOT_HASH, [1, 2]) != hash_block_tokens(ROOT_HASH, [258])


def test_python_hash_of_the_old_scheme_collides_where_sha256_does_not() -> None:
    """The old key, Python's hash((parent, tokens)), maps parents -1 and -2 to one value (CPython
    reserves -1): two different chains shared one cache entry. SHA-256 keeps them apart."""
    assert hash((-1, (7, 8))) == hash((-2, (7, 8)))
    parent_a, parent_b = hash_block_tokens(ROOT_HASH, [1]), hash_block_tokens(ROOT_HASH, [2])
    assert hash_block_tokens(parent_a, [7, 8]) != hash_block_tokens(parent_b, [7, 8])


def test_block_hash_is_the_same_in_every_process() -> None:
    """Unlike str/bytes hash(), it does not depend on PYTHONHASHSEED: every process (and a
    restarted server) computes the same keys."""
    code = ("from engine.core.kv_cache_manager import ROOT_HASH, hash_block_tokens;"
            "print(hash_block_tokens(ROOT_HASH, [3, 1, 4, 1, 5]).hex())")
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        seen.add(out.stdout.strip())
    assert seen == {hash_block_tokens(ROOT_HASH, [3, 1, 4, 1, 5]).hex()}
