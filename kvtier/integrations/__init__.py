"""Engine plug-ins. `vllm` and `sglang` are the two engines' subpackages: their `tier`/`backend` modules import
the engine and are imported only by the engine's own factory; the rest (identity, groups, pools) is plain Python
and imports anywhere. The modules here are shared by both."""
