"""How a checkpoint spells the backbone this engine calls ``backbone.``: the one table of those
spellings, read both ways (checkpoint name -> engine name when loading; engine name -> checkpoint
name when writing one, or matching a ModelOpt ``exclude_modules`` pattern written in the
checkpoint's own names).

Nemotron-H's checkpoints say ``backbone.`` as this engine does; the other families say ``model.``
(transformers' in-memory prefix), and a multimodal Qwen3.5 checkpoint ``model.language_model.``.
``lm_head.`` and ``mtp.`` are spelled the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

BACKBONE = "backbone."
# A multimodal Qwen3.5 checkpoint's vision tower: never loaded, the language model runs alone.
VISION_PREFIX = "model.visual."
# Longest first: `model.language_model.x` must not read as `model.` + `language_model.x`.
STORED_PREFIXES = ("model.language_model.", "model.")


def canonical_name(name: str) -> str:
    """A checkpoint tensor or module name as this engine names it (``model.layers.0.x`` ->
    ``backbone.layers.0.x``); names without a backbone prefix are returned as they are."""
    for prefix in STORED_PREFIXES:
        if name.startswith(prefix):
            return BACKBONE + name[len(prefix):]
    return name


def stored_spellings(name: str) -> tuple[str, ...]:
    """Every name a checkpoint may give the engine's ``name``: itself, and for a ``backbone.``
    name each stored prefix's spelling of it."""
    if not name.startswith(BACKBONE):
        return (name,)
    rest = name[len(BACKBONE):]
    return (name, *(prefix + rest for prefix in STORED_PREFIXES))


def stored_name(name: str, prefix: str) -> str:
    """The engine's ``name`` spelled with checkpoint backbone prefix ``prefix`` (``BACKBONE`` or
    one of ``STORED_PREFIXES``)."""
    return prefix + name[len(BACKBONE):] if name.startswith(BACKBONE) else name


def backbone_prefix(stored: Iterable[str]) -> str:
    """The backbone prefix a checkpoint's stored tensor names use (``BACKBONE`` when none of
    ``STORED_PREFIXES`` starts any, as in Nemotron-H's checkpoints). Each prefix is checked on
    names outside the vision tower (``VISION_PREFIX``), which is no part of the backbone."""
    names = [n for n in stored if not n.startswith(VISION_PREFIX)]
    return next((p for p in STORED_PREFIXES if any(n.startswith(p) for n in names)), BACKBONE)
