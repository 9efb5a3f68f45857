"""Engine plug-ins. `kvtier.integrations.vllm` is imported only by vLLM's tier factory (it imports vLLM);
`engine_identity` and `kv_groups` are plain Python and import anywhere."""
