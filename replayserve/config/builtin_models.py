"""The built-in models' names and the directories their checkpoints ship in (`replayserve/builtin/`):
`resolve_model` turns the `model` option into a model directory. Here, not in `builtin/` (whose
checks run an `LLM`), because building an engine resolves the name first."""

from __future__ import annotations

from pathlib import Path

TINY_CODE = "replayserve/tiny-code"
TINY_CODE_DIR = Path(__file__).parents[1] / "builtin" / "tiny_code_checkpoint"
BUILTIN_MODELS = {TINY_CODE: TINY_CODE_DIR}


def resolve_model(model: str) -> str:
    """A built-in name (`replayserve/tiny-code`) -> its directory; anything else is returned as it
    is (a model directory). A local directory of the same name wins over the built-in."""
    builtin = BUILTIN_MODELS.get(model)
    if builtin is None or Path(model).is_dir():
        return model
    if not (builtin / "config.json").is_file():
        raise FileNotFoundError(f"the built-in model {model} has no weights in {builtin}; reinstall replayserve "
                                "or write them with scripts/train_default_model.py --install")
    return str(builtin)
