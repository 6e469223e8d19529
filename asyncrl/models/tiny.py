"""The embedded default model: a character-level tokenizer and a tiny Qwen2 causal LM, given a
short supervised warm-start on the synthetic arithmetic task so that RL starts with signal.

The task format: prompt ``12+345=`` (raw) or the chat-templated user message; the response is
the answer digits followed by ``<|im_end|>`` (the EOS token). Everything is built locally, no hub.
`model_args.warm_start_mix` adds environment idioms to the corpus (`mix.py`): another model,
cached under its own key; without a mix the model and its key are the ones from before mixes.
`model_args.embedded_arch: moe` builds the same task's model as a tiny Qwen3-MoE (routed experts
in every layer, top-k routing, no shared expert): again its own model under its own key, the
dense default's key unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.config.moe_checks import EMBEDDED_LAYERS, EMBEDDED_MOE
from asyncrl.data.synthetic import EMBEDDED_TASK, ArithmeticTask, make_rows
from asyncrl.logs import StepProgress
from asyncrl.models import mix as mixes
from asyncrl.models.generate import (  # noqa: F401 - re-exported: the model's evaluation API
    evaluate_accuracy,
    greedy_responses,
    render_prompts,
)
from asyncrl.models.warm_start import warm_start

# Bump when a change here alters what gets built: it is part of the cache key.
CODE_VERSION = 1
# Bump when the corpus of a mix (`mix.py`) changes: part of the key of every mixed model only,
# so the default model's key (and its cached directory) never moves with it.
MIX_VERSION = 1
MIX_FIELDS = ("mix", "mix_episodes", "mix_fraction", "mix_batch_size")
# The MoE variant's fields: part of the key of the MoE model only (the dense key never moves).
MOE_FIELDS = ("arch", "num_experts", "experts_per_token", "moe_intermediate_size")
ARCHS = ("dense", "moe")
PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK)
MARKER = "asyncrl_embedded.json"  # written last: its presence means the directory is complete
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built model; its hash names the cache directory."""

    task: ArithmeticTask = EMBEDDED_TASK
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = EMBEDDED_LAYERS
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    train_rows: int = 12_000
    heldout_rows: int = 500
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    chat_fraction: float = 0.1  # share of warm-start batches rendered with the chat template
    # Share of warm-start answers written as an estimate, ``~360`` for 357 (see `warm_start.answer_text`).
    estimate_fraction: float = 0.6
    seed: int = 0
    mix: tuple[str, ...] = ()  # environment idioms added to the corpus (`mix.py`); () = none
    mix_episodes: int = 4000  # corpus episodes per mix
    mix_fraction: float = 0.2  # share of warm-start steps that take a batch of mix episodes
    mix_batch_size: int = 16  # episodes per mix batch (each is ~10x an arithmetic example)
    arch: str = "dense"  # "dense": Qwen2; "moe": Qwen3-MoE, experts in every layer
    num_experts: int = EMBEDDED_MOE["num_experts"]  # MoE only: routed experts per layer
    experts_per_token: int = EMBEDDED_MOE["num_experts_per_tok"]  # MoE only: router top-k
    moe_intermediate_size: int = EMBEDDED_MOE["moe_intermediate_size"]  # MoE: expert width

    def digest(self) -> str:
        spec = asdict(self)
        if self.mix:
            spec["mix_version"] = MIX_VERSION
        else:  # without a mix the key is the one it was before mixes existed
            for name in MIX_FIELDS:
                del spec[name]
        if self.arch == "dense":  # likewise the dense key is the one from before MoE
            for name in MOE_FIELDS:
                del spec[name]
        blob = json.dumps({"spec": spec, "code": CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_SPEC = TinyModelSpec()


def embedded_spec(mix: Sequence[str] = (), arch: str = "dense") -> TinyModelSpec:
    """The spec of the embedded model with ``mix`` (`model_args.warm_start_mix`) in its
    warm-start corpus and architecture ``arch`` (`model_args.embedded_arch`): the default spec
    itself for an empty mix and the dense architecture."""
    if arch not in ARCHS:
        raise ValueError(f"embedded_arch: unknown {arch!r} (known: {', '.join(ARCHS)})")
    names = mixes.canonical(mix)
    spec = replace(DEFAULT_SPEC, mix=names) if names else DEFAULT_SPEC
    return replace(spec, arch=arch) if arch != "dense" else spec


def build_tokenizer() -> Any:
    """Character-level tokenizer (printable ASCII + newline + specials) as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE without merges splits text into single characters; unknown characters become <unk>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=DEFAULT_SPEC.max_position_embeddings,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model_class(spec: TinyModelSpec) -> tuple[Any, Any, dict[str, Any]]:
    """(config class, model class, architecture-specific config kwargs) of ``spec.arch``."""
    import transformers as tf

    if spec.arch == "dense":
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, {}
    if spec.arch != "moe":
        raise ValueError(f"embedded_arch: unknown {spec.arch!r} (known: {', '.join(ARCHS)})")
    moe = {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": True,  # Qwen3-MoE's released models renormalise the top-k
        "decoder_sparse_step": 1,  # every layer routed: replay has something in each
        "head_dim": spec.hidden_size // spec.num_heads,
        "router_aux_loss_coef": 0.0,  # no auxiliary loss: the warm start is plain CE
    }
    return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, moe


def build_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """A randomly initialised tiny Qwen2 (or, ``spec.arch == "moe"``, Qwen3-MoE) causal LM
    (tied embeddings, fp32)."""
    import torch
    from transformers import GenerationConfig

    config_class, model_class, extra = _model_class(spec)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(spec.seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def build_embedded_model(
    out_dir: str | Path, spec: TinyModelSpec = DEFAULT_SPEC, progress: bool = False
) -> dict[str, Any]:
    """Build, warm-start and save the model into ``out_dir``; returns the recorded report.
    ``progress`` shows the warm-start's steps, loss and ETA on stderr (it takes minutes)."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    t0, cpu0 = time.perf_counter(), time.process_time()
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    if progress:
        with StepProgress(spec.steps, "asyncrl: warm-start") as bar:
            loss = warm_start(model, tokenizer, spec, lambda n, x: bar.update(n, loss=x))
    else:
        loss = warm_start(model, tokenizer, spec)
    train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    heldout = make_rows(spec.task, "heldout", spec.heldout_rows, spec.seed)
    report: dict[str, Any] = {
        "spec": asdict(spec),
        "code_version": CODE_VERSION,
        "digest": spec.digest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "warm_start_seconds": round(train_s, 2),
        "warm_start_cpu_seconds": round(train_cpu_s, 2),  # wall time on a busy box misleads
        "final_train_loss": round(loss, 4),
        "heldout_accuracy": evaluate_accuracy(model, tokenizer, heldout, template="none"),
    }
    if spec.chat_fraction > 0:
        report["heldout_accuracy_chat"] = evaluate_accuracy(
            model, tokenizer, heldout, template="native"
        )
    if spec.mix:
        report["mix_version"] = MIX_VERSION
        report.update(mixes.report(model, tokenizer, spec.mix))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps(report, indent=2) + "\n")
    return report


def default_cache_dir() -> Path:
    """``$ASYNCRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/asyncrl``, else ``~/.cache/asyncrl``."""
    if os.environ.get("ASYNCRL_CACHE_DIR"):
        return Path(os.environ["ASYNCRL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncrl"


def ensure_embedded_model(
    cache_dir: str | Path | None = None, spec: TinyModelSpec = DEFAULT_SPEC, verbose: bool = True
) -> Path:
    """The HF model directory of ``spec``, built once under ``cache_dir`` and reused.

    Concurrent callers serialise on a file lock; the build happens in a temporary sibling that
    is renamed into place only when complete, so a reader never sees a half-written model.
    """
    from filelock import FileLock  # a dependency of huggingface_hub, hence of transformers

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"embedded-{spec.digest()}"
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / MARKER).is_file():
            return final  # another process built it while we waited
        if verbose:
            print(
                f"asyncrl: building the embedded model into {final} (once; minutes on a CPU)",
                file=sys.stderr,
            )
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
        try:
            report = build_embedded_model(tmp, spec, progress=verbose)
            if final.exists():  # incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(
            f"asyncrl: embedded model ready: warm-start {report['warm_start_seconds']}s, "
            f"held-out greedy accuracy {report['heldout_accuracy']:.1%}",
            file=sys.stderr,
        )
    return final


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m asyncrl.models.tiny [--cache-dir DIR]``: build (once) and print the report."""
    import argparse

    parser = argparse.ArgumentParser(description="Build the embedded tiny model (cached).")
    parser.add_argument("--cache-dir", default=None, help="default: ~/.cache/asyncrl")
    args = parser.parse_args(argv)
    path = ensure_embedded_model(args.cache_dir)
    print(path)
    print((path / MARKER).read_text(), end="")


if __name__ == "__main__":
    main()
