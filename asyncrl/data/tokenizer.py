"""The tokenizer a process loads: the class its model directory names (`model_tokenizer`:
AutoTokenizer, except for a generic fast tokenizer, loaded as saved), loaded straight; or, where
decoding is all a process does, the `tokenizers` library alone.

transformers' AutoTokenizer imports its configuration machinery, which imports torch
(transformers 5: `configuration_utils` -> `modeling_rope_utils` -> torch): 1.9 s of CPU and
~300 MB in every rollout worker, a process that otherwise never needs torch. So the driver
resolves the class once (`model_tokenizer`, `tokenizer_class_name`) and hands its name to
the workers (`RolloutSettings.tokenizer_class`); a worker loads that very class from the same
directory (`load_tokenizer`), which is what AutoTokenizer itself ends with once it has chosen
the class (its other arguments are a hub revision and telemetry: nothing for a local
directory). A class that is not transformers' own (remote code), or no name: `model_tokenizer`.

Even without torch, importing transformers costs a rollout worker ~1 s of CPU at start (the
2-core box, 2026-11-28), and a single-turn worker only decodes responses for the reward. A
fast tokenizer's `decode` is its `tokenizers` backend's decode (transformers'
`PreTrainedTokenizerFast._decode`), plus a clean-up of spaces when configured. So where the
driver's tokenizer is such a tokenizer, without clean-up and with transformers' own `decode`
and `_decode`, the driver serializes its backend as loaded (`plain_decoder_json`: transformers
may rebuild it on loading, e.g. Qwen2Tokenizer's byte-level decoder in place of the file's) and
the workers decode with `tokenizers` from that (`PlainDecoder`, `load_decoder`), never
importing transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenizer_class_name(tokenizer: Any) -> str:
    """The name under which `transformers` exports `tokenizer`'s class; '' if it does not
    (remote code, a wrapper): `load_tokenizer` then goes through `model_tokenizer`."""
    import transformers

    cls = type(tokenizer)
    return cls.__name__ if getattr(transformers, cls.__name__, None) is cls else ""


#: The tokenizer classes that mean "the backend in tokenizer.json, as it is" (transformers 4's
#: and 5's names of the generic fast tokenizer).
GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def model_tokenizer(path: str | Path) -> Any:
    """The tokenizer of model directory `path` as its `tokenizer_config.json` names it. A
    generic fast tokenizer (`GENERIC_FAST`: the embedded model's character-level one) loads
    as it was saved: transformers 5's AutoTokenizer goes by the model type instead (qwen2 ->
    Qwen2Tokenizer) and rebuilds its pipeline byte-level, which drops every space and newline
    of the embedded model's vocabulary (transformers 4 honoured the saved class). Any other
    through AutoTokenizer."""
    import json

    import transformers

    try:
        saved = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        saved = {}
    if isinstance(saved, dict) and saved.get("tokenizer_class") in GENERIC_FAST:
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def load_tokenizer(path: str | Path, class_name: str = "") -> Any:
    """The tokenizer of the model directory `path`: `transformers.<class_name>` (a name from
    `tokenizer_class_name`) loaded directly when it is a tokenizer class, else
    `model_tokenizer`."""
    import transformers

    cls = getattr(transformers, class_name, None) if class_name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls.from_pretrained(path)
    return model_tokenizer(path)


def _defined_by(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def plain_decoder_json(tokenizer: Any) -> str:
    """`tokenizer`'s `tokenizers` backend, serialized as loaded, when decoding with it gives
    what `tokenizer.decode` gives; '' otherwise. It does when `tokenizer` is a fast tokenizer
    whose `decode` and `_decode` are transformers' own (no subclass of its changes them) and
    that cleans up no spaces: then `decode` is the backend's decode, with
    `skip_special_tokens` passed through."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast
    cls = type(tokenizer)
    if not isinstance(tokenizer, fast) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return ""
    if _defined_by(cls, "_decode") is not fast:
        return ""
    if _defined_by(cls, "decode") is not transformers.PreTrainedTokenizerBase:
        return ""
    return tokenizer.backend_tokenizer.to_str()


class PlainDecoder:
    """Decoding alone, with the `tokenizers` library, from a backend that `plain_decoder_json`
    serialized (it decodes as the transformers tokenizer does)."""

    def __init__(self, spec: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(spec)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """`ids` as text, as the transformers tokenizer's `decode` gives it."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_decoder(path: str | Path, class_name: str = "", spec: str = "") -> Any:
    """What decodes responses in a process that only decodes: a `PlainDecoder` of `spec` (a
    `plain_decoder_json` answer), or without one the tokenizer itself (`load_tokenizer`)."""
    if spec:
        return PlainDecoder(spec)
    return load_tokenizer(path, class_name)
