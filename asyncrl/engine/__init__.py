"""Engine: what generates. The SGLang-protocol client, the launchers of each backend
(`launchers.py`), the engine fleet (weight-update groups, sync, healing), SGLang launch + router
(`sglang.py`), and asyncrl's own transformers engine server (`hf/`) that speaks the same
protocol on a CPU."""
