"""What the engines report having done, read after a weight sync: the hf engines' /server_info
tallies, summed over the engines into the fleet's `engines/` metrics."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from asyncrl.engine.client import EngineClient
from asyncrl.engine.versions import HF_SERVER_VERSION

log = logging.getLogger(__name__)

#: What an engine's /server_info tallies (hf engines) -> the prefix of its `engines/` metric.
TALLIES = (("pauses", "pauses_"), ("bucket_formats", "buckets_"), ("param_dtypes", "params_"))


async def read_tallies(clients: Sequence[EngineClient]) -> dict[str, float] | None:
    """The engines' tallies summed over them: pauses by mode (`engines/pauses_<mode>`) and
    weight buckets received by load_format (`engines/buckets_<format>`), totals since each
    started, and their parameter tensors by dtype (`engines/params_<torch dtype>`). Only hf
    engines report them, so only they are asked (their profile is known since the sync: no
    extra call to an SGLang engine). None (logged) when an engine does not answer."""
    tallies: Counter[str] = Counter()
    profiles = await asyncio.gather(*(c.profile() for c in clients))
    hf = [c for c, p in zip(clients, profiles) if p.version == HF_SERVER_VERSION]
    infos = await asyncio.gather(*(c.server_info() for c in hf), return_exceptions=True)
    if failed := next((i for i in infos if isinstance(i, BaseException)), None):
        log.warning("engine tallies not read after a sync: %s", failed)
        return None
    for info in infos:
        for field, prefix in TALLIES:
            for name, count in (info.get(field) or {}).items():
                tallies[f"{prefix}{name}"] += int(count)
    return {f"engines/{k}": float(v) for k, v in tallies.items()}
