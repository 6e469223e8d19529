"""Engine: what generates. The SGLang-protocol client, the engine fleet (launch, weight-update
group, sync, healing), SGLang launch + router (`sglang.py`), and asyncrl's own transformers
engine server (`hf/`) that speaks the same protocol on a CPU."""
