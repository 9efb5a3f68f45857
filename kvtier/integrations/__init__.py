"""Engine plug-ins. `kvtier.integrations.vllm` is imported only by vLLM's tier factory (it and `vllm_specs` import
vLLM); `engine_identity` and `kv_groups` are plain Python and import anywhere."""
