"""The tokenizer a process loads: the class AutoTokenizer picks, loaded straight.

transformers' AutoTokenizer imports its configuration machinery, which imports torch
(transformers 5: `configuration_utils` -> `modeling_rope_utils` -> torch): 1.9 s of CPU and
~300 MB in every rollout worker, a process that otherwise never needs torch. So the driver
resolves the class once through AutoTokenizer (`tokenizer_class_name`) and hands its name to
the workers (`RolloutSettings.tokenizer_class`); a worker loads that very class from the same
directory (`load_tokenizer`), which is what AutoTokenizer itself ends with once it has chosen
the class (its other arguments are a hub revision and telemetry: nothing for a local
directory). A class that is not transformers' own (remote code), or no name: AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenizer_class_name(tokenizer: Any) -> str:
    """The name under which `transformers` exports `tokenizer`'s class; '' if it does not
    (remote code, a wrapper): `load_tokenizer` then goes through AutoTokenizer."""
    import transformers

    cls = type(tokenizer)
    return cls.__name__ if getattr(transformers, cls.__name__, None) is cls else ""


def load_tokenizer(path: str | Path, class_name: str = "") -> Any:
    """The tokenizer of the model directory `path`: `transformers.<class_name>` (a name from
    `tokenizer_class_name`) loaded directly when it is a tokenizer class, else `AutoTokenizer`."""
    import transformers

    cls = getattr(transformers, class_name, None) if class_name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)
