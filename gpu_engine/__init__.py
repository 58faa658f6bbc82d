"""morphoweb GPU engine: DPF keys, page matrices, CPU/CUDA backends, batching, the Engine (no Django)."""
