"""Where a request goes, as data for the balancer: prompt prefixes and sessions (affinity),
token ids (router tokenizer or the engine's, remembered), response ids, LoRA adapters in
flight, the prefill/decode choice.
"""
