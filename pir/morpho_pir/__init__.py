"""morpho-pir: the protocol core client and server share (PRG, DPF keys v1/v2, sizes, state digests)."""
