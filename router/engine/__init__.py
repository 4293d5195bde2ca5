"""Engine metrics: read each vLLM/SGLang engine's Prometheus text into `EngineReading`s."""
