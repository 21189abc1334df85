// Package lora checks PEFT LoRA adapter directories (adapter_config.json and
// adapter_model.safetensors) before any inference runtime is asked to load
// them, so that a missing, truncated or inconsistent adapter fails with a
// clear message on the node instead of an opaque error inside vLLM or SGLang.
package lora
