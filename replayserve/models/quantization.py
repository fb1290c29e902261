"""NVIDIA ModelOpt checkpoint quantization: the config that says what is quantized, and the check
that a checkpoint's tensors hold what that config promises.

A ModelOpt FP8 checkpoint (``quant_algo: FP8``) stores, for every quantized Linear ``m``:
``m.weight`` float8_e4m3fn (N, K), ``m.weight_scale`` one float32 (``amax / 448`` of the weight)
and ``m.input_scale`` one float32 (the static activation scale, from calibration). Modules that
``exclude_modules`` names stay in 16-bit. With ``kv_cache_quant_algo: FP8`` every attention
layer ``a`` also stores ``a.k_proj.k_scale`` and ``a.v_proj.v_scale`` (per-tensor scales of the
keys and values its KV cache holds). All scales are 0-dim in ModelOpt's exports; one-element
tensors are accepted too. (Layout as ModelOpt 0.47.0 writes it for Nemotron-H:
``scripts/make_modelopt_fp8_fixture.py``; names and rules as vLLM's ``modelopt.py`` reads them.)

The config comes from ``hf_quant_config.json`` or, failing that, from config.json's
``quantization_config`` with ``quant_method: modelopt``; when both exist they must agree.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from replayserve.layers.attention import Attention
from replayserve.models.checkpoint_error import CheckpointError
from replayserve.models.checkpoint_names import stored_spellings

logger = logging.getLogger(__name__)

QUANT_CONFIG_FILE = "hf_quant_config.json"
SUPPORTED_QUANT_ALGOS = ("FP8",)
SUPPORTED_KV_CACHE_QUANT_ALGOS = ("FP8",)
# ModelOpt algorithms vLLM also knows, named in the error so a user sees it is the format, not a typo.
_KNOWN_UNSUPPORTED = ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".kv_scale")


class QuantizationError(CheckpointError):
    """The quantization config or the quantized tensors of a checkpoint are not what it promises."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What a ModelOpt checkpoint quantizes.

    quant_algo: the weight/activation format, upper case ("FP8").
    kv_cache_quant_algo: "FP8" when the checkpoint carries KV-cache scales for an FP8 cache, else None.
    exclude_modules: module-name patterns kept in 16-bit (fnmatch wildcards; ModelOpt's ``path*``
        means the module ``path`` and everything below it).
    source: where the config was read, for error messages.
    """

    quant_algo: str
    kv_cache_quant_algo: str | None
    exclude_modules: tuple[str, ...]
    source: str

    def excluding_pattern(self, module: str) -> str | None:
        """The first pattern of exclude_modules that keeps ``module`` (a dotted module name, as
        the engine names it: ``backbone.layers.0.mixer.in_proj``) unquantized, or None. A pattern may
        spell the backbone as any checkpoint does (``model.layers.0.*``: ``models/checkpoint_names.py``)."""
        names = stored_spellings(module)
        for pattern in self.exclude_modules:
            if pattern.endswith("*") and not pattern.endswith(".*"):  # ModelOpt's "path*": path and its subtree
                base = pattern[:-1]
                if any(fnmatch.fnmatchcase(n, base) or fnmatch.fnmatchcase(n, base + ".*") for n in names):
                    return pattern
            elif any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return pattern
        return None

    def is_excluded(self, module: str) -> bool:
        """Whether ``module`` stays unquantized (``excluding_pattern`` finds a pattern)."""
        return self.excluding_pattern(module) is not None


def _upper_algo(value: Any, key: str, source: str, allowed: tuple[str, ...]) -> str:
    """``value`` upper-cased when it names an algorithm in ``allowed``; else an error naming ``key``."""
    if not isinstance(value, str) or not value:
        raise QuantizationError(f"{source}: {key} must be one of {list(allowed)}, got {value!r}")
    algo = value.upper()
    if algo not in allowed:
        later = " (a ModelOpt format replayserve does not load yet)" if algo in _KNOWN_UNSUPPORTED else ""
        raise QuantizationError(f"{source}: {key} is {value!r}{later}; supported: {list(allowed)}")
    return algo


def _kv_algo(value: Any, key: str, source: str) -> str | None:
    """The KV-cache algorithm (None: the cache is not quantized by the checkpoint)."""
    return None if value is None else _upper_algo(value, key, source, SUPPORTED_KV_CACHE_QUANT_ALGOS)


def _exclude_patterns(value: Any, key: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise QuantizationError(f"{source}: {key} must be a list of module-name patterns, got {value!r}")
    patterns = []
    for pattern in value:
        if "\x00" in pattern:
            # ModelOpt 0.47.0 appends a sentinel (".\x00modelopt_name_sentinel") before renaming
            # `model.` to `backbone.` and strips it after; its unanchored `model.` pattern also
            # matches inside the sentinel, which then survives as ".\x00backbone.pt_name_sentinel".
            # No module name holds a NUL, so what precedes it is the name.
            clean = pattern.split("\x00", 1)[0].removesuffix(".")
            logger.warning("%s: %s entry %r carries ModelOpt's mangled name sentinel; reading it as %r",
                           source, key, pattern, clean)
            pattern = clean
        patterns.append(pattern)
    return tuple(patterns)


def _kv_scheme_algo(value: Any, source: str) -> str | None:
    """config.json's compressed-tensors style ``kv_cache_scheme`` ({type: float, num_bits: 8} is FP8)."""
    if value is None:
        return None
    if isinstance(value, dict) and value.get("type") == "float" and value.get("num_bits") == 8:
        return "FP8"
    raise QuantizationError(f"{source}: kv_cache_scheme {value!r} is not supported; "
                            "{\"type\": \"float\", \"num_bits\": 8} (FP8) or null")


def parse_quant_config(raw: Mapping[str, Any], source: str) -> QuantConfig:
    """A ``QuantConfig`` from a parsed ``hf_quant_config.json`` (``{"quantization": {quant_algo,
    kv_cache_quant_algo, exclude_modules}}``) or config.json ``quantization_config`` (``{quant_method:
    "modelopt", quant_algo, kv_cache_scheme, ignore}``, or the nested form). ``source`` names the
    file (and key) in error messages."""
    method = raw.get("quant_method")
    if method is not None and not str(method).lower().startswith("modelopt"):
        raise QuantizationError(f"{source}: quant_method is {method!r}; replayserve loads NVIDIA ModelOpt checkpoints "
                                "(quant_method 'modelopt') only")
    if "quantization" in raw:
        body = raw["quantization"]
        if not isinstance(body, dict):
            raise QuantizationError(f"{source}: quantization must be an object, got {body!r}")
        where = f"{source} quantization"
        algo = _upper_algo(body.get("quant_algo"), "quantization.quant_algo", source, SUPPORTED_QUANT_ALGOS)
        kv = _kv_algo(body.get("kv_cache_quant_algo"), "quantization.kv_cache_quant_algo", source)
        exclude = _exclude_patterns(body.get("exclude_modules"), "quantization.exclude_modules", where)
    else:
        algo = _upper_algo(raw.get("quant_algo"), "quant_algo", source, SUPPORTED_QUANT_ALGOS)
        if "kv_cache_quant_algo" in raw:
            kv = _kv_algo(raw["kv_cache_quant_algo"], "kv_cache_quant_algo", source)
        else:
            kv = _kv_scheme_algo(raw.get("kv_cache_scheme"), source)
        exclude = _exclude_patterns(raw.get("ignore", raw.get("exclude_modules")), "ignore", source)
    return QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv, exclude_modules=exclude, source=source)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QuantizationError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise QuantizationError(f"{path} must hold a JSON object")
    return raw


def read_quant_config(model_dir: str | Path) -> QuantConfig | None:
    """The checkpoint's ModelOpt quantization config, or None for an unquantized checkpoint.

    ``hf_quant_config.json`` is read first (as vLLM does); config.json's ``quantization_config``
    otherwise. When both are there, their quant_algo and kv_cache_quant_algo must agree.
    """
    model_dir = Path(model_dir)
    from_config = None
    config_path = model_dir / "config.json"
    if config_path.is_file():
        section = _read_json(config_path).get("quantization_config")
        if section is not None:
            if not isinstance(section, dict):
                raise QuantizationError(f"{config_path}: quantization_config must be an object, got {section!r}")
            from_config = parse_quant_config(section, f"{config_path} quantization_config")
    quant_path = model_dir / QUANT_CONFIG_FILE
    if not quant_path.is_file():
        return from_config
    from_file = parse_quant_config(_read_json(quant_path), str(quant_path))
    if from_config is not None and (from_config.quant_algo, from_config.kv_cache_quant_algo) != (
            from_file.quant_algo, from_file.kv_cache_quant_algo):
        raise QuantizationError(
            f"{quant_path} (quant_algo {from_file.quant_algo}, kv_cache_quant_algo {from_file.kv_cache_quant_algo}) "
            f"and {config_path} quantization_config (quant_algo {from_config.quant_algo}, kv_cache_quant_algo "
            f"{from_config.kv_cache_quant_algo}) disagree; re-export the checkpoint or remove one of them")
    return from_file


@dataclasses.dataclass(frozen=True)
class LinearScales:
    """The per-tensor scales of one FP8 Linear: 0-dim float32 tensors; input_scale None means the
    checkpoint has no static activation scale (dynamic activation quantization)."""

    weight_scale: Tensor
    input_scale: Tensor | None


@dataclasses.dataclass(frozen=True)
class KVCacheScales:
    """The per-tensor scales of one attention layer's FP8 KV cache: 0-dim float32 tensors."""

    k_scale: Tensor
    v_scale: Tensor


@dataclasses.dataclass(frozen=True)
class QuantizedTensors:
    """What ``check_quantized_tensors`` found.

    linears: quantized Linear module name -> its scales.
    kv_cache: attention module name -> its KV-cache scales (every attention layer when the config
        says kv_cache_quant_algo FP8; those the checkpoint has otherwise).
    static_activations: every quantized Linear has an input_scale (else none has).
    scale_names: the checkpoint tensors that are scales, which a loader takes here rather than as parameters.
    """

    linears: dict[str, LinearScales]
    kv_cache: dict[str, KVCacheScales]
    static_activations: bool
    scale_names: frozenset[str]


def quantizable_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the model's Linear modules, names of its attention layers): the modules a
    ModelOpt checkpoint may quantize and the ones whose KV cache it may scale. Works on a model
    built on the meta device."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    attentions = [name for name, m in model.named_modules() if isinstance(m, Attention)]
    return linears, attentions


def _scale(tensors: Mapping[str, Tensor], name: str, what: str) -> Tensor:
    """The one-value float scale stored as ``name``, as a 0-dim float32 tensor; errors name it."""
    if name not in tensors:
        raise QuantizationError(f"checkpoint is missing tensor {name} ({what})")
    t = tensors[name]
    if t.numel() != 1 or t.dim() > 1:
        raise QuantizationError(f"checkpoint tensor {name} has shape {tuple(t.shape)}; {what} is a per-tensor scale "
                                "holding one value (shape () or (1,))")
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise QuantizationError(f"checkpoint tensor {name} has dtype {t.dtype}; {what} must be float32 (or another "
                                "16/32-bit float)")
    if t.device.type != "meta":
        value = float(t.reshape(()))
        if not value > 0 or value == float("inf"):
            raise QuantizationError(f"checkpoint tensor {name} is {value}; {what} must be finite and positive")
    return t.reshape(()).to(torch.float32)


def _kv_scale_names(attention: str, which: str) -> list[str]:
    """Where a checkpoint may store attention layer ``attention``'s k or v scale, as vLLM reads
    them: ModelOpt's name (on the projection) first, then the layer's own, then the deprecated
    ``kv_scale`` that serves as both."""
    return [f"{attention}.{which}_proj.{which}_scale", f"{attention}.{which}_scale", f"{attention}.kv_scale"]


def _kv_scales(tensors: Mapping[str, Tensor], attention: str, required: bool) -> tuple[KVCacheScales | None, set[str]]:
    found: dict[str, str] = {}
    for which in ("k", "v"):
        present = [n for n in _kv_scale_names(attention, which) if n in tensors]
        if len(present) > 1:
            raise QuantizationError(f"checkpoint stores attention layer {attention}'s {which} scale more than once, "
                                    f"as {present}; keep one")
        if present:
            found[which] = present[0]
    if not found and not required:
        return None, set()
    for which, other in (("k", "v"), ("v", "k")):
        if which not in found:
            why = "kv_cache_quant_algo FP8 needs it" if required else f"its {other} scale is stored"
            raise QuantizationError(f"checkpoint is missing tensor {_kv_scale_names(attention, which)[0]} "
                                    f"(the {which} scale of attention layer {attention}; {why})")
    scales = KVCacheScales(_scale(tensors, found["k"], "a KV-cache k_scale"),
                           _scale(tensors, found["v"], "a KV-cache v_scale"))
    return scales, set(found.values())


def check_quantized_tensors(tensors: Mapping[str, Tensor], quant: QuantConfig, linear_modules: Iterable[str],
                            attention_modules: Iterable[str]) -> QuantizedTensors:
    """Checks a ModelOpt FP8 checkpoint's tensors against its config and the model's modules.

    Every Linear in ``linear_modules`` that ``quant`` does not exclude must store a float8_e4m3fn
    ``weight`` and a one-value ``weight_scale``; ``input_scale`` is there for all of them or for
    none. An excluded Linear must store neither FP8 weights nor scales. With kv_cache_quant_algo
    FP8, every attention layer stores k and v scales. Every scale is a finite positive float of one
    value, and no scale tensor may belong to a module the model lacks. Each error names the tensor.

    tensors: checkpoint name -> tensor (meta tensors are enough for everything but the values).
    Returns the scales found (``QuantizedTensors``).
    """
    linears: dict[str, LinearScales] = {}
    used: set[str] = set()
    without_input_scale: list[str] = []
    for module in linear_modules:
        weight = tensors.get(f"{module}.weight")
        pattern = quant.excluding_pattern(module)
        if pattern is not None:
            stray = [n for n in (f"{module}.weight_scale", f"{module}.input_scale") if n in tensors]
            if stray or (weight is not None and weight.dtype == torch.float8_e4m3fn):
                raise QuantizationError(f"checkpoint tensor {stray[0] if stray else f'{module}.weight'} quantizes "
                                        f"module {module}, which {quant.source} excludes ({pattern!r})")
            continue
        if weight is not None and weight.dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"checkpoint tensor {module}.weight has dtype {weight.dtype}; {quant.source} "
                                    f"quantizes {module} (quant_algo {quant.quant_algo}), so it must be float8_e4m3fn "
                                    "(or exclude the module)")
        weight_scale = _scale(tensors, f"{module}.weight_scale", "an FP8 weight's weight_scale")
        input_scale = None
        if f"{module}.input_scale" in tensors:
            input_scale = _scale(tensors, f"{module}.input_scale", "an FP8 Linear's input_scale")
            used.add(f"{module}.input_scale")
        else:
            without_input_scale.append(module)
        used.add(f"{module}.weight_scale")
        linears[module] = LinearScales(weight_scale, input_scale)
    static = not without_input_scale
    if without_input_scale and len(without_input_scale) < len(linears):
        raise QuantizationError(f"checkpoint is missing tensor {without_input_scale[0]}.input_scale: other FP8 Linears "
                                "have static activation scales, so every one needs its input_scale")
    kv_cache: dict[str, KVCacheScales] = {}
    for attention in attention_modules:
        scales, names = _kv_scales(tensors, attention, required=quant.kv_cache_quant_algo == "FP8")
        if scales is not None:
            kv_cache[attention] = scales
            used |= names
    stray = sorted(n for n in tensors if n.endswith(_SCALE_SUFFIXES) and n not in used)
    if stray:
        raise QuantizationError(f"checkpoint tensors {stray[:8]} are scales of modules this model does not quantize "
                                "or does not have")
    return QuantizedTensors(linears, kv_cache, static and bool(linears), frozenset(used))
