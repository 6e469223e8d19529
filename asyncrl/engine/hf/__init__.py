"""asyncrl's own engine server (`hf_infer`): a transformers model behind SGLang's native HTTP
protocol, with continuous batching, pause modes and a weight-update group."""
