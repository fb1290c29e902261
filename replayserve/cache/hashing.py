"""Chained block hashes for prefix caching: sha256 over a canonical encoding of each full block.

Block ``i`` hashes ``(h_{i-1}, tokens of block i, extra_keys)`` with ``h_{-1} = ROOT_HASH``, so a hash
fingerprints the whole prefix up to the end of its block. The encoding is injective (type tags and
lengths everywhere), so two different keys can only share a hash through a sha256 collision; the pool
still stores the key beside each published hash and compares it on lookup.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # a 32-byte sha256 digest

ROOT_HASH: BlockHash = hashlib.sha256(b"replayserve.prefix-cache.root.v1").digest()

_DOMAIN = b"replayserve.prefix-cache.block.v1\x00"
_MAX_TOKEN = 2**63
_U64 = struct.Struct(">Q")


@dataclass(frozen=True)
class BlockKey:
    """Everything a block hash stands for: kept beside a published block so a lookup can check it."""

    parent: BlockHash
    tokens: tuple[int, ...]
    extra_keys: tuple = ()


def _encode_extra(value: object, out: bytearray) -> None:
    """Appends a type-tagged, length-prefixed encoding of one extra key to `out`."""
    # bool before int: bool is a subclass of int, and True must not encode like 1.
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"B\x01" if value else b"B\x00"
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        out += b"I" + _U64.pack(len(raw)) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"S" + _U64.pack(len(raw)) + raw
    elif isinstance(value, bytes):
        out += b"Y" + _U64.pack(len(value)) + value
    elif isinstance(value, tuple):
        out += b"T" + _U64.pack(len(value))
        for item in value:
            _encode_extra(item, out)
    else:
        raise TypeError(
            f"extra_keys may hold only str, int, bytes, bool, None and tuples of those; got {type(value).__name__}"
        )


def _encode_extra_keys(extra_keys: tuple) -> bytes:
    if not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be a tuple, got {type(extra_keys).__name__}")
    out = bytearray()
    _encode_extra(extra_keys, out)
    return bytes(out)


def _digest(parent: BlockHash, tokens: Sequence[int], extra: bytes) -> BlockHash:
    """sha256 of (domain, parent, token count, tokens as big-endian u64, encoded extra keys)."""
    if not isinstance(parent, bytes) or len(parent) != 32:
        raise ValueError(f"parent must be a 32-byte block hash, got {parent!r}")
    ids = [operator.index(t) for t in tokens]
    if ids and not (0 <= min(ids) and max(ids) < _MAX_TOKEN):
        bad = next(t for t in ids if not 0 <= t < _MAX_TOKEN)
        raise ValueError(f"token id {bad} is out of range: ids must be in [0, 2**63)")
    h = hashlib.sha256(_DOMAIN)
    h.update(parent)
    h.update(_U64.pack(len(ids)))
    h.update(struct.pack(f">{len(ids)}Q", *ids))
    h.update(extra)
    return h.digest()


def hash_block(key: BlockKey) -> BlockHash:
    """sha256 over a canonical, unambiguous encoding of (parent, tokens, extra_keys).

    Raises:
        TypeError: an extra key (or a nested one) is not str / int / bytes / bool / None / tuple, or a
            token is not an integer.
        ValueError: the parent is not 32 bytes, or a token id is outside [0, 2**63).
    """
    return _digest(key.parent, key.tokens, _encode_extra_keys(key.extra_keys))


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    known: Sequence[BlockHash] = (),
    known_keys: Sequence[BlockKey] = (),
) -> tuple[list[BlockKey], list[BlockHash]]:
    """Keys and chained hashes of every FULL block of token_ids (a trailing partial block is left out).

    Args:
        token_ids: the sequence's tokens so far.
        block_size: tokens per block, >= 1.
        extra_keys: mixed into every block's hash (adapter id, cache salt, ...).
        known: hashes already computed for the first len(known) blocks (incremental extension when a
            request grows); those blocks are not rehashed.
        known_keys: keys already built for the first len(known_keys) <= len(known) blocks; reused,
            so extending a long sequence by a block builds one key, not one per block.

    Returns:
        (keys, hashes), one entry per full block; keys for known blocks without a known key are
        rebuilt from token_ids and the known parents.

    Raises:
        ValueError: block_size < 1, `known` has more entries than token_ids has full blocks, or
            `known_keys` more than `known`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if len(known) > num_blocks:
        raise ValueError(
            f"known has {len(known)} hashes but {len(token_ids)} tokens hold only {num_blocks} full blocks "
            f"of {block_size}"
        )
    if len(known_keys) > len(known):
        raise ValueError(f"known_keys has {len(known_keys)} keys but known only {len(known)} hashes")
    extra = _encode_extra_keys(extra_keys)
    keys: list[BlockKey] = list(known_keys)
    hashes: list[BlockHash] = list(known)
    parent = hashes[len(keys) - 1] if keys else ROOT_HASH
    for i in range(len(keys), num_blocks):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        keys.append(BlockKey(parent, tokens, extra_keys))
        if i >= len(known):
            hashes.append(_digest(parent, tokens, extra))
        parent = hashes[i]
    return keys, hashes
